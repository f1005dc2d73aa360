"""Shared fixtures: the tiny offline model, GPU skipping, and small Ray clusters."""

import os

import pytest

from rlframe.utils.cache import cache_dir as rlframe_cache_dir

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny random-init Qwen2 model + tokenizer on disk, built once per test session."""
    from rlframe.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


# Read at import, before any test's monkeypatch: the converted SmolLM2 lives in the machine's own
# rlframe cache (RLFRAME_CACHE or ~/.cache/rlframe), so repeated runs and CI convert it once.
PERSISTENT_CACHE = rlframe_cache_dir()


@pytest.fixture(scope="session")
def smollm2_path():
    """builtin://smollm2-135m-instruct as a folder (real pretrained Llama, fp32), converted once per machine."""
    from rlframe.models.builtin import prepare_builtin

    return prepare_builtin("smollm2-135m-instruct", cache=PERSISTENT_CACHE)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One RLFRAME_CACHE (built-in model and task data) for every end-to-end run of the session."""
    return tmp_path_factory.mktemp("rlframe_cache")
