"""verl 0.9.1's own `core_algos`, imported from its unpacked wheel, for differential tests.

The source is found at `$RLFRAME_VERL_SRC` (a folder holding the `verl` package), else at
/tmp/verl091/x, else it is fetched once into the rlframe cache (`pip download --no-deps verl==0.9.1`, the
wheel unpacked, never installed). Only when none of that works (no package index) do the tests that need
it skip, saying so.
verl is never installed into the environment: its package is put on sys.path for this process
only, and the two modules its import chain needs but never calls in core_algos (`codetiming`,
`orjson`) are replaced by empty stand-ins when absent.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest

VERL_VERSION = "0.9.1"
_UNUSED_IMPORTS = ("codetiming", "orjson")


def _has_core_algos(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "verl", "trainer", "ppo", "core_algos.py"))


def _fetch_into_cache() -> str:
    """verl's wheel unpacked under the rlframe cache (downloaded on first use); '' when pip cannot get it."""
    import shutil
    import subprocess
    import tempfile
    import zipfile

    from rlframe.utils.cache import cache_dir

    target = os.path.join(cache_dir(), f"verl-{VERL_VERSION}-src")
    if _has_core_algos(target):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"verl=={VERL_VERSION}", "-d", tmp],
            capture_output=True,
        )
        wheels = [name for name in os.listdir(tmp) if name.endswith(".whl")]
        if fetched.returncode != 0 or not wheels:
            return ""
        partial = f"{target}.tmp.{os.getpid()}"
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            wheel.extractall(partial)
        try:
            os.replace(partial, target)
        except OSError:  # another test process (pytest-xdist) unpacked it first: its copy is whole (renamed whole)
            shutil.rmtree(partial, ignore_errors=True)
            if not _has_core_algos(target):
                raise
    return target


def verl_source() -> str:
    """The folder holding verl 0.9.1's package: $RLFRAME_VERL_SRC, /tmp/verl091/x, or the cache."""
    if "RLFRAME_VERL_SRC" in os.environ:
        return os.environ["RLFRAME_VERL_SRC"]
    if _has_core_algos("/tmp/verl091/x"):
        return "/tmp/verl091/x"
    return _fetch_into_cache()


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {"__init__": lambda self, *a, **k: None})

    module.__getattr__ = missing
    return module


def verl_core_algos():
    """verl.trainer.ppo.core_algos of verl 0.9.1, or a pytest skip when its source is absent."""
    return verl_module("verl.trainer.ppo.core_algos")


# modules the SFT dataset's import chain needs but the text-only path never calls: `datasets` (the RL dataset's,
# not installed here) and verl's Qwen2-VL patches (they import names transformers 5.x no longer has)
_SFT_UNUSED_IMPORTS = ("datasets", "verl.models.transformers.qwen2_vl")


def _stand_in_unused(names: tuple[str, ...]) -> None:
    """Empty stand-ins for the modules `names` that an import chain needs but the compared functions never call."""
    for name in names:
        if name not in sys.modules and (name.startswith("verl.") or importlib.util.find_spec(name) is None):
            sys.modules[name] = _stand_in(name)


def verl_multiturn_sft_dataset():
    """verl 0.9.1's MultiTurnSFTDataset class, or a pytest skip when its source is absent."""
    _stand_in_unused(_SFT_UNUSED_IMPORTS)
    return verl_module("verl.utils.dataset.multiturn_sft_dataset").MultiTurnSFTDataset


def verl_distillation_losses():
    """verl 0.9.1's `trainer.distillation.losses` and `trainer.distillation.fsdp.losses` modules, or a pytest skip.

    Their import chain reaches verl's dataset package (hence the SFT dataset's stand-ins); the loss functions
    never call it.
    """
    _stand_in_unused(_SFT_UNUSED_IMPORTS)
    return verl_module("verl.trainer.distillation.losses"), verl_module("verl.trainer.distillation.fsdp.losses")


def verl_module(name: str):
    """One module of verl 0.9.1 by its dotted name, or a pytest skip when verl's source is absent."""
    source = verl_source()
    if not source or not _has_core_algos(source):
        pytest.skip(f"verl {VERL_VERSION} source not found ({source or 'pip download failed'}; set RLFRAME_VERL_SRC)")
    if source not in sys.path:
        sys.path.append(source)
    for unused in _UNUSED_IMPORTS:
        if unused not in sys.modules and importlib.util.find_spec(unused) is None:
            sys.modules.setdefault(unused, _stand_in(unused))
    module = importlib.import_module(name)
    version = importlib.import_module("verl").__version__
    assert version == VERL_VERSION, f"{source} holds verl {version}, not {VERL_VERSION}"
    return module


def verl_actor_config(loss_mode: str = "vanilla", **fields):
    """A verl ActorConfig for the policy losses: `policy_loss.*` fields by name, the rest on the actor."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy_names = {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta"}
    policy = PolicyLossConfig(loss_mode=loss_mode, **{k: v for k, v in fields.items() if k in policy_names})
    actor = {k: v for k, v in fields.items() if k not in policy_names}
    return ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy, **actor)
