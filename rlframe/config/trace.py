"""Which config keys a run reads: an opt-in trace used to prove that no key is accepted and ignored.

With `RLFRAME_TRACE_CONFIG_READS=DIR` in the environment, the driver and every worker record each
config key the first time it is read (attribute or item access, `OmegaConf.select`) by appending it
to `DIR/<pid>.keys`. `tests/e2e/test_config_reads.py` runs real trainings this way and checks that every
key of the config is read by some process or reported as having no effect in that config.
Off (the default), nothing is patched.
"""

from __future__ import annotations

import os

ENV = "RLFRAME_TRACE_CONFIG_READS"
_seen: set[str] = set()


def enable_from_env() -> None:
    """Start tracing in this process when the environment asks for it (idempotent)."""
    folder = os.environ.get(ENV)
    if not folder or _seen:
        return
    os.makedirs(folder, exist_ok=True)
    _patch(os.path.join(folder, f"{os.getpid()}.keys"))


def _patch(path: str) -> None:
    from omegaconf import DictConfig, OmegaConf

    _seen.add("")  # marks this process as patched

    def record(node, key) -> None:
        try:
            full = node._get_full_key(key)
        except Exception:  # a key that does not exist: the read fails on its own
            return
        if full and full not in _seen:
            _seen.add(full)
            with open(path, "a") as f:
                f.write(full + "\n")

    getattr_, getitem_, select_ = DictConfig.__getattr__, DictConfig.__getitem__, OmegaConf.select

    def traced_getattr(self, key):
        record(self, key)
        return getattr_(self, key)

    def traced_getitem(self, key):
        record(self, key)
        return getitem_(self, key)

    def traced_select(cfg, key, *args, **kwargs):
        if isinstance(cfg, DictConfig) and key:
            prefix = cfg._get_full_key("")  # a select on a sub-section names keys relative to it
            full = f"{prefix}.{key}" if prefix else key
            if full not in _seen:
                _seen.add(full)
                with open(path, "a") as f:
                    f.write(full + "\n")
        return select_(cfg, key, *args, **kwargs)

    DictConfig.__getattr__ = traced_getattr
    DictConfig.__getitem__ = traced_getitem
    OmegaConf.select = staticmethod(traced_select)
