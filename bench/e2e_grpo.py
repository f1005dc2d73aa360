"""End-to-end GRPO throughput of the tiny built-in setup, and TRL's GRPOTrainer on the same job when installed.

    python bench/e2e_grpo.py                     # 20 steps of examples/grpo_tiny_cpu.sh's setup
    python bench/e2e_grpo.py --quick             # 6 steps
    python bench/e2e_grpo.py --trl-path DIR      # DIR holds trl and its dependencies (pip install --target)

rlframe: `run_ppo` with the overrides of `examples/grpo_tiny_cpu.sh` (tiny Qwen2, builtin countdown_add,
8 prompts x 4 samples, mini-batch 4 prompts = 2 optimizer steps per step, 2 CPU worker processes)
and `trainer.total_training_steps`; the figures come from the run's metrics.jsonl (`timing_s/*`,
`perf/total_num_tokens`: prompt + response tokens of the step). Medians skip the first
`--skip-steps` steps (warm-up). Ray start-up and validation are outside the step times.

TRL (when `import trl` works, in a subprocess so its imports stay out of this process): the same
model folder, the same training parquet, the same reward (rlframe's countdown_add scorer), the
same sample budget and optimizer-step count: each generation round samples 8 prompts x 4 and
takes 2 optimizer steps of 16 completions (`per_device_train_batch_size=16`,
`steps_per_generation=2`); lr 3e-3 constant, AdamW, clip 1.0, no
KL (beta 0), one iteration, no gradient checkpointing, fp32 on CPU, `--trl-threads` torch threads
(default 2: the whole machine, as rlframe's two 1-thread workers). One TRL round is compared with one
rlframe step. Work differs slightly: rlframe recomputes old log-probs in a separate forward, TRL
(num_iterations=1) reuses the current policy's; TRL also runs in one process, with no Ray hops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from _common import print_table

PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MINI_BATCH_PROMPTS = 8, 4, 4
MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH = 64, 16  # configs/ppo_trainer.yaml defaults
LR = 3e-3
TRL_NOTE = (
    "TRL's GRPOTrainer is not importable here; pass --trl-path DIR after "
    "`pip install --target DIR --no-deps trl accelerate datasets dill multiprocess psutil xxhash` "
    "(none of them changes torch or transformers) to compare."
)


def rlframe_overrides(steps: int, run_dir: str) -> list[str]:
    """examples/grpo_tiny_cpu.sh's overrides, `steps` steps, validation only at the end."""
    return [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.path=builtin://tiny",
        "data.train_files=builtin://countdown_add",
        "data.val_files=builtin://countdown_add",
        f"data.train_batch_size={PROMPTS_PER_STEP}",
        f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "data.filter_overlong_prompts=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.model.use_remove_padding=true",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]


def run_rlframe(steps: int, skip: int) -> dict:
    """Train with run_ppo in this process; step figures from metrics.jsonl."""
    from rlframe.trainer.main_ppo import run_ppo

    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        run_ppo(rlframe_overrides(steps, run_dir))
        wall = time.perf_counter() - start
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    train = [r for r in rows if "timing_s/step" in r][skip:]
    phases = {
        name[len("timing_s/") :]: statistics.median(r[name] for r in train)
        for name in train[0]
        if name.startswith("timing_s/") and name != "timing_s/step"
    }
    step_s = [r["timing_s/step"] for r in train]
    tokens = [r["perf/total_num_tokens"] for r in train]
    return {
        "step_s": statistics.median(step_s),
        "tokens_per_s": sum(tokens) / sum(step_s),
        "tokens_per_step": statistics.mean(tokens),
        "wall_s": wall,
        "phases": phases,
        "reward": statistics.mean(r["critic/score/mean"] for r in train),
        "steps": len(train),
    }


def trl_importable(trl_path: str | None) -> bool:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (trl_path, os.environ.get("PYTHONPATH")) if p))
    probe = subprocess.run([sys.executable, "-c", "import trl"], env=env, capture_output=True)
    return probe.returncode == 0


def run_trl(steps: int, skip: int, threads: int, trl_path: str | None) -> dict:
    """Run `_trl_worker` in a subprocess (with `trl_path` on its PYTHONPATH); return its figures."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (trl_path, os.environ.get("PYTHONPATH")) if p))
        job = {"steps": steps, "skip": skip, "threads": threads, "out": out.name}
        proc = subprocess.run(
            [sys.executable, __file__, "--trl-worker", json.dumps(job)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the TRL run failed (exit {proc.returncode}); its output ends:\n{proc.stdout[-4000:]}")
        with open(out.name) as f:
            return json.load(f)


def _trl_worker(job: dict) -> None:
    """TRL GRPO on the rlframe job; writes step/throughput figures to job['out']."""
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlframe.data.builtin_tasks import resolve_data_files
    from rlframe.models.builtin import resolve_model_path
    from rlframe.reward.manager import normalize_score
    from rlframe.reward.scorers import countdown_add_score

    torch.set_num_threads(job["threads"])
    model_path = resolve_model_path("builtin://tiny")
    train_file = resolve_data_files("builtin://countdown_add", seed=1, split="train")[0]
    dataset = datasets.load_dataset("parquet", data_files=train_file, split="train")

    def reward(completions, reward_model, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [normalize_score(countdown_add_score(t, rm["ground_truth"]))[0] for t, rm in zip(texts, reward_model)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends, self.tokens = [time.perf_counter()], []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.tokens.append(state.num_input_tokens_seen)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=job["steps"] * (PROMPTS_PER_STEP // MINI_BATCH_PROMPTS),
        per_device_train_batch_size=MINI_BATCH_PROMPTS * SAMPLES_PER_PROMPT,
        steps_per_generation=PROMPTS_PER_STEP // MINI_BATCH_PROMPTS,
        num_generations=SAMPLES_PER_PROMPT,
        max_completion_length=MAX_RESPONSE_LENGTH,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=1,
        disable_tqdm=True,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[clock],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    per_round = PROMPTS_PER_STEP // MINI_BATCH_PROMPTS  # optimizer steps per generation round
    bounds = clock.ends[::per_round]
    round_s = [b - a for a, b in zip(bounds, bounds[1:])][job["skip"] :]
    counts = [0] + clock.tokens[per_round - 1 :: per_round]
    round_tokens = [b - a for a, b in zip(counts, counts[1:])][job["skip"] :]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {
        "step_s": statistics.median(round_s),
        "tokens_per_s": sum(round_tokens) / sum(round_s),
        "tokens_per_step": statistics.mean(round_tokens),
        "wall_s": wall,
        "reward": statistics.mean(rewards[job["skip"] * per_round :]) if rewards else float("nan"),
        "steps": len(round_s),
        "trl_version": __import__("trl").__version__,
    }
    with open(job["out"], "w") as f:
        json.dump(result, f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-steps", type=int, default=2, help="warm-up steps left out of the medians")
    parser.add_argument("--trl-path", default=None, help="a folder with trl and its dependencies, put on PYTHONPATH")
    parser.add_argument("--trl-threads", type=int, default=2)
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        _trl_worker(json.loads(args.trl_worker))
        return
    if args.quick:
        args.steps, args.skip_steps = 6, 1

    ours = run_rlframe(args.steps, args.skip_steps)
    theirs = None
    if not args.no_trl and trl_importable(args.trl_path):
        theirs = run_trl(args.steps, args.skip_steps, args.trl_threads, args.trl_path)

    print(
        f"\nGRPO, tiny Qwen2 on builtin://countdown_add, {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples "
        f"per step, {PROMPTS_PER_STEP // MINI_BATCH_PROMPTS} optimizer steps per step, {args.steps} steps "
        f"(medians skip the first {args.skip_steps}); {os.cpu_count()} CPU cores\n"
    )
    headers = ["", "step s (median)", "tokens/s", "tokens/step", "mean reward", "run wall s"]
    rows = [
        [
            "rlframe (2 workers)",
            f"{ours['step_s']:.2f}",
            f"{ours['tokens_per_s']:.0f}",
            f"{ours['tokens_per_step']:.0f}",
            f"{ours['reward']:.3f}",
            f"{ours['wall_s']:.0f}",
        ]
    ]
    if theirs is not None:
        rows.append(
            [
                f"TRL {theirs['trl_version']} GRPOTrainer",
                f"{theirs['step_s']:.2f}",
                f"{theirs['tokens_per_s']:.0f}",
                f"{theirs['tokens_per_step']:.0f}",
                f"{theirs['reward']:.3f}",
                f"{theirs['wall_s']:.0f}",
            ]
        )
        rows.append(
            [
                "rlframe speedup",
                f"{theirs['step_s'] / ours['step_s']:.2f}x",
                f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x",
                "",
                "",
                "",
            ]
        )
    print_table(headers, rows)
    phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in ours["phases"].items())
    print(f"\nrlframe median seconds per phase: {phases}")
    print(
        "run wall s: rlframe's includes Ray start-up and the final validation"
        + ("; TRL's is trainer.train() only" if theirs is not None else "")
    )
    if theirs is None:
        print("\n" + ("TRL comparison skipped (--no-trl)." if args.no_trl else TRL_NOTE))


if __name__ == "__main__":
    main()
