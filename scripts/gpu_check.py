"""The GPU check: every GPU path rlframe has, on one NVIDIA GPU, in under 8 minutes, as one table.

    bash scripts/gpu_check.sh                     # run every step that this machine's packages allow
    bash scripts/gpu_check.sh --dry-run           # CPU only: the plan, imports, files, vLLM arguments
    bash scripts/gpu_check.sh --wheelhouse DIR    # first install the wheels in DIR (no network needed)
    bash scripts/gpu_check.sh --only nccl,vllm    # a subset of the steps, by name

Each step names the issue-18 item it would catch (docs/gpu.md). A step whose package is missing
reports "skipped: <package> not installed" and does not fail the run; a step needing more GPUs than
there are reports that; steps that would pass the overall time budget are skipped with that reason.
The exit status is 1 when any step failed, else 0.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 470  # the whole check stays under 8 minutes on one GPU
CORE_MODULES = ("omegaconf", "hydra", "tensordict")  # what rlframe imports before any GPU code


@dataclass(frozen=True)
class Step:
    name: str
    catches: str  # what it would have caught (issue 18's items)
    kind: str  # "pytest" | "command"
    target: str  # a pytest node id, or a command (list in `args`)
    args: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()  # importable modules, beyond CORE_MODULES
    min_gpus: int = 1
    timeout_s: int = 120
    figure: str = ""  # regex over the step's output: group 1 (or the match) is the key figure


@dataclass
class Result:
    step: Step
    status: str
    figure: str = ""
    seconds: float = 0.0
    log: list[str] = field(default_factory=list)


def grpo_overrides(model: str, run_dir: str) -> list[str]:
    """A few GRPO steps with the vLLM rollout on one GPU (the same sizes as the tiny CPU example)."""
    return [
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
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.max_model_len=128",
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


def plan(work: str) -> list[Step]:
    """The steps, in order; `work` is the folder for models and runs."""
    model = os.path.join(work, "smollm2")
    test = "tests/test_gpu.py::"
    return [
        Step(
            "nccl+offload",
            "5, 6, 9: CPU shards handed to nccl; Adam state on the wrong device; FSDP2 init moves",
            "pytest",
            test + "test_nccl_fsdp2_param_and_optimizer_offload_step",
            timeout_s=90,
            figure=r"(\d+ passed|\d+ failed)",
        ),
        Step(
            "bf16 packed",
            "bf16 through remove-padding (varlen) vs transformers' bf16, both against fp32",
            "pytest",
            test + "test_bf16_packed_log_probs_within_bf16_error",
            timeout_s=90,
            figure=r"attention (.*?): packed bf16 error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "flash-attn",
            "minor: flash-attn varlen vs SDPA on SmolLM2's heads (64, GQA 9/3); a broken import falls back",
            "pytest",
            test + "test_flash_attn_varlen_matches_sdpa_on_smollm2_heads",
            requires=("flash_attn",),
            timeout_s=60,
            figure=r"out: flash-attn error (\S+), bf16 SDPA error (\S+)",
        ),
        Step(
            "vllm rollout",
            "1, 7, 8 + minor: LOCAL_RANK=1 on one visible GPU, RNG reseed, sleep level 2, weights loaded",
            "pytest",
            test + "test_vllm_rollout_on_a_second_worker_with_weight_sync",
            requires=("vllm",),
            timeout_s=180,
            figure=r"vLLM log-prob error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "vllm async",
            "issue 14: rollout.mode=async on vLLM (continuous batching in the engine) samples as mode=sync",
            "pytest",
            test + "test_vllm_async_server_gives_the_sync_samples",
            requires=("vllm",),
            timeout_s=180,
            figure=r"vLLM async: 4 workers, (batch \S+, \S+ tokens/s)",
        ),
        Step(
            "vllm tp2",
            "2: TP=2 with one visible GPU per process (custom / P2P all-reduces)",
            "pytest",
            test + "test_vllm_tp2_one_visible_gpu_per_process",
            requires=("vllm",),
            min_gpus=2,
            timeout_s=180,
            figure=r"tp2 log-prob error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "vllm lora",
            "LoRA (issue 13): vLLM serves the adapter after syncs, a new adapter and a sleep",
            "pytest",
            "tests/test_lora.py::test_vllm_serves_the_adapter_across_updates_and_sleeps",
            requires=("vllm",),
            timeout_s=180,
            figure=r"(\d+ passed|\d+ failed)",
        ),
        Step(
            "sglang rollout",
            "SGLang engine (extra 'sglang'): built from the rollout settings, release frees memory, CUDA IPC sync",
            "pytest",
            "tests/test_sglang_engine.py::test_sglang_rollout_weight_sync_release_and_log_probs",
            requires=("sglang",),
            timeout_s=240,
            figure=r"SGLang log-prob error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "sglang tp2",
            "SGLang TP=2 with one visible GPU per process: schedulers on the group's GPUs, per-rank IPC handles",
            "pytest",
            "tests/test_sglang_engine.py::test_sglang_tp2_engine_on_the_groups_gpus",
            requires=("sglang",),
            min_gpus=2,
            timeout_s=240,
            figure=r"rank 1 log-prob error (\S+), HF bf16 error (\S+)",
        ),
        Step(
            "gpu_mfu",
            "minor: the MFU bench says which attention kernel ran",
            "command",
            "bench/gpu_mfu.py",
            args=("--quick", "--json", os.path.join(work, "mfu.json")),
            timeout_s=120,
            figure=r"json:" + os.path.join(work, "mfu.json"),
        ),
        Step(
            "grpo vllm",
            "1-9 end to end: 3 GRPO steps, vLLM rollout, param + optimizer offload, 1 GPU",
            "command",
            "-m rlframe.trainer.main_ppo",
            args=tuple(grpo_overrides(model, os.path.join(work, "grpo"))),
            requires=("vllm", "ray"),
            timeout_s=300,
            figure=r"jsonl:" + os.path.join(work, "grpo"),
        ),
    ]


# ---------------------------------------------------------------------------------------- checks without a GPU
def missing_module(names) -> str | None:
    """The first of `names` that cannot be imported (by its distribution's usual name), else None."""
    pip_names = {"flash_attn": "flash-attn", "hydra": "hydra-core"}
    for name in names:
        if importlib.util.find_spec(name) is None:
            return pip_names.get(name, name)
    return None


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
        "rlframe.workers.fsdp_utils",
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
    from rlframe.workers.rollout.vllm_rollout import engine_environment, vllm_engine_kwargs

    cfg = resolved(load_config(["actor_rollout_ref.rollout.name=vllm"])).actor_rollout_ref.rollout
    kwargs = vllm_engine_kwargs(
        cfg, model_path="<model>", tp_size=1, dtype=torch.bfloat16, dp_rank=0, max_position_embeddings=8192
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
    from rlframe.workers.rollout.sglang_rollout import sglang_engine_kwargs

    cfg = resolved(load_config(["actor_rollout_ref.rollout.name=sglang"])).actor_rollout_ref.rollout
    kwargs = sglang_engine_kwargs(
        cfg, model_path="<model>", tp_size=1, dtype=torch.bfloat16, dp_rank=0, max_position_embeddings=8192
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
def environment_row(python: str) -> tuple[str, str]:
    """Torch, CUDA, device and driver, as the check's Python sees them."""
    probe = (
        "import torch, subprocess\n"
        "n = torch.cuda.device_count()\n"
        "name = torch.cuda.get_device_name() if n else 'no GPU'\n"
        "try:\n"
        "    drv = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'],"
        " capture_output=True, text=True).stdout.split()[0]\n"
        "except Exception:\n"
        "    drv = '?'\n"
        "print(f'{n}|{name}|torch {torch.__version__} (CUDA {torch.version.cuda})|driver {drv}')\n"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        return "0", f"FAILED: {out.stderr.strip().splitlines()[-1] if out.stderr else 'no output'}"
    count, *rest = out.stdout.strip().split("|")
    return count, ", ".join(rest)


def gpu_extra_pins() -> dict[str, str]:
    """`name==version` pins of pyproject.toml's `gpu` extra (the tested set, docs/gpu.md)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: no vLLM 0.33 there either
        return {}
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["gpu"]
    return dict(spec.split("==", 1) for spec in extra if "==" in spec)


def installed_versions_row(python: str) -> tuple[str, str, str]:
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
    out = subprocess.run([python, "-c", probe, *pins], capture_output=True, text=True)
    if out.returncode:
        return ("installed set", "FAILED", out.stderr.strip()[-200:])
    found = json.loads(out.stdout)
    differs = [
        f"{name} {found[name] or 'absent'} (pinned {want})"
        for name, want in pins.items()
        if name != "flash-attn" and (found[name] or "").split("+")[0] != want  # +cu130 is a build tag
    ]
    text = ", ".join(f"{name} {version or 'absent'}" for name, version in found.items())
    status = "as pinned" if not differs else f"differs from the gpu extra: {'; '.join(differs)}"
    return ("installed set", status, text)


def core_import_problem(python: str) -> str | None:
    """The module rlframe's core lacks here (its pip name), or None when rlframe imports."""
    probe = "import rlframe.workers.fsdp_utils, rlframe.workers.model_forward, rlframe.config.loader"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=child_env())
    if out.returncode == 0:
        return None
    found = re.search(r"No module named '([^'.]+)", out.stderr)
    return found.group(1) if found else out.stderr.strip().splitlines()[-1]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
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


def run_step(step: Step, python: str, left_s: float) -> Result:
    """Run one step in its own process (vLLM and process groups never leak into the next)."""
    if step.kind == "pytest":
        cmd = [python, "-m", "pytest", "-x", "-q", "-s", "-p", "no:cacheprovider", "-m", "gpu", step.target]
    else:
        cmd = [python, *step.target.split(), *step.args]
    start = time.monotonic()
    timeout = min(step.timeout_s, left_s)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=timeout)
        output, code = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return Result(step, f"FAILED: timeout after {timeout:.0f} s", "", time.monotonic() - start, output.splitlines())
    seconds = time.monotonic() - start
    skipped = re.search(r"SKIPPED \[\d+\] [^:]+:\d*:? ?(.*)", output)
    if code == 0 and step.kind == "pytest" and " passed" not in output and skipped:
        return Result(step, f"skipped: {skipped.group(1).strip()}", "", seconds, output.splitlines())
    status = "passed" if code == 0 else f"FAILED (exit {code})"
    return Result(step, status, key_figure(step, output), seconds, output.splitlines())


def install_wheelhouse(python: str, folder: str) -> str:
    """Install every wheel in `folder` without an index or dependency resolution (the lent machines are offline)."""
    wheels = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
    if not wheels:
        return f"no wheels in {folder}"
    out = subprocess.run(
        [python, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", *wheels], capture_output=True, text=True
    )
    if out.returncode:
        return f"FAILED: {out.stderr.strip().splitlines()[-1]}"
    return f"installed {len(wheels)} wheel(s): {', '.join(os.path.basename(w).split('-')[0] for w in wheels)}"


def prepare_model(python: str, work: str) -> str:
    """SmolLM2 when at hand, else the random-init stand-in of its shape, at work/smollm2 (a link or a folder)."""
    code = (
        "import os, sys\n"
        "from gpu_models import cached_smollm2, smollm2_stand_in\n"
        f"target = {os.path.join(work, 'smollm2')!r}\n"
        "real = cached_smollm2()\n"
        "if real: os.symlink(real, target); print('SmolLM2-135M-Instruct')\n"
        "else: smollm2_stand_in(target); print('random-init SmolLM2 shape')\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=ROOT, env=child_env())
    if out.returncode:
        return f"FAILED: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return out.stdout.strip()


def print_table(rows: list[tuple[str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU only: print the plan and check what a CPU can")
    parser.add_argument("--wheelhouse", default=None, help="install these wheels first (offline machines)")
    parser.add_argument("--only", default=None, help="comma-separated step names")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="skip steps that would run past this")
    parser.add_argument("--work-dir", default=None, help="models and runs (default: a temporary folder)")
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

    rows = [("step", "status", "key figure")]
    if args.dry_run:
        sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
        print(f"gpu_check plan ({len(steps)} steps, budget {args.budget_s:.0f} s, work dir {work}):")
        for step in steps:
            needs = ", ".join((*CORE_MODULES, *step.requires)) + (
                f"; {step.min_gpus} GPUs" if step.min_gpus > 1 else ""
            )
            print(f"  {step.name:<13} {step.kind:<7} {step.target}  [needs {needs}; <= {step.timeout_s} s]")
            print(f"  {'':<13} catches: {step.catches}")
        checks = dry_run_checks(steps, work)
        rows += checks
        print()
        print_table(rows)
        return 1 if any(r[1] != "ok" for r in rows[1:]) else 0

    start = time.monotonic()
    if args.wheelhouse:
        rows.append(("wheelhouse", install_wheelhouse(args.python, args.wheelhouse), ""))
    gpus, env_text = environment_row(args.python)
    rows.append(("environment", "ok" if int(gpus) > 0 else "FAILED: no GPU visible", env_text))
    rows.append(installed_versions_row(args.python))
    core_missing = core_import_problem(args.python)
    if core_missing is None and int(gpus) > 0:
        rows.append(("model", prepare_model(args.python, work), ""))
    results = []
    for step in steps:
        left = args.budget_s - (time.monotonic() - start)
        if core_missing is not None:
            results.append(Result(step, f"skipped: {core_missing} not installed"))
        elif (pkg := missing_module(step.requires)) is not None:
            results.append(Result(step, f"skipped: {pkg} not installed"))
        elif int(gpus) < step.min_gpus:
            results.append(Result(step, f"skipped: needs {step.min_gpus} GPUs, {gpus} visible"))
        elif left < 30:
            results.append(Result(step, f"skipped: time budget ({args.budget_s:.0f} s) spent"))
        else:
            result = run_step(step, args.python, left)
            results.append(result)
            print(f"[gpu_check] {step.name}: {result.status} ({result.seconds:.0f} s)", flush=True)
            if args.verbose or result.status.startswith("FAILED"):
                print("\n".join(f"    {line}" for line in result.log[-40:]), flush=True)
    rows += [(r.step.name, r.status + (f" ({r.seconds:.0f} s)" if r.seconds else ""), r.figure) for r in results]
    print()
    print_table(rows)
    print(f"\ntotal {time.monotonic() - start:.0f} s; work dir {work}")
    return 1 if any(r[1].startswith("FAILED") for r in rows[1:]) else 0


if __name__ == "__main__":
    sys.exit(main())
