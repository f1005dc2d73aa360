"""Which config keys a run reads: an opt-in trace used to prove that no key is accepted and ignored.

With `RLFRAME_TRACE_CONFIG_READS=DIR` in the environment, the driver and every worker record each
config key the first time it is read (attribute or item access, `OmegaConf.select`) by appending it
to `DIR/<pid>.keys`. `tests/e2e/test_config_reads.py` runs real trainings this way and checks that every
key of the config is read by some process or reported as having no effect in that config.

The trace is a `ReadTrace` object owned by whoever runs the code to trace: the driver's `main` holds
one for the run, a worker process (`rlframe.single_controller`) one for its lifetime. It records only
inside `with trace:` (the driver: the whole run; a worker: its construction and each call the group
makes), where it wraps `DictConfig.__getattr__`/`__getitem__` and `OmegaConf.select`; leaving the
block puts the originals back. Off (the default), `from_env()` gives a context that patches nothing.
"""

from __future__ import annotations

import contextlib
import os

ENV = "RLFRAME_TRACE_CONFIG_READS"


class ReadTrace:
    """The config keys read in this process, appended to `path` the first time each is read (while entered)."""

    def __init__(self, path: str):
        self.path = path
        self.seen: set[str] = set()
        self._saved: list[tuple] = []  # the methods each (nested) entry replaced, innermost last

    def _record(self, full: str) -> None:
        if full and full not in self.seen:
            self.seen.add(full)
            with open(self.path, "a") as f:
                f.write(full + "\n")

    def __enter__(self) -> ReadTrace:
        from omegaconf import DictConfig, OmegaConf

        getattr_, getitem_, select_ = DictConfig.__getattr__, DictConfig.__getitem__, OmegaConf.select
        self._saved.append((getattr_, getitem_, OmegaConf.__dict__["select"]))
        record = self._record

        def full_key(node, key) -> str:
            try:
                return node._get_full_key(key)
            except Exception:  # a key that does not exist: the read fails on its own
                return ""

        def traced_getattr(node, key):
            record(full_key(node, key))
            return getattr_(node, key)

        def traced_getitem(node, key):
            record(full_key(node, key))
            return getitem_(node, key)

        def traced_select(cfg, key, *args, **kwargs):
            if isinstance(cfg, DictConfig) and key:
                prefix = cfg._get_full_key("")  # a select on a sub-section names keys relative to it
                record(f"{prefix}.{key}" if prefix else key)
            return select_(cfg, key, *args, **kwargs)

        DictConfig.__getattr__ = traced_getattr
        DictConfig.__getitem__ = traced_getitem
        OmegaConf.select = staticmethod(traced_select)
        return self

    def __exit__(self, *exc) -> None:
        from omegaconf import DictConfig, OmegaConf

        DictConfig.__getattr__, DictConfig.__getitem__, OmegaConf.select = self._saved.pop()


def from_env() -> contextlib.AbstractContextManager:
    """This process's trace when the environment asks for one (`DIR/<pid>.keys`), else a context that does nothing."""
    folder = os.environ.get(ENV)
    if not folder:
        return contextlib.nullcontext()
    os.makedirs(folder, exist_ok=True)
    return ReadTrace(os.path.join(folder, f"{os.getpid()}.keys"))
