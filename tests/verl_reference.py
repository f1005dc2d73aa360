"""verl 0.9.1's own `core_algos`, imported from its unpacked wheel, for differential tests.

The source is found at `$RLFRAME_VERL_SRC` (a folder holding the `verl` package), else at
/tmp/verl091/x (`pip download --no-deps verl==0.9.1 -d /tmp/verl091 && unzip -q -o
/tmp/verl091/*.whl -d /tmp/verl091/x`). Without it the tests that need it skip, saying so.
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

VERL_SRC = os.environ.get("RLFRAME_VERL_SRC", "/tmp/verl091/x")
_UNUSED_IMPORTS = ("codetiming", "orjson")


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
    if not os.path.isfile(os.path.join(VERL_SRC, "verl", "trainer", "ppo", "core_algos.py")):
        pytest.skip(f"verl 0.9.1 source not found at {VERL_SRC} (set RLFRAME_VERL_SRC)")
    if VERL_SRC not in sys.path:
        sys.path.append(VERL_SRC)
    for name in _UNUSED_IMPORTS:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules.setdefault(name, _stand_in(name))
    module = importlib.import_module("verl.trainer.ppo.core_algos")
    version = importlib.import_module("verl").__version__
    assert version == "0.9.1", f"{VERL_SRC} holds verl {version}, not 0.9.1"
    return module


def verl_actor_config(loss_mode: str = "vanilla", **fields):
    """A verl ActorConfig for the policy losses: `policy_loss.*` fields by name, the rest on the actor."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy_names = {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta"}
    policy = PolicyLossConfig(loss_mode=loss_mode, **{k: v for k, v in fields.items() if k in policy_names})
    actor = {k: v for k, v in fields.items() if k not in policy_names}
    return ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy, **actor)
