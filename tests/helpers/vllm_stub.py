"""A stand-in `vllm` package that records what the rollout reads while the engine is built."""

from __future__ import annotations

import dataclasses
import random
import types
from contextlib import contextmanager

import numpy as np
import torch

from rlframe.workers.rollout.vllm_rollout import (
    engine_environment,
)


def _reseed_everything(seed: int) -> None:
    """What vLLM's set_random_seed does to the process."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------- a stand-in engine
class _Model(torch.nn.Module):
    """What the engine's worker holds: two parameters, vLLM's load_weights contract (names loaded)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2, bias=False)
        self.b = torch.nn.Linear(2, 2, bias=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name in params:
                params[name].data.copy_(tensor)
                loaded.add(name)
        return loaded


def _fake_vllm(record: dict, *, new_api: bool = True) -> types.ModuleType:
    """A `vllm` package with the parts the rollout touches: 0.33's API, or an older one (new_api=False)."""
    import os

    fields = ["model", "seed", "disable_custom_all_reduce"] + (["logprobs_mode"] if new_api else [])
    engine_args = dataclasses.make_dataclass("EngineArgs", [(name, object, None) for name in fields])

    class Worker:
        vllm_config = object()

        def __init__(self):
            self.model = _Model()
            if new_api:
                self._sleep_saved_buffers = {}

        def get_model(self):
            return self.model

    class LLM:
        def __init__(self, **kwargs):
            record["kwargs"] = kwargs
            record["env"] = {name: os.environ.get(name) for name in engine_environment(0, 2)}
            _reseed_everything(kwargs["seed"])  # vLLM's set_random_seed at engine start
            self.worker = Worker()
            record["worker"] = self.worker

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [method(self.worker, *args, **(kwargs or {}))]

        def sleep(self, level=1):
            record.setdefault("calls", []).append(("sleep", level))

        def reset_prefix_cache(self):
            record.setdefault("calls", []).append(("reset_prefix_cache",))

        if new_api:

            def wake_up(self, tags=None):
                record.setdefault("calls", []).append(("wake_up", tags))
        else:

            def wake_up(self):
                record.setdefault("calls", []).append(("wake_up", None))

    @contextmanager
    def set_current_vllm_config(config):
        record["config_context"] = config
        yield

    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    vllm.__version__ = "0.33.0" if new_api else "0.8.0"
    config = types.ModuleType("vllm.config")
    config.set_current_vllm_config = set_current_vllm_config
    engine = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = engine_args
    return {"vllm": vllm, "vllm.config": config, "vllm.engine": engine, "vllm.engine.arg_utils": arg_utils}
