"""The GPU check: every GPU path rlframe has, on one NVIDIA GPU, within one 10-minute call, as one table.

    bash scripts/gpu_check.sh                     # everything this machine's packages allow, within 540 s
    bash scripts/gpu_check.sh --dry-run           # CPU only: the plan and its budget, imports, files, vLLM arguments
    bash scripts/gpu_check.sh --wheelhouse DIR    # offline: first install the wheels in DIR (scripts/gpu_wheelhouse.sh)
    bash scripts/gpu_check.sh --only nccl,vllm    # a subset of the steps, by name

The whole check, setup included, ends within `--budget-s` (540 s; a device call allows 600) of its start.
Setup reads the driver first (a CUDA 13 torch on a driver older than R580 stops the check there, saying
so), then provides the packages: a wheelhouse when given, pip when its registry answers (bounded), or
neither, and says which in its first rows. Steps run in priority order, the end-to-end GRPO step with
vLLM colocated first; a step starts only when its whole timeout fits in the time left, so the check never
overruns, and `--dry-run` prints which steps fit when each earlier one runs to its timeout. What one GPU
cannot test (Ulysses sp>1 on nccl, vLLM and SGLang TP=2) is named in a row of its own.

Each step names the issue-18 item it would catch (docs/gpu.md). A step whose package is missing reports
"skipped: <package> not installed (<why>)" and does not fail the run; so does a step needing more GPUs
than there are, or more time than is left. The exit status is 1 when any row failed, else 0.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 540  # the whole check: one device call allows 600 s, the rest is margin for start and teardown
SETUP_S = 60  # what the plan sets aside for the driver, wheelhouse, probes and model (measured as it goes)
REGISTRY_INSTALL_S = 240  # pip installing vllm and ray (and the CUDA 13 torch they pin) when the registry answers
PIP_NETWORK = ("--timeout", "20", "--retries", "1")  # per request: a silent index fails in seconds, not minutes
CORE_MODULES = ("omegaconf", "hydra", "tensordict", "torchdata")  # what rlframe imports before any GPU code
# rlframe's core without dependencies (the lent machines have the rest): the set scripts/gpu_wheelhouse.sh downloads
CORE_PINS = (
    "omegaconf==2.3.1", "hydra-core==1.3.8", "antlr4-python3-runtime==4.9.3", "tensordict==0.15.3", "pyvers==0.2.3",
    "torchdata==0.11.0",
)  # fmt: skip
SITE_TREE = "-site.tar.xz"  # an unpacked, stripped package tree in the wheelhouse (ray: 79 MB wheel, 30 MB tree)
ENGINE_PINS = {"vllm": "vllm==0.33.0", "ray": "ray==2.60.0"}  # the gpu extra's vLLM; too large to carry (336, 79 MB)
PIP_NAMES = {"flash_attn": "flash-attn", "hydra": "hydra-core"}  # module -> distribution, where they differ
NOT_INSTALLED_WHY = {  # why a package the check never installs is absent
    "flash-attn": "scripts/setup.sh gpu builds it for this GPU; the build does not fit the check's budget",
    "sglang": "it has an environment of its own: the sglang extra",
}
# what one GPU cannot test, named in the table rather than silently left out (the TP=2 ones have 2-GPU steps)
ONE_GPU_GAPS = ("Ulysses sp>1 on nccl", "vLLM TP=2", "SGLang TP=2", "FSDP sharding over 2+ ranks on nccl")
# the NVIDIA driver each CUDA major needs (CUDA's minor-version compatibility: R580 for 13.x, R525 for 12.x)
MIN_DRIVER = {13: 580, 12: 525, 11: 450}


@dataclass(frozen=True)
class Step:
    name: str
    catches: str  # what it would have caught (issue 18's items)
    kind: str  # "pytest" | "command"
    target: str  # a pytest node id, or a command (list in `args`)
    args: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()  # importable modules, beyond CORE_MODULES
    min_gpus: int = 1
    timeout_s: int = 60  # an estimate: none of these has run on a GPU yet
    figure: str = ""  # regex over the step's output: group 1 (or the match) is the key figure


@dataclass
class Result:
    step: Step
    status: str
    figure: str = ""
    seconds: float = 0.0
    log: list[str] = field(default_factory=list)


def grpo_overrides(model: str, run_dir: str, engine: str = "vllm") -> list[str]:
    """A few GRPO steps with the vLLM (or HF) rollout on one GPU (the same sizes as the tiny CPU example)."""
    vllm_only = (
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.max_model_len=128",
    )
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model}",
        "data.train_files=builtin://countdown_add",
        "data.val_files=builtin://countdown_add",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "data.max_prompt_length=64",
        "data.max_response_length=32",
        "data.filter_overlong_prompts=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.rollout.name={engine}",
        *(vllm_only if engine == "vllm" else ()),
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cuda",
        "trainer.total_training_steps=3",
        "trainer.test_freq=0",
        "trainer.logger=[console,jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]
    return overrides


def grpo_step(name: str, catches: str, model: str, run_dir: str, engine: str, timeout_s: int) -> Step:
    """A run of main_ppo (`grpo_overrides`) whose figure is read from its jsonl metrics."""
    return Step(
        name,
        catches,
        "command",
        "-m rlframe.trainer.main_ppo",
        args=tuple(grpo_overrides(model, run_dir, engine=engine)),
        requires=("vllm", "ray") if engine == "vllm" else ("ray",),
        timeout_s=timeout_s,
        figure="jsonl:" + run_dir,
    )


def plan(work: str) -> list[Step]:
    """The steps in priority order (the end-to-end GRPO step first); `work` is the folder for models and runs."""
    model = os.path.join(work, "smollm2")
    test = "tests/gpu/test_gpu.py::"
    return [
        grpo_step(
            "grpo vllm",
            "1-9 end to end: 3 GRPO steps, vLLM colocated (sleep/wake, weight sync), param + optimizer offload, 1 GPU",
            model,
            os.path.join(work, "grpo"),
            engine="vllm",
            timeout_s=240,
        ),
        Step(
            "nccl+offload",
            "5, 6, 9: CPU shards handed to nccl; Adam state on the wrong device; FSDP2 init moves",
            "pytest",
            test + "test_nccl_fsdp2_param_and_optimizer_offload_step",
            figure=r"(\d+ passed|\d+ failed)",
        ),
        Step(
            "bf16 packed",
            "bf16 through remove-padding (varlen) vs transformers' bf16, both against fp32",
            "pytest",
            test + "test_bf16_packed_log_probs_within_bf16_error",
            figure=r"attention (.*?): packed bf16 error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "vllm rollout",
            "1, 7, 8 + minor: LOCAL_RANK=1 on one visible GPU, RNG reseed, sleep level 2, weights loaded",
            "pytest",
            test + "test_vllm_rollout_on_a_second_worker_with_weight_sync",
            requires=("vllm",),
            timeout_s=120,
            figure=r"vLLM log-prob error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "vllm async",
            "issue 14: rollout.mode=async on vLLM (continuous batching in the engine) samples as mode=sync",
            "pytest",
            test + "test_vllm_async_server_gives_the_sync_samples",
            requires=("vllm",),
            timeout_s=120,
            figure=r"vLLM async: 4 workers, (batch \S+, \S+ tokens/s)",
        ),
        Step(
            "vllm lora",
            "LoRA (issue 13): vLLM serves the adapter after syncs, a new adapter and a sleep",
            "pytest",
            "tests/models/test_lora.py::test_vllm_serves_the_adapter_across_updates_and_sleeps",
            requires=("vllm",),
            timeout_s=120,
            figure=r"(\d+ passed|\d+ failed)",
        ),
        Step(
            "flash-attn",
            "minor: flash-attn varlen vs SDPA on SmolLM2's heads (64, GQA 9/3); a broken import falls back",
            "pytest",
            test + "test_flash_attn_varlen_matches_sdpa_on_smollm2_heads",
            requires=("flash_attn",),
            timeout_s=45,
            figure=r"out: flash-attn error (\S+), bf16 SDPA error (\S+)",
        ),
        Step(
            "torch varlen",
            "issue 43: torch's varlen_attn without flash-attn (GQA 9/3, causal and windowed) vs the padded reference",
            "pytest",
            test + "test_torch_varlen_attn_matches_the_padded_reference",
            timeout_s=60,
            figure=r"torch varlen_attn: packed bf16 error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "gpu_mfu",
            "minor: the MFU bench says which attention kernel ran",
            "command",
            "bench/gpu_mfu.py",
            args=("--quick", "--json", os.path.join(work, "mfu.json")),
            figure=r"json:" + os.path.join(work, "mfu.json"),
        ),
        Step(
            "sglang rollout",
            "SGLang engine (extra 'sglang'): built from the rollout settings, release frees memory, CUDA IPC sync",
            "pytest",
            "tests/gpu/test_sglang_engine.py::test_sglang_rollout_weight_sync_release_and_log_probs",
            requires=("sglang",),
            timeout_s=180,
            figure=r"SGLang log-prob error (\S+), HF bf16 error (\S+)",
        ),
        grpo_step(
            "grpo hf",
            "the trainer end to end on CUDA without vLLM: HF rollout, nccl, FSDP2 with param + optimizer offload",
            model,
            os.path.join(work, "grpo_hf"),
            engine="hf",
            timeout_s=150,
        ),
        Step(
            "activation offload",
            "model.enable_activation_offload: bitwise gradients, lower peak GPU memory",
            "pytest",
            "tests/models/test_activation_offload.py::test_offload_lowers_peak_gpu_memory_with_the_same_gradients",
            figure=r"(\d+ passed|\d+ failed)",
        ),
        Step(
            "vllm tp2",
            "2: TP=2 with one visible GPU per process (custom / P2P all-reduces)",
            "pytest",
            test + "test_vllm_tp2_one_visible_gpu_per_process",
            requires=("vllm",),
            min_gpus=2,
            timeout_s=150,
            figure=r"tp2 log-prob error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "vllm vl",
            "issue 28: vLLM serves the tiny Qwen2-VL with images (multi_modal_data), greedy = HF, sync moves the tower",
            "pytest",
            "tests/workers/rollout/test_vllm_vl.py::test_vllm_serves_the_tiny_vl_model_with_images_before_and_after_a_sync",
            requires=("vllm",),
            timeout_s=150,
            figure=r"(\d+ passed|\d+ failed)",
        ),
        Step(
            "sglang tp2",
            "SGLang TP=2 with one visible GPU per process: schedulers on the group's GPUs, per-rank IPC handles",
            "pytest",
            "tests/gpu/test_sglang_engine.py::test_sglang_tp2_engine_on_the_groups_gpus",
            requires=("sglang",),
            min_gpus=2,
            timeout_s=180,
            figure=r"rank 1 log-prob error (\S+), HF bf16 error (\S+)",
        ),
    ]


# ---------------------------------------------------------------------------------------- the budget
def fit(steps: list[Step], seconds: float, gpus: int = 1) -> tuple[list[Step], list[Step]]:
    """(kept, dropped) when every kept step runs to its timeout: a step starts only if its whole timeout fits in
    what is left, in priority order (a later, shorter step can still fit). Steps needing more GPUs are in neither."""
    kept, dropped, left = [], [], seconds
    for step in steps:
        if step.min_gpus > gpus:
            continue
        if step.timeout_s <= left:
            kept.append(step)
            left -= step.timeout_s
        else:
            dropped.append(step)
    return kept, dropped


def not_testable_on_one_gpu(steps: list[Step]) -> str:
    """What one GPU cannot test: the gaps that have no step, then the steps that need two GPUs."""
    two_gpu_steps = [s.name for s in steps if s.min_gpus > 1]
    return ", ".join(ONE_GPU_GAPS) + (f"; the steps {', '.join(two_gpu_steps)}" if two_gpu_steps else "")


def plan_lines(steps: list[Step], budget_s: float) -> list[str]:
    """The dry run's plan for one GPU: each step with its timeout, which fit, and the budget line that shows it."""
    steps_s = budget_s - SETUP_S
    kept, dropped = fit(steps, steps_s)
    lines, total = [], 0
    for step in steps:
        needs = ", ".join(step.requires) or "a GPU"
        if step in kept:
            total += step.timeout_s
            when = f"<= {step.timeout_s:>3} s  (sum {total:>3} s)"
        elif step in dropped:
            when = f"<= {step.timeout_s:>3} s  (dropped)  "
        else:
            when = f"needs {step.min_gpus} GPUs         "
        lines.append(f"  {step.name:<14} {when}  {step.kind:<7} {step.target}  [needs {needs}]")
        lines.append(f"  {'':<14} catches: {step.catches}")
    lines.append(
        f"budget: {budget_s:.0f} s for the whole check (a device call allows 600 s) = {SETUP_S} s setup (driver, "
        f"packages, probes, model) + {steps_s:.0f} s of steps; the {len(kept)} planned steps' timeouts sum to "
        f"{total} s <= {steps_s:.0f} s"
    )
    if dropped:
        lines.append(
            "dropped when every planned step runs to its timeout, in priority order: "
            f"{', '.join(s.name for s in dropped)} (each still starts when earlier steps end sooner and its whole "
            "timeout fits)"
        )
    after_install, _ = fit(steps, steps_s - REGISTRY_INSTALL_S)
    lines.append(
        f"after a registry install of vllm and ray (<= {REGISTRY_INSTALL_S} s): {steps_s - REGISTRY_INSTALL_S:.0f} s "
        f"of steps: {', '.join(s.name for s in after_install) or 'none'} planned"
    )
    lines.append(f"not testable on 1 GPU: {not_testable_on_one_gpu(steps)}")
    return lines


# ---------------------------------------------------------------------------------------- the driver
def read_driver() -> dict | None:
    """The NVIDIA driver version, GPU names and compute capability from nvidia-smi (no CUDA call), or None."""
    for fields in ("driver_version,name,compute_cap", "driver_version,name"):  # drivers before R510: no compute_cap
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        rows = [[cell.strip() for cell in line.split(",")] + ["?"] for line in out.stdout.splitlines() if line.strip()]
        if out.returncode == 0 and rows:
            names = sorted({row[1] for row in rows})
            return {"version": rows[0][0], "names": names, "compute_cap": rows[0][2], "gpus": len(rows)}
    return None


def driver_problem(driver_version: str, torch_version: str, torch_cuda: str | None) -> str | None:
    """Why this driver cannot run this torch's CUDA (the driver found, what is needed, the fix), or None."""
    if not torch_cuda:
        return None  # a CPU build of torch: no CUDA needed
    cuda_major = int(torch_cuda.split(".")[0])
    needed = MIN_DRIVER.get(cuda_major)
    if needed is None or int(driver_version.split(".")[0]) >= needed:
        return None
    fix = (
        "upgrade the NVIDIA driver to R580 or newer (the gpu extra's vllm 0.33.0 and torch 2.14.0 are CUDA 13 builds),"
        " or install a torch built for an older CUDA, e.g. CUDA 12.8: pip install torch --index-url "
        "https://download.pytorch.org/whl/cu128 (vLLM then needs a CUDA 12 build too)"
        if cuda_major >= 13
        else f"upgrade the NVIDIA driver to R{needed} or newer"
    )
    return (
        f"NVIDIA driver {driver_version} is too old for torch {torch_version} (CUDA {torch_cuda}), which needs "
        f"driver >= {needed}: torch.cuda.is_available() would be False and every step would fail. Fix: {fix}"
    )


# ---------------------------------------------------------------------------------------- packages
def run_bounded(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """(exit code, output) of `cmd` in a process group of its own, killed whole at `timeout` (code None then) and
    whenever it ends: an engine or Ray process it left would hold the GPU, or the output pipe, past the step."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
        return proc.returncode, output or ""
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipe
            output = ""
        return None, output or ""
    finally:  # also on Ctrl-C, which a new session no longer passes on
        _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def missing_modules(names) -> list[str]:
    """The distribution names of `names` that cannot be imported here."""
    return [PIP_NAMES.get(name, name) for name in names if importlib.util.find_spec(name) is None]


def pip_install(python: str, target: str, specs, seconds: float, *flags: str) -> str | None:
    """Install `specs` into the folder `target` (put first on the steps' PYTHONPATH, the machine's own environment
    untouched, so a pip killed at its timeout breaks nothing); None, or what went wrong."""
    cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-warn-script-location"]
    code, out = run_bounded([*cmd, "--target", target, *flags, *specs], seconds)
    if code is None:
        return f"pip stopped at its {seconds:.0f} s bound"
    if code:
        return f"pip: {(out.strip().splitlines() or ['exit ' + str(code)])[-1]}"
    sys.path.insert(0, target)  # so the requirement checks of this process see it too
    importlib.invalidate_caches()
    return None


def extract_trees(target: str, trees) -> str | None:
    """Unpack installed package trees (`*-site.tar.xz`, made by scripts/gpu_wheelhouse.sh --with-ray: a wheel too
    large to carry, unpacked and stripped) into `target`; None, or what went wrong."""
    import tarfile

    try:
        for tree in trees:
            with tarfile.open(tree) as archive:
                archive.extractall(target, filter="tar")
    except (OSError, tarfile.TarError) as error:
        return f"{os.path.basename(tree)}: {error}"
    if target not in sys.path:
        sys.path.insert(0, target)
    importlib.invalidate_caches()
    return None


def registry_problem(python: str, work: str) -> str | None:
    """None when pip reaches its package index (a 10 kB download, bounded), else why not."""
    probe = [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps", "--no-cache-dir"]
    code, out = run_bounded(
        [*probe, "--timeout", "5", "--retries", "0", "-d", os.path.join(work, "probe"), "pyvers==0.2.3"], 30
    )
    if code == 0:
        return None
    return "no answer in 30 s" if code is None else (out.strip().splitlines() or ["?"])[-1][:160]


def engine_install_refusal(driver: dict | None) -> str | None:
    """Why vllm 0.33.0 (and the CUDA 13 torch 2.14.0 it pins) is not installed on this machine, or None."""
    if not (3, 11) <= sys.version_info[:2] < (3, 15):
        return f"vllm 0.33.0 needs Python 3.11-3.14, this is {sys.version.split()[0]}"
    if driver is None:
        return "no NVIDIA driver visible"
    return driver_problem(driver["version"], "2.14.0", "13.0")


def install_blocker(python: str, work: str, driver: dict | None, allow_install: bool) -> tuple[str, str] | None:
    """(why nothing comes from the registry, pip's own words) or None when pip can install."""
    if not allow_install:
        return "--no-install given", ""
    if driver is None:
        return "no GPU visible", ""
    problem = registry_problem(python, work)
    return ("no registry access", problem) if problem else None


def provide_packages(
    python: str, wheelhouse: str | None, work: str, driver: dict | None, allow_install: bool, deadline
):
    """The rows saying where the packages came from, why each missing one is missing, and the folders installed to;
    every pip call ends by `deadline` (time.monotonic())."""
    rows, why, site_dirs = [], {}, []

    def bound(seconds: float) -> float:
        return max(1.0, min(seconds, deadline - time.monotonic()))

    if wheelhouse:
        target = os.path.join(work, "site-wheelhouse")
        wheels = sorted(os.path.join(wheelhouse, f) for f in os.listdir(wheelhouse) if f.endswith(".whl"))
        error = (
            pip_install(python, target, wheels, bound(120), "--no-index", "--no-deps") if wheels else "no wheels in it"
        )
        trees = sorted(os.path.join(wheelhouse, f) for f in os.listdir(wheelhouse) if f.endswith(SITE_TREE))
        error = error or extract_trees(target, trees)
        names = ", ".join(os.path.basename(w).split("-")[0] for w in wheels + trees)
        rows.append(("packages", "FAILED: wheelhouse" if error else "wheelhouse", f"{wheelhouse}: {error or names}"))
        site_dirs += [] if error else [target]
    core, engine = missing_modules(CORE_MODULES), missing_modules(ENGINE_PINS)
    if not core and not engine:
        rows.append(("packages", "complete", "rlframe's core, vllm and ray import"))
        return rows, why, site_dirs
    blocker = install_blocker(python, work, driver, allow_install)
    if blocker:
        reason, pip_says = blocker
        detail = f"missing {', '.join(core + engine)}: {reason}" + (f" (pip: {pip_says})" if pip_says else "")
        rows.append(("packages", "none from pip", detail))
        offline = reason == "no registry access"
        why.update({name: reason + (", too large to carry" if offline else "") for name in engine})
        why.update({name: reason + (": carry the wheelhouse (--wheelhouse)" if offline else "") for name in core})
        return rows, why, site_dirs
    if core:
        target, start = os.path.join(work, "site-core"), time.monotonic()
        error = pip_install(python, target, CORE_PINS, bound(120), "--no-deps", *PIP_NETWORK)
        rows.append(("packages", "registry", f"{error or 'installed'} {', '.join(CORE_PINS)} ({_since(start)})"))
        why.update({name: f"registry install failed: {error}" for name in core} if error else {})
        site_dirs += [] if error else [target]
    if engine:
        refusal = engine_install_refusal(driver)
        specs = list(ENGINE_PINS.values())
        if refusal:
            rows.append(("packages", "registry", f"not installing {', '.join(specs)}: {refusal}"))
            why.update({name: refusal.split(":")[0] for name in engine})
        else:
            target, start = os.path.join(work, "site-engine"), time.monotonic()
            error = pip_install(python, target, specs, bound(REGISTRY_INSTALL_S), *PIP_NETWORK)
            rows.append(("packages", "registry", f"{error or 'installed'} {', '.join(specs)} ({_since(start)})"))
            why.update({name: f"registry install failed: {error}" for name in engine} if error else {})
            site_dirs = ([] if error else [target]) + site_dirs
    return rows, why, site_dirs


def _since(start: float) -> str:
    return f"{time.monotonic() - start:.0f} s"


# ---------------------------------------------------------------------------------------- checks without a GPU
def pytest_node_exists(node: str) -> bool:
    """`path::function` names a file under ROOT that defines that test function."""
    path, _, func = node.partition("::")
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return False
    tree = ast.parse(open(full).read())
    return any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body)


def target_exists(step: Step) -> bool:
    if step.kind == "pytest":
        return pytest_node_exists(step.target)
    if step.target.startswith("-m "):
        return importlib.util.find_spec(step.target.split()[1]) is not None
    return os.path.isfile(os.path.join(ROOT, step.target))


def dry_run_checks(steps: list[Step], work: str) -> list[tuple[str, str, str]]:
    """What a CPU can check: each target exists, rlframe's GPU modules import, vLLM's arguments build."""
    checks = []
    for step in steps:
        found = target_exists(step)
        checks.append((f"target of {step.name}", "ok" if found else "MISSING", step.target))
    for module in (
        "rlframe.workers.fsdp_wrap",
        "rlframe.workers.rollout.vllm_rollout",
        "rlframe.workers.rollout.sglang_rollout",
        "rlframe.distributed.attention",
        "rlframe.trainer.main_ppo",
    ):
        try:
            importlib.import_module(module)
            checks.append((f"import {module}", "ok", ""))
        except Exception as err:  # reported, not raised: the dry run lists every problem
            checks.append((f"import {module}", "FAILED", f"{type(err).__name__}: {err}"))
    for name, check in (
        ("vLLM engine arguments", vllm_arguments_summary),
        ("SGLang engine arguments", sglang_arguments_summary),
        ("GRPO step's config", grpo_config),
    ):
        try:
            checks.append((name, "ok", check(work)))
        except Exception as err:
            checks.append((name, "FAILED", f"{type(err).__name__}: {err}"))
    return checks


def vllm_arguments_summary(work: str) -> str:
    """The engine arguments and process environment the vLLM steps build with (pure functions, no vllm)."""
    import torch

    from rlframe.config.loader import load_config, resolved
    from rlframe.workers.rollout.base import ServedModel
    from rlframe.workers.rollout.vllm_rollout import engine_environment, vllm_engine_kwargs

    cfg = resolved(load_config(["actor_rollout_ref.rollout.name=vllm"])).actor_rollout_ref.rollout
    kwargs = vllm_engine_kwargs(
        cfg, model=ServedModel("<model>"), tp_size=1, dtype=torch.bfloat16, dp_rank=0, max_position_embeddings=8192
    )
    if not kwargs["disable_custom_all_reduce"] or engine_environment(0, 1)["LOCAL_RANK"] != "0":
        raise AssertionError(f"unexpected engine arguments {kwargs} / environment {engine_environment(0, 1)}")
    shown = {k: kwargs[k] for k in ("distributed_executor_backend", "disable_custom_all_reduce", "logprobs_mode")}
    tp2_extra = sorted(set(engine_environment(0, 2)) - set(engine_environment(0, 1)))
    return f"{shown}; environment {engine_environment(0, 1)}, with TP 2 also {tp2_extra}=0"


def sglang_arguments_summary(work: str) -> str:
    """The arguments the SGLang steps build the engine with (a pure function, no sglang)."""
    import torch

    from rlframe.config.loader import load_config, resolved
    from rlframe.workers.rollout.base import ServedModel
    from rlframe.workers.rollout.sglang_rollout import sglang_engine_kwargs

    cfg = resolved(load_config(["actor_rollout_ref.rollout.name=sglang"])).actor_rollout_ref.rollout
    kwargs = sglang_engine_kwargs(
        cfg, model=ServedModel("<model>"), tp_size=1, dtype=torch.bfloat16, dp_rank=0, max_position_embeddings=8192
    )
    if not (kwargs["skip_tokenizer_init"] and kwargs["enable_memory_saver"]):
        raise AssertionError(f"unexpected engine arguments {kwargs}")
    return str({k: kwargs[k] for k in ("mem_fraction_static", "enable_memory_saver", "attention_backend")})


def grpo_config(work: str) -> str:
    """The GRPO step's overrides pass rlframe's launch checks (the model path is not read here)."""
    from rlframe.trainer.config import compose, typed

    overrides = grpo_overrides("builtin://tiny", os.path.join(work, "grpo"))
    typed(compose(overrides))
    return f"{len(overrides)} overrides pass the launch checks"


# ---------------------------------------------------------------------------------------- running
def torch_probe(python: str, env: dict) -> dict:
    """Torch's version and CUDA build, then the GPUs it sees, as the steps' Python sees them."""
    probe = (
        "import json, torch\n"
        "out = {'version': torch.__version__, 'cuda': torch.version.cuda}\n"
        "out['gpus'] = torch.cuda.device_count() if out['cuda'] else 0\n"
        "out['name'] = torch.cuda.get_device_name() if out['gpus'] else 'no GPU'\n"
        "print(json.dumps(out))\n"
    )
    code, out = run_bounded([python, "-c", probe], 90, env)
    lines = out.strip().splitlines()
    if code != 0 or not lines:
        return {"error": lines[-1] if lines else f"no output in 90 s (exit {code})"}
    return json.loads(lines[-1])


def gpu_extra_pins() -> dict[str, str]:
    """`name==version` pins of pyproject.toml's `gpu` extra (the tested set, docs/gpu.md)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: no vLLM 0.33 there either
        return {}
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["gpu"]
    return dict(spec.split("==", 1) for spec in extra if "==" in spec)


def installed_versions_row(python: str, env: dict) -> tuple[str, str, str]:
    """Installed versions against the gpu extra's pins (items 3, 4: the set that was read is what runs)."""
    pins = {**gpu_extra_pins(), "flash-attn": "built by scripts/setup.sh gpu"}
    probe = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: out[name] = None\n"
        "print(json.dumps(out))\n"
    )
    code, out = run_bounded([python, "-c", probe, *pins], 30, env)
    if code != 0:
        return ("installed set", "FAILED", out.strip()[-200:])
    found = json.loads(out.strip().splitlines()[-1])
    differs = [
        f"{name} {found[name] or 'absent'} (pinned {want})"
        for name, want in pins.items()
        if name != "flash-attn" and (found[name] or "").split("+")[0] != want  # +cu130 is a build tag
    ]
    text = ", ".join(f"{name} {version or 'absent'}" for name, version in found.items())
    status = "as pinned" if not differs else f"differs from the gpu extra: {'; '.join(differs)}"
    return ("installed set", status, text)


def core_import_problem(python: str, env: dict) -> str | None:
    """The module rlframe's core lacks here (its pip name), or None when rlframe imports."""
    probe = "import rlframe.workers.fsdp_wrap, rlframe.workers.model_forward, rlframe.config.loader"
    code, out = run_bounded([python, "-c", probe], 90, env)
    if code == 0:
        return None
    found = re.search(r"No module named '([^'.]+)", out)
    return PIP_NAMES.get(found.group(1), found.group(1)) if found else (out.strip().splitlines() or ["?"])[-1]


def child_env(site_dirs: list[str] = ()) -> dict:
    """The steps' environment: the repo, its tests and the installed folders first on PYTHONPATH; offline hub."""
    env = dict(os.environ)
    paths = [ROOT, os.path.join(ROOT, "tests"), *site_dirs, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def key_figure(step: Step, output: str) -> str:
    """The step's one number (or phrase) for the table, read from its output or the file it wrote."""
    if step.figure.startswith("json:"):
        path = step.figure[5:]
        if not os.path.isfile(path):
            return ""
        fig = json.load(open(path))
        mfu = f"MFU {fig['mfu']:.1%}" if fig.get("mfu") is not None else "MFU n/a"
        return f"{fig['tokens_per_s']:,.0f} tok/s, {mfu}, attention: {fig['attention']}"
    if step.figure.startswith("jsonl:"):
        return grpo_figure(step.figure[6:])
    found = re.search(step.figure, output) if step.figure else None
    if not found:
        return ""
    return ", ".join(found.groups()) if found.groups() else found.group(0)


def grpo_figure(run_dir: str) -> str:
    """Steps done, the last step's seconds and mean reward, from the run's jsonl metrics."""
    rows = []
    for folder, _, files in os.walk(run_dir):
        for name in files:
            if name.endswith(".jsonl"):
                rows += [json.loads(line) for line in open(os.path.join(folder, name)) if line.strip()]
    if not rows:
        return ""
    last = rows[-1]
    metrics = last.get("data", last)
    step_s = metrics.get("timing_s/step")
    score = metrics.get("critic/score/mean")
    parts = [f"{len(rows)} steps"]
    if step_s is not None:
        parts.append(f"last step {step_s:.1f} s")
    if score is not None:
        parts.append(f"score {score:.3f}")
    return ", ".join(parts)


def run_step(step: Step, python: str, env: dict, work: str) -> Result:
    """Run one step in its own process group (vLLM, Ray and process groups never leak into the next)."""
    if step.kind == "pytest":
        cmd = [python, "-m", "pytest", "-x", "-q", "-s", "-p", "no:cacheprovider", "-m", "gpu", step.target]
    else:
        cmd = [python, *step.target.split(), *step.args]
    start = time.monotonic()
    code, output = run_bounded(cmd, step.timeout_s, env)
    seconds = time.monotonic() - start
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    with open(os.path.join(work, "logs", re.sub(r"\W+", "_", step.name) + ".log"), "w") as f:
        f.write(output)
    if code is None:
        return Result(step, f"FAILED: timeout after {step.timeout_s} s", "", seconds, output.splitlines())
    skipped = re.search(r"SKIPPED \[\d+\] [^:]+:\d*:? ?(.*)", output)
    if code == 0 and step.kind == "pytest" and " passed" not in output and skipped:
        return Result(step, f"skipped: {skipped.group(1).strip()}", "", seconds, output.splitlines())
    status = "passed" if code == 0 else f"FAILED (exit {code})"
    return Result(step, status, key_figure(step, output), seconds, output.splitlines())


def prepare_model(python: str, env: dict, work: str, seconds: float) -> str:
    """SmolLM2 when at hand, else the random-init stand-in of its shape, at work/smollm2 (a link or a folder)."""
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n"
        "from helpers.gpu_models import cached_smollm2, smollm2_stand_in\n"
        f"target = {os.path.join(work, 'smollm2')!r}\n"
        "real = cached_smollm2()\n"
        "if real: os.symlink(real, target); print('SmolLM2-135M-Instruct')\n"
        "else: smollm2_stand_in(target); print('random-init SmolLM2 shape')\n"
    )
    exit_code, out = run_bounded([python, "-c", code], seconds, env)
    if exit_code != 0:
        return f"FAILED: {(out.strip().splitlines() or [f'no model in {seconds:.0f} s'])[-1]}"
    return out.strip().splitlines()[-1]


def print_table(rows: list[tuple[str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def skip_reason(step: Step, gpus: int, core_missing: str | None, why: dict, left: float) -> str | None:
    """Why `step` does not start (a missing package and why, too few GPUs, too little time), or None."""
    missing = core_missing or next(iter(missing_modules(step.requires)), None)
    if missing:
        reason = why.get(missing) or NOT_INSTALLED_WHY.get(missing)
        return f"skipped: {missing} not installed" + (f" ({reason})" if reason else "")
    if gpus < step.min_gpus:
        return f"skipped: needs {step.min_gpus} GPUs, {gpus} visible" + (" (not testable on 1 GPU)" if gpus else "")
    if step.timeout_s > left:
        return f"skipped: time budget (its timeout {step.timeout_s} s > {left:.0f} s left)"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU only: print the plan and check what a CPU can")
    parser.add_argument("--wheelhouse", default=None, help="install these wheels first (offline machines)")
    parser.add_argument("--no-install", action="store_true", help="use the machine's packages only (no pip)")
    parser.add_argument("--only", default=None, help="comma-separated step names")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check ends within this")
    parser.add_argument("--work-dir", default=None, help="models, runs, installs, logs (default: a temporary folder)")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs each step")
    parser.add_argument("--verbose", action="store_true", help="print each step's output")
    args = parser.parse_args(argv)

    work = args.work_dir or tempfile.mkdtemp(prefix="rlframe-gpu-check-")
    os.makedirs(work, exist_ok=True)
    steps = plan(work)
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        unknown = wanted - {s.name for s in steps}
        if unknown:
            parser.error(f"--only: unknown step(s) {sorted(unknown)}; the steps are {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in wanted]

    if args.dry_run:
        return dry_run(steps, work, args.budget_s)
    return run_check(steps, work, args)


def dry_run(steps: list[Step], work: str, budget_s: float) -> int:
    """The plan and its budget, then what a CPU can check; 1 when a check failed."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    print(f"gpu_check plan for 1 GPU, in priority order ({len(steps)} steps, work dir {work}):")
    print("\n".join(plan_lines(steps, budget_s)))
    rows = [("step", "status", "key figure"), *dry_run_checks(steps, work)]
    print()
    print_table(rows)
    return 1 if any(r[1] != "ok" for r in rows[1:]) else 0


def driver_row(driver: dict | None, torch_info: dict) -> tuple[tuple[str, str, str], str | None]:
    """The table's driver row, and the problem that stops the check (a driver too old for torch's CUDA) or None."""
    if driver is None:
        return ("driver", "none", "nvidia-smi found no driver"), None
    problem = driver_problem(driver["version"], torch_info.get("version", "?"), torch_info.get("cuda"))
    gpus = f"{driver['gpus']} x {', '.join(driver['names'])} (compute capability {driver['compute_cap']})"
    return ("driver", f"FAILED: {problem}" if problem else "ok", f"{driver['version']}, {gpus}"), problem


def run_check(steps: list[Step], work: str, args) -> int:
    """Driver, packages and environment rows, then the steps in priority order, each only if its timeout fits."""
    start = time.monotonic()
    deadline = start + args.budget_s
    driver = read_driver()
    base_torch = torch_probe(args.python, child_env())
    row, problem = driver_row(driver, base_torch)
    rows = [("step", "status", "key figure"), row]
    if problem:
        print_table(rows)
        print(f"\n[gpu_check] stopped: {problem}")
        return 1

    package_rows, why, site_dirs = provide_packages(
        args.python, args.wheelhouse, work, driver, not args.no_install, deadline
    )
    env = child_env(site_dirs)
    torch_now = torch_probe(args.python, env) if site_dirs else base_torch
    gpus = torch_now.get("gpus", 0)
    env_text = (
        torch_now.get("error")
        or f"torch {torch_now['version']} (CUDA {torch_now['cuda']}), {gpus} x {torch_now['name']}"
    )
    rows += [*package_rows, ("environment", "ok" if gpus else "FAILED: no GPU visible", env_text)]
    rows.append(installed_versions_row(args.python, env))
    core_missing = core_import_problem(args.python, env)
    if gpus < 2:
        rows.append(("not testable on 1 GPU", "needs 2 GPUs", not_testable_on_one_gpu(steps)))
    grpo = [s for s in steps if s.name.startswith("grpo ")]
    if not core_missing and any(not skip_reason(s, gpus, None, why, args.budget_s) for s in grpo):  # the model
        rows.append(("model", prepare_model(args.python, env, work, min(90, deadline - time.monotonic())), ""))
    results = []
    for step in steps:
        reason = skip_reason(step, gpus, core_missing, why, deadline - time.monotonic())
        if reason:
            results.append(Result(step, reason))
            continue
        result = run_step(step, args.python, env, work)
        results.append(result)
        print(f"[gpu_check] {step.name}: {result.status} ({result.seconds:.0f} s)", flush=True)
        if args.verbose or result.status.startswith("FAILED"):
            print("\n".join(f"    {line}" for line in result.log[-40:]), flush=True)
    rows += [(r.step.name, r.status + (f" ({r.seconds:.0f} s)" if r.seconds else ""), r.figure) for r in results]
    print()
    print_table(rows)
    print(f"\ntotal {time.monotonic() - start:.0f} s of a {args.budget_s:.0f} s budget; work dir {work} (logs/)")
    return 1 if any(r[1].startswith("FAILED") for r in rows[1:]) else 0


if __name__ == "__main__":
    sys.exit(main())
