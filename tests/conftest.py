"""Shared fixtures: the tiny offline model, GPU skipping, and small Ray clusters."""

import os

import pytest

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


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One RLFRAME_CACHE (built-in model and task data) for every end-to-end run of the session."""
    return tmp_path_factory.mktemp("rlframe_cache")
