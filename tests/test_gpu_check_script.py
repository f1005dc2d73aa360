"""scripts/gpu_check.sh on a CPU: the dry run (plan, targets, imports, vLLM arguments) and the skip rules.

The GPU steps themselves run only on a GPU (docs/gpu.md); here the script must plan them, find every
test and bench it names, and report a missing package or GPU as a skip, never as a crash.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = (
    "nccl+offload", "bf16 packed", "flash-attn", "vllm rollout", "vllm tp2", "sglang rollout", "sglang tp2", "gpu_mfu",
    "grpo vllm",
)  # fmt: skip


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


def test_dry_run_plans_every_step_and_finds_every_target():
    out = _run("--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for step in STEPS:
        assert any(line.strip().startswith(step) and "catches" not in line for line in lines), step
        assert any(line.startswith(f"target of {step} ") and " ok " in line for line in lines), step
    for module in ("fsdp_utils", "vllm_rollout", "sglang_rollout", "attention", "main_ppo"):
        assert any(line.startswith("import rlframe.") and module in line and " ok" in line for line in lines), module
    engine_row = next(line for line in lines if line.startswith("vLLM engine arguments"))
    assert "'disable_custom_all_reduce': True" in engine_row and "'LOCAL_RANK': '0'" in engine_row
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM" in engine_row
    sglang_row = next(line for line in lines if line.startswith("SGLang engine arguments"))
    assert " ok " in sglang_row and "'enable_memory_saver': True" in sglang_row
    assert any(line.startswith("GRPO step's config") and " ok " in line for line in lines)


def test_without_gpu_or_package_steps_are_skipped_with_the_reason():
    import importlib.util

    out = _run("--only", "nccl+offload,flash-attn", "--budget-s", "60")
    lines = out.stdout.splitlines()
    assert out.returncode == 1  # no GPU is a failure of the environment row, not of the steps
    assert any(line.startswith("environment") and "FAILED: no GPU visible" in line for line in lines)
    assert any(line.startswith("installed set") and "vllm" in line for line in lines)  # against the gpu pins
    assert any(line.startswith("nccl+offload") and "skipped: needs 1 GPUs, 0 visible" in line for line in lines)
    if importlib.util.find_spec("flash_attn") is None:
        assert any(line.startswith("flash-attn") and "skipped: flash-attn not installed" in line for line in lines)


def test_unknown_step_is_refused_naming_the_steps():
    out = _run("--only", "nccl,warp-drive", "--dry-run")
    assert out.returncode == 2
    assert "unknown step(s) ['nccl', 'warp-drive']" in out.stderr and "'nccl+offload'" in out.stderr
