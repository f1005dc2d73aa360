"""scripts/gpu_check.sh and setup.sh's gpu branch on a CPU: the plan and its budget, the driver check, the skip rules.

The GPU steps themselves run only on a GPU (docs/gpu.md); here the script must plan them within one device
call (the end-to-end GRPO step first), find every test and bench it names, stop on a driver too old for its
torch, and report a missing package or GPU as a skip with its reason, never as a crash. A stand-in
`nvidia-smi` plays the driver.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = (
    "grpo vllm", "nccl+offload", "bf16 packed", "vllm rollout", "vllm async", "vllm lora", "flash-attn",
    "torch varlen", "gpu_mfu", "sglang rollout", "grpo hf", "activation offload", "vllm tp2", "vllm vl", "sglang tp2",
)  # fmt: skip
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
    *driver_version,name,compute_cap*) echo "$FAKE_DRIVER, NVIDIA H200, 9.0" ;;
    *driver_version*) echo "$FAKE_DRIVER" ;;
    *compute_cap*) echo "9.0" ;;
    *) echo "GPU 0: NVIDIA H200" ;;
esac
"""


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def _run(*args: str, env: dict | None = None, script: str = "gpu_check.sh") -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", script), *args],
        capture_output=True,
        text=True,
        env=env or dict(os.environ, PYTHON=sys.executable),
        cwd=ROOT,
        timeout=600,
    )


def _with_driver(tmp_path, version: str) -> dict:
    """An environment whose PATH has a stand-in nvidia-smi reporting this driver on one H200."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    return dict(
        os.environ, PYTHON=sys.executable, FAKE_DRIVER=version, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    )


@pytest.fixture(scope="module")
def dry_run() -> subprocess.CompletedProcess:
    return _run("--dry-run")


def test_dry_run_plans_every_step_and_finds_every_target(dry_run):
    assert dry_run.returncode == 0, dry_run.stdout + dry_run.stderr
    lines = dry_run.stdout.splitlines()
    for step in STEPS:
        assert any(line.strip().startswith(step) and "catches" not in line for line in lines), step
        assert any(line.startswith(f"target of {step} ") and " ok " in line for line in lines), step
    for module in ("fsdp_wrap", "vllm_rollout", "sglang_rollout", "attention", "main_ppo"):
        assert any(line.startswith("import rlframe.") and module in line and " ok" in line for line in lines), module
    engine_row = next(line for line in lines if line.startswith("vLLM engine arguments"))
    assert "'disable_custom_all_reduce': True" in engine_row and "'LOCAL_RANK': '0'" in engine_row
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM" in engine_row
    sglang_row = next(line for line in lines if line.startswith("SGLang engine arguments"))
    assert " ok " in sglang_row and "'enable_memory_saver': True" in sglang_row
    assert any(line.startswith("GRPO step's config") and " ok " in line for line in lines)


def test_dry_run_plan_fits_one_device_call_with_the_grpo_step_first(dry_run):
    lines = dry_run.stdout.splitlines()
    planned = [line.split()[0:2] for line in lines if re.match(r"  \S.*<= +\d+ s  \(sum", line)]
    assert planned[0] == ["grpo", "vllm"]
    budget = next(line for line in lines if line.startswith("budget: "))
    whole, setup, steps_s, total, limit = map(
        int,
        re.search(
            r"budget: (\d+) s .*= (\d+) s setup .*\+ (\d+) s of steps; .* sum to (\d+) s <= (\d+) s", budget
        ).groups(),
    )
    assert whole <= 540 < 600 and setup + steps_s == whole and total <= steps_s == limit
    sums = [int(s) for s in re.findall(r"\(sum +(\d+) s\)", dry_run.stdout)]
    assert sums[-1] == total <= steps_s
    dropped = next(line for line in lines if line.startswith("dropped when every planned step runs"))
    assert "vllm async" in dropped  # the plan says which steps a short budget drops, in priority order
    gaps = next(line for line in lines if line.startswith("not testable on 1 GPU: "))
    assert all(what in gaps for what in ("Ulysses sp>1 on nccl", "vLLM TP=2", "SGLang TP=2"))


def test_fit_drops_later_steps_in_priority_order_and_still_fits_a_shorter_one():
    steps = gpu_check.plan("/tmp/work")
    kept, dropped = gpu_check.fit(steps, 300)
    assert [s.name for s in kept] == ["grpo vllm", "nccl+offload"]  # 240 + 60
    assert dropped[0].name == "bf16 packed" and all(s.min_gpus == 1 for s in kept + dropped)
    kept, _ = gpu_check.fit(steps, 240 + 60 + 45)
    assert [s.name for s in kept] == ["grpo vllm", "nccl+offload", "flash-attn"]  # 45 s fits where 60 and 120 do not
    kept, dropped = gpu_check.fit(steps, gpu_check.BUDGET_S - gpu_check.SETUP_S)
    assert sum(s.timeout_s for s in kept) <= gpu_check.BUDGET_S - gpu_check.SETUP_S and kept[0].name == "grpo vllm"


def test_driver_problem_names_the_driver_the_need_and_the_fix():
    message = gpu_check.driver_problem("550.54.15", "2.14.0", "13.0")
    assert "550.54.15" in message and ">= 580" in message and "CUDA 13.0" in message and "cu128" in message
    assert gpu_check.driver_problem("580.159.03", "2.11.0+cu130", "13.0") is None
    assert gpu_check.driver_problem("550.54.15", "2.14.0+cu128", "12.8") is None  # CUDA 12.x runs on R525+
    assert gpu_check.driver_problem("470.82", "2.14.0+cu128", "12.8").startswith("NVIDIA driver 470.82 is too old")
    assert gpu_check.driver_problem("550.54.15", "2.13.0+cpu", None) is None


def test_old_driver_stops_the_check_before_installing_or_running(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "read_driver", lambda: {"version": "550.54.15", "names": ["NVIDIA H200"],
                                                          "compute_cap": "9.0", "gpus": 1})  # fmt: skip
    monkeypatch.setattr(gpu_check, "torch_probe", lambda python, env: {"version": "2.14.0", "cuda": "13.0"})
    monkeypatch.setattr(gpu_check, "provide_packages", lambda *a: pytest.fail("installed on a driver too old"))
    assert gpu_check.main(["--work-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^driver +FAILED: NVIDIA driver 550\.54\.15 is too old for torch 2\.14\.0", out, re.M)
    assert "stopped: " in out and "R580" in out and "grpo vllm" not in out


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
def test_offline_machine_skips_each_step_with_its_reason(tmp_path):
    """A driver, no registry (the index refuses), no GPU that torch sees: rows say what came from where and why."""
    env = _with_driver(tmp_path, "580.159.03")
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_FIND_LINKS="")
    out = _run("--only", "grpo vllm,nccl+offload,flash-attn", "--budget-s", "60", env=env)
    lines = out.stdout.splitlines()
    assert out.returncode == 1, out.stdout + out.stderr  # no GPU is a failure of the environment row, not of the steps
    rows = [line for line in lines if line and not line.startswith(("step ", "-"))]
    assert rows[0].startswith("driver ") and "580.159.03, 1 x NVIDIA H200 (compute capability 9.0)" in rows[0]
    assert rows[1].startswith("packages ") and "missing vllm: no registry access (pip: " in rows[1]
    assert any(line.startswith("environment") and "FAILED: no GPU visible" in line for line in lines)
    assert any(line.startswith("installed set") and "vllm" in line for line in lines)  # against the gpu pins
    assert any(line.startswith("not testable on 1 GPU") and "Ulysses sp>1 on nccl" in line for line in lines)
    assert any(line.startswith("nccl+offload") and "skipped: needs 1 GPUs, 0 visible" in line for line in lines)
    if importlib.util.find_spec("vllm") is None:
        grpo = next(line for line in lines if line.startswith("grpo vllm"))
        assert "skipped: vllm not installed (no registry access, too large to carry)" in grpo
    if importlib.util.find_spec("flash_attn") is None:
        assert any(line.startswith("flash-attn") and "skipped: flash-attn not installed (" in line for line in lines)


def test_a_step_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    start = time.monotonic()
    code, _ = gpu_check.run_bounded(["bash", "-c", "sleep 30 & sleep 30"], 1)  # the child holds the output pipe
    assert code is None and time.monotonic() - start < 10
    env = gpu_check.child_env()
    quick = gpu_check.Step("quick", "-", "command", "-c", ("print('3 passed')",), figure=r"(\d+) passed")
    result = gpu_check.run_step(quick, sys.executable, env, str(tmp_path))
    assert (result.status, result.figure) == ("passed", "3")
    assert (tmp_path / "logs" / "quick.log").read_text() == "3 passed\n"
    slow = gpu_check.Step("slow", "-", "command", "-c", ("import time; time.sleep(30)",), timeout_s=1)
    assert gpu_check.run_step(slow, sys.executable, env, str(tmp_path)).status == "FAILED: timeout after 1 s"


def test_unknown_step_is_refused_naming_the_steps():
    out = _run("--only", "nccl,warp-drive", "--dry-run")
    assert out.returncode == 2
    assert "unknown step(s) ['nccl', 'warp-drive']" in out.stderr and "'nccl+offload'" in out.stderr


def test_wheelhouse_downloads_the_core_pins_the_check_installs():
    text = open(os.path.join(ROOT, "scripts", "gpu_wheelhouse.sh")).read()
    assert all(pin in text for pin in gpu_check.CORE_PINS)


def test_setup_gpu_stops_on_an_old_driver_before_installing(tmp_path):
    venv = tmp_path / "venv"
    env = dict(_with_driver(tmp_path, "550.54.15"), RLFRAME_VENV=str(venv))
    out = _run("gpu", env=env, script="setup.sh")
    assert out.returncode == 1 and not venv.exists()
    assert "driver 550.54.15 found" in out.stderr and "needs driver >= 580" in out.stderr and "cu128" in out.stderr


def test_setup_builds_flash_attn_for_the_gpus_architecture_only():
    """flash-attn's setup.py knows FLASH_ATTN_CUDA_ARCHS entries 80, 90, 100 and 120 (sm_80 code runs on all 8.x)."""
    script = (
        'source <(sed -n "/^flash_attn_arch()/,/^}/p" scripts/setup.sh)\n'
        'for cap in "$@"; do echo "[$(flash_attn_arch "$cap")]"; done'
    )
    caps = ["8.0", "8.6", "8.9", "9.0", "10.0", "12.0", "7.5"]
    out = subprocess.run(["bash", "-c", script, "-", *caps], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["[80]", "[80]", "[80]", "[90]", "[100]", "[120]", "[]"]


def test_a_package_tree_in_the_wheelhouse_is_unpacked_beside_the_wheels_and_imports(tmp_path):
    # what `gpu_wheelhouse.sh --with-ray` packs (ray's wheel, too large to carry, unpacked and stripped)
    import tarfile

    tree = tmp_path / "tree"
    (tree / "carried_pkg").mkdir(parents=True)
    (tree / "carried_pkg" / "__init__.py").write_text("VALUE = 7\n")
    tool = tree / "carried_pkg" / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    archive = tmp_path / f"carried_pkg-1.0{gpu_check.SITE_TREE}"
    with tarfile.open(archive, "w:xz") as out:
        out.add(tree, arcname=".")
    target = tmp_path / "site"
    try:
        assert gpu_check.extract_trees(str(target), [str(archive)]) is None
        import carried_pkg

        assert carried_pkg.VALUE == 7 and os.access(target / "carried_pkg" / "tool", os.X_OK)  # raylet stays runnable
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("carried_pkg", None)
    assert "broken" in gpu_check.extract_trees(str(target), [str(tmp_path / "broken-site.tar.xz")])
