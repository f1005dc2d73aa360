"""Record the learning baseline: per-step reward, loss, grad-norm curves of the built-in GRPO run.

    python scripts/record_learning_baseline.py        # re-record tests/assets/learning/grpo_add_digits_tiny.json
    python scripts/record_learning_baseline.py --seeds 1 --out /tmp/x.json actor_rollout_ref.actor.optim.lr=1e-9
    python scripts/record_learning_baseline.py --quickstart-run checkpoints/rlframe/tiny_grpo   # the README's run

Runs the baseline config once per seed (`data.seed`; the first seed is the reference run that
tests/e2e/test_learning_baseline.py repeats, the others measure how far an equally valid run can
land from it) and writes every run's per-step curves, the config and the library versions.
Every key that shapes learning is set below explicitly instead of being taken from
configs/ppo_trainer.yaml, so a changed default does not silently change the baseline run.
Re-record only when a change is meant to alter learning (docs/learning_baseline.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE_PATH = os.path.join(ROOT, "tests", "assets", "learning", "grpo_add_digits_tiny.json")
# One full quickstart run (500 steps, `bash scripts/quickstart.sh`), the README's table: written by --quickstart.
QUICKSTART_RUN_PATH = os.path.join(ROOT, "tests", "assets", "learning", "quickstart_run.json")

NUM_STEPS = 150  # the quickstart's first 150 steps: exact answers begin to appear (the test's budget: ~2 minutes)
WINDOW = 25  # curves are compared as means over windows of this many steps
REFERENCE_SEED = 1
SPREAD_SEEDS = (2, 3, 4)  # the fewest the test accepts (docs/learning_baseline.md: measured spread)

# The quickstart run (scripts/quickstart.sh -> examples/grpo_tiny_cpu.sh), its first NUM_STEPS steps, with
# every default that affects the learning curve written out; no validation until the end (not part of the curve).
OVERRIDES = [
    # task, model, reward
    "actor_rollout_ref.model.path=builtin://tiny-quickstart",
    "data.train_files=builtin://add_digits",
    "data.val_files=builtin://add_digits",
    "data.shuffle=true",
    "data.max_prompt_length=16",
    "data.max_response_length=3",
    "data.filter_overlong_prompts=true",
    "reward_model.enable=false",
    "reward_model.reward_manager=naive",
    # algorithm
    "algorithm.adv_estimator=grpo",
    "algorithm.norm_adv_by_std_in_grpo=true",
    "algorithm.use_kl_in_reward=false",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.entropy_coeff=0.003",
    "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.2",
    "actor_rollout_ref.actor.clip_ratio_c=3.0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "actor_rollout_ref.actor.shuffle=false",
    "actor_rollout_ref.actor.optim.clip_grad=1.0",
    # batch sizes
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128",
    "trainer.balance_batch=true",
    # optimizer and schedule
    "actor_rollout_ref.actor.optim.lr=3e-4",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.0",
    "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
    "actor_rollout_ref.actor.optim.weight_decay=0.01",
    "actor_rollout_ref.actor.optim.betas=[0.9,0.999]",
    # sampling
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.do_sample=true",
    "actor_rollout_ref.rollout.micro_batch_size=128",
    # engine: 2 CPU worker processes, FSDP2, fp32, packed sequences
    "trainer.device=cpu",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    # run
    f"trainer.total_training_steps={NUM_STEPS}",
    "trainer.critic_warmup=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.logger=[jsonl]",
]

# Per-step metrics that say whether the policy learns (names as logged in metrics.jsonl).
CURVE_METRICS = [
    "critic/score/mean",
    "reward/acc/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "response_length/mean",
]


def run_config(
    run_dir: str, seed: int, extra_overrides=(), env: dict | None = None, timeout_s: float | None = None
) -> subprocess.CompletedProcess:
    """Train the baseline config with `data.seed=seed` in a fresh process; metrics land in run_dir."""
    command = [
        sys.executable,
        "-m",
        "rlframe.trainer.main_ppo",
        *OVERRIDES,
        f"data.seed={seed}",
        *extra_overrides,
        f"trainer.default_local_dir={run_dir}",
    ]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s)


def read_curves(run_dir: str) -> dict[str, list[float]]:
    """CURVE_METRICS per training step (step 1 first) from the run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = sorted((r for r in rows if "actor/pg_loss" in r), key=lambda r: r["step"])
    numbers = [r["step"] for r in steps]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(
            f"{run_dir}/metrics.jsonl: training steps {numbers} are not 1..N (a resumed or "
            "appended run? use an empty run folder)"
        )
    missing = [key for key in CURVE_METRICS if steps and key not in steps[0]]
    if missing:
        raise ValueError(f"{run_dir}/metrics.jsonl has no {missing}; logged keys: {sorted(steps[0])}")
    return {key: [float(r[key]) for r in steps] for key in CURVE_METRICS}


def window_means(values: list[float], window: int) -> list[float]:
    """Means over consecutive, non-overlapping windows of `window` steps (a shorter tail is dropped)."""
    return [sum(values[i : i + window]) / window for i in range(0, len(values) - window + 1, window)]


def versions() -> dict[str, str]:
    """Library versions and machine the curves were recorded with (float noise depends on them)."""
    import torch
    import transformers

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") + (" with uncommitted changes" if git("status", "--porcelain", "rlframe") else "")
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rlframe_commit": commit,
    }


def format_record(record: dict) -> str:
    """JSON with one line per curve, so a re-recording's diff shows which curves moved."""
    head = json.dumps({key: value for key, value in record.items() if key != "runs"}, indent=1)
    runs = ",\n".join(
        f'  "{seed}": {{\n'
        + ",\n".join(f'   "{metric}": {json.dumps(values)}' for metric, values in curves.items())
        + "\n  }"
        for seed, curves in record["runs"].items()
    )
    return head[:-2] + ',\n "runs": {\n' + runs + "\n }\n}\n"


def train_and_read(run_dir: str, seed: int, extra_overrides=()) -> dict[str, list[float]]:
    """One seed's curves; a failed run exits with the tail of its output."""
    result = run_config(run_dir, seed, extra_overrides)
    if result.returncode != 0:
        sys.exit(
            f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}\n"
            f"the run with data.seed={seed} failed (exit status {result.returncode}); its output is above"
        )
    return read_curves(run_dir)


QUICKSTART_WINDOW = 50  # the README's table: means over this many steps


def read_quickstart_run(run_dir: str) -> dict:
    """A full quickstart run's per-step reward and exact accuracy, and its greedy validation by step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = sorted((r for r in rows if "critic/score/mean" in r), key=lambda r: r["step"])
    validation = {str(r["step"]): value for r in rows for key, value in r.items() if key.startswith("val-core/")}
    return {
        "reward": [r["critic/score/mean"] for r in steps],
        "acc": [r["reward/acc/mean"] for r in steps],
        "step_s": [r["timing_s/step"] for r in steps],
        "validation": validation,
    }


def quickstart_table(run: dict, window: int = QUICKSTART_WINDOW) -> str:
    """The README's table: mean training reward and exact accuracy per window, greedy validation at its end."""
    lines = [
        "| steps | mean training reward | exact-answer accuracy (sampled) | greedy validation reward (64 prompts) |",
        "|---|---|---|---|",
        f"| before training | | | {run['validation']['0']:.3f} |",
    ]
    rewards, accs = window_means(run["reward"], window), window_means(run["acc"], window)
    for i, (reward, acc) in enumerate(zip(rewards, accs)):
        last = (i + 1) * window
        val = run["validation"].get(str(last))
        lines.append(f"| {i * window + 1}–{last} | {reward:.3f} | {acc:.3f} | {'' if val is None else f'{val:.3f}'} |")
    return "\n".join(lines)


def record_quickstart_run(run_dir: str, out: str = QUICKSTART_RUN_PATH) -> None:
    """Keep a finished `bash scripts/quickstart.sh` run (RUN_DIR) as the README's curve and print its table."""
    run = {
        "description": "one run of examples/grpo_tiny_cpu.sh (scripts/quickstart.sh): per-step training reward "
        "and exact accuracy, greedy validation by step; the README's table is quickstart_table() of it",
        "versions": versions(),
        **read_quickstart_run(run_dir),
    }
    with open(out, "w") as f:
        json.dump(run, f, indent=1)
        f.write("\n")
    print(quickstart_table(run))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quickstart-run", default=None, help="keep this finished quickstart run folder instead")
    parser.add_argument("--out", default=BASELINE_PATH, help="where to write the JSON (default: the test's baseline)")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[REFERENCE_SEED, *SPREAD_SEEDS],
        help="data.seed of each run; the first is the reference run the test repeats",
    )
    parser.add_argument("--run-root", default=None, help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="extra KEY=VALUE overrides (only with --out elsewhere)")
    args = parser.parse_args(argv)
    if args.quickstart_run:
        record_quickstart_run(args.quickstart_run)
        return
    if os.path.abspath(args.out) == BASELINE_PATH and (args.overrides or args.seeds[0] != REFERENCE_SEED):
        parser.error(
            f"overrides {args.overrides} / first seed {args.seeds[0]} would change the baseline config; "
            f"edit OVERRIDES or REFERENCE_SEED in {__file__} instead, or write this variant with --out"
        )
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs[str(seed)] = train_and_read(os.path.join(args.run_root or tmp, f"seed{seed}"), seed, args.overrides)
            reward = window_means(runs[str(seed)]["critic/score/mean"], WINDOW)
            print(
                f"data.seed={seed}: mean training reward per {WINDOW} steps: " + " ".join(f"{m:.3f}" for m in reward),
                flush=True,
            )
    record = {
        "description": "GRPO on builtin://add_digits with builtin://tiny-quickstart, 2 CPU workers: per-step "
        "curves of one run per data.seed; written by scripts/record_learning_baseline.py, "
        "checked by tests/e2e/test_learning_baseline.py (see docs/learning_baseline.md)",
        "overrides": OVERRIDES + list(args.overrides),
        "reference_seed": args.seeds[0],
        "window": WINDOW,
        "num_steps": NUM_STEPS,
        "versions": versions(),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(format_record(record))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
