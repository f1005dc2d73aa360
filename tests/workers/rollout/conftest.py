"""Fixtures of the rollout tests."""

from __future__ import annotations

import os

import pytest
from helpers.world import free_port


@pytest.fixture(scope="module")
def world():
    """A one-process gloo world, as a worker's (RANK, LOCAL_RANK, MASTER_* set by the worker group)."""
    import torch.distributed as dist

    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    saved = {key: os.environ.get(key) for key in [*env, "MASTER_PORT"]}
    os.environ.update(env, MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()  # the default group included
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(params=["tiny", "smollm2"])
def chat_model(request):
    """(model folder, tokenizer) of builtin://tiny and of SmolLM2-135M-Instruct: the two tokenizers and chat templates
    that tool answers are checked on."""
    from transformers import AutoTokenizer

    path = request.getfixturevalue("tiny_model_path" if request.param == "tiny" else "smollm2_path")
    return path, AutoTokenizer.from_pretrained(path)
