"""Shared fixtures: the tiny offline model, GPU skipping, the vLLM environment's split, and small Ray clusters.

`scripts/test.sh` (CI) sets RLFRAME_STRICT_SKIPS=1: there a skipped test fails unless it is marked `gpu`.

Tests marked `vllm` run the real vLLM engine (its CPU build here). vLLM pins its own transformers, so they run in an
environment of their own: `scripts/test.sh` runs the suite in `.venv`, then the `vllm` tests in `.venv-vllm` with
RLFRAME_TEST_ENV=vllm, which selects them alone. Where vLLM is not installed they are deselected (not skipped) and
the summary says where they run.
"""

import os
from collections import Counter

import pytest
import torch

from rlframe.utils.cache import cache_dir as rlframe_cache_dir
from rlframe.workers.rollout import vllm_rollout

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


VLLM_ENV = os.environ.get("RLFRAME_TEST_ENV") == "vllm"
# scripts/test.sh on several processes runs the suite in two passes: RLFRAME_TEST_PASS=parallel keeps every test but
# those marked `serial` (on N processes), then RLFRAME_TEST_PASS=serial keeps those alone (on one, nothing beside them)
TEST_PASS = os.environ.get("RLFRAME_TEST_PASS")
if TEST_PASS not in (None, "", "parallel", "serial"):
    raise ValueError(f"RLFRAME_TEST_PASS={TEST_PASS!r}: accepted are parallel, serial, or unset (every test)")


def pytest_collection_modifyitems(config, items):
    import importlib.util

    import torch

    # the vllm environment keeps only the vllm tests; an environment without vllm keeps all but them
    if VLLM_ENV or importlib.util.find_spec("vllm") is None:
        keep = [item for item in items if ("vllm" in item.keywords) == VLLM_ENV]
        dropped = [item for item in items if ("vllm" in item.keywords) != VLLM_ENV]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            config._rlframe_vllm_deselected = 0 if VLLM_ENV else len(dropped)
            if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its controller prints the summary
                config.workeroutput["rlframe_vllm_deselected"] = config._rlframe_vllm_deselected
        items[:] = keep
    if TEST_PASS:
        wanted = TEST_PASS == "serial"
        config.hook.pytest_deselected(items=[item for item in items if ("serial" in item.keywords) != wanted])
        items[:] = [item for item in items if ("serial" in item.keywords) == wanted]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


STRICT_SKIPS = os.environ.get("RLFRAME_STRICT_SKIPS") == "1"  # scripts/test.sh sets it: CI's rule


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under RLFRAME_STRICT_SKIPS=1 only a test that needs a GPU may skip: any other skip fails, with its reason
    (a skipped test in CI is a test that does not exist; the test setup installs what the tests need)."""
    outcome = yield
    report = outcome.get_result()
    if STRICT_SKIPS and report.skipped and "gpu" not in item.keywords and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped outside a GPU test, which RLFRAME_STRICT_SKIPS=1 forbids: {reason}"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Under pytest-xdist (RLFRAME_TEST_WORKERS) the workers collect: each one's count of deselected vLLM tests."""
    count = getattr(node, "workeroutput", {}).get("rlframe_vllm_deselected", 0)
    node.config._rlframe_vllm_deselected = max(count, getattr(node.config, "_rlframe_vllm_deselected", 0))


FILE_SECONDS: Counter = Counter()  # each test file's setup, call and teardown time, for the closing summary


def pytest_runtest_logreport(report):
    FILE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = getattr(config, "_rlframe_vllm_deselected", 0)
    if count:
        terminalreporter.write_line(
            f"{count} vLLM test(s) deselected: vllm is not installed here; scripts/test.sh runs them in .venv-vllm"
        )
    if FILE_SECONDS:  # where CI's time goes (tests/README.md), module fixtures included
        total = sum(FILE_SECONDS.values())
        terminalreporter.section(f"seconds per file: the 30 slowest of {len(FILE_SECONDS)}, {total:.0f} s in all")
        for path, seconds in FILE_SECONDS.most_common(30):
            terminalreporter.write_line(f"{seconds:8.1f}s {path}")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny random-init Qwen2 model + tokenizer on disk, built once per test session."""
    from rlframe.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def tiny_vl_path(tmp_path_factory):
    """builtin://tiny-vl (a tiny random-init Qwen2-VL with tokenizer and image processor), built once per session."""
    from rlframe.models.tiny_vl import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


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


@pytest.fixture
def cuda_less_gpu(monkeypatch):
    """Let the rollout believe it runs on cuda:0 while every tensor stays on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cuda_rng = {"state": torch.ByteTensor([1, 2, 3])}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=0: cuda_rng["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=0: cuda_rng.update(state=state))
    monkeypatch.setattr(vllm_rollout, "installed_vllm_build", lambda: "cuda")  # the stand-in is a CUDA vLLM
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second worker on its node, which sees one GPU: cuda:0
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_ALLREDUCE_USE_FLASHINFER"):
        monkeypatch.delenv(name, raising=False)
