"""End-to-end GRPO throughput, rlframe vs TRL's GRPOTrainer on the same job (when trl is importable).

    python bench/e2e_grpo.py                                      # tiny model, 20 steps
    python bench/e2e_grpo.py --model builtin://smollm2-135m-instruct  # SmolLM2-135M-Instruct, 8 steps
    python bench/e2e_grpo.py --model builtin://tiny --model builtin://smollm2-135m-instruct  # both, one table
    python bench/e2e_grpo.py --quick                              # 6 steps (tiny) / 4 steps (others)
    python bench/e2e_grpo.py --trl-path DIR                       # DIR holds trl and its dependencies
    python bench/e2e_grpo.py --workers 1                          # rlframe with one worker process
    python bench/e2e_grpo.py --model builtin://smollm2-135m-instruct --response-length 128 \
        --rollout hf --rollout vllm                               # both rollout engines, one table (vLLM's
                                                                  # CPU build: run it with .venv-vllm's python)

The job (`job_for`): GRPO on builtin://countdown_add with 2 CPU worker processes of one thread
(`--workers`: another count; the micro-batch sizes follow, one per worker and optimizer step).
With the tiny model (builtin://tiny): 8 prompts x 4 samples, responses <= 16 tokens, mini-batch 4
prompts = 2 optimizer steps per step, lr 3e-3. With any other model (a folder or
builtin://smollm2-135m-instruct): 4 prompts x 4 samples, responses <= 32 tokens, one mini-batch =
one optimizer step per step (exactly on-policy), lr 1e-6. Remove-padding on, no gradient
checkpointing, fp32. Each worker runs its share of a mini-batch as one micro-batch (and its share
of the step's log-prob pass as one), as TRL's `per_device_train_batch_size` is one mini-batch:
one forward/backward per optimizer step in both. Both models fit whole in each worker's memory (as
TRL keeps the whole model), so the job sets `fsdp_config.reshard_after_forward=false` (verl's key,
default true): the gathered parameters stay from a forward to its backward (and across the
log-prob pass's micro-batches) instead of being gathered again. `--rollout vllm` runs rlframe's job with
the vLLM rollout (vLLM's CPU build on a CPU: `actor_rollout_ref.rollout.name=vllm`, max_model_len = prompt +
response, enforce_eager; the same sampling and job otherwise); several `--rollout`s give one row each, against the
same TRL run (TRL's own vLLM mode does not run on vLLM's CPU build: docs/benchmarks.md §5). rlframe's figures
come from the run's metrics.jsonl (`timing_s/*`, `perf/total_num_tokens`: prompt + response tokens of the step).
Medians skip the first `--skip-steps` steps (warm-up). Ray start-up and validation are outside the
step times. Several `--model`s run one after the other and end with one line of ratios.

TRL (in a subprocess, so its imports stay out of this process): the same model folder, training
parquet, reward (rlframe's countdown_add scorer), sampling (temperature 1, no top-k/top-p), sample
budget and optimizer-step count: each generation round samples the step's prompts x samples and
takes `prompts / mini-batch` optimizer steps (`per_device_train_batch_size` = one mini-batch of
completions, `steps_per_generation`); the same lr, constant, AdamW (weight decay 0.01), clip 1.0,
no KL (beta 0), one iteration, fp32 on CPU, `--trl-threads` torch threads (default 2: the whole
machine, as rlframe's two 1-thread workers). One TRL round is compared with one rlframe step.
TRL's phases are timed by wrapping its `_generate` (gen), `_calculate_rewards` (reward) and
`_generate_and_score_completions` (all of the round's preparation; minus gen and reward it is the
old-log-prob forward, which TRL runs only when a round takes several optimizer steps); `update` is
the round minus its preparation. TRL runs in one process, with no Ray hops.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from _common import print_table

TINY = "builtin://tiny"
TRL_NOTE = (
    "TRL's GRPOTrainer is not importable here; pass --trl-path DIR after "
    "`pip install --target DIR --no-deps trl accelerate datasets dill multiprocess psutil xxhash` "
    "(none of them changes torch or transformers) to compare."
)


@dataclasses.dataclass(frozen=True)
class Job:
    """One GRPO job, run the same way by rlframe and TRL."""

    model: str
    prompts: int  # per step
    samples: int  # per prompt
    mini_batch_prompts: int  # prompts per optimizer step
    max_prompt_length: int
    max_response_length: int
    lr: float
    workers: int = 2

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per training step (generation round)."""
        return self.prompts // self.mini_batch_prompts

    @property
    def micro_batch_per_worker(self) -> int:
        """A worker's share of one mini-batch: one forward/backward per optimizer step."""
        return self.mini_batch_prompts * self.samples // self.workers

    @property
    def log_prob_micro_batch_per_worker(self) -> int:
        """A worker's share of the step: the log-prob pass (when it runs) in one forward."""
        return self.prompts * self.samples // self.workers


def job_for(model: str) -> Job:
    """The tiny model's job (8 x 4, 16 tokens, 2 optimizer steps); real models get issue 12's (4 x 4, 32 tokens)."""
    if model == TINY:
        return Job(TINY, 8, 4, 4, 64, 16, 3e-3)
    return Job(model, 4, 4, 4, 128, 32, 1e-6)


def rlframe_overrides(job: Job, steps: int, run_dir: str) -> list[str]:
    """The job as main_ppo overrides, `steps` steps, no validation."""
    return [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={job.model}",
        "data.train_files=builtin://countdown_add",
        "data.val_files=builtin://countdown_add",
        f"data.train_batch_size={job.prompts}",
        f"actor_rollout_ref.rollout.n={job.samples}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={job.mini_batch_prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={job.micro_batch_per_worker}",
        f"actor_rollout_ref.actor.optim.lr={job.lr}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={job.log_prob_micro_batch_per_worker}",
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
        f"data.max_prompt_length={job.max_prompt_length}",
        f"data.max_response_length={job.max_response_length}",
        "data.filter_overlong_prompts=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"trainer.n_gpus_per_node={job.workers}",
        "trainer.device=cpu",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]


def rollout_overrides(job: Job, rollout: str) -> list[str]:
    """The rollout engine's keys: hf needs none; vllm gets a KV cache for its share of a step's sequences."""
    if rollout == "hf":
        return []
    return [
        f"actor_rollout_ref.rollout.name={rollout}",
        f"actor_rollout_ref.rollout.max_model_len={job.max_prompt_length + job.max_response_length}",
        f"actor_rollout_ref.rollout.max_num_seqs={job.prompts * job.samples}",
        "actor_rollout_ref.rollout.enforce_eager=true",
    ]


def run_rlframe(job: Job, steps: int, skip: int, extra: list[str] = ()) -> dict:
    """Train with run_ppo in this process (`extra` overrides last); step figures from metrics.jsonl."""
    from rlframe.trainer.main_ppo import run_ppo

    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        run_ppo(rlframe_overrides(job, steps, run_dir) + list(extra))
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


def run_trl(job: Job, steps: int, skip: int, threads: int, trl_path: str | None) -> dict:
    """Run `_trl_worker` in a subprocess (with `trl_path` on its PYTHONPATH); return its figures."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (trl_path, os.environ.get("PYTHONPATH")) if p))
        spec = {"job": dataclasses.asdict(job), "steps": steps, "skip": skip, "threads": threads, "out": out.name}
        proc = subprocess.run(
            [sys.executable, __file__, "--trl-worker", json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the TRL run failed (exit {proc.returncode}); its output ends:\n{proc.stdout[-4000:]}")
        with open(out.name) as f:
            return json.load(f)


def _timed(method, seconds: list[float]):
    """`method`, appending the wall time of each call to `seconds`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    return wrapper


def _trl_worker(spec: dict) -> None:
    """TRL GRPO on the rlframe job; writes step/throughput figures to spec['out']."""
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlframe.data.builtin_tasks import resolve_data_files
    from rlframe.models.builtin import resolve_model_path
    from rlframe.reward.manager import normalize_score
    from rlframe.reward.scorers import countdown_add_score

    job = Job(**spec["job"])
    torch.set_num_threads(spec["threads"])
    model_path = resolve_model_path(job.model)
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
        max_steps=spec["steps"] * job.optimizer_steps,
        per_device_train_batch_size=job.mini_batch_prompts * job.samples,
        steps_per_generation=job.optimizer_steps,
        num_generations=job.samples,
        max_completion_length=job.max_response_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        learning_rate=job.lr,
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
    calls = {"gen": [], "reward": [], "prepare": []}
    trainer._generate = _timed(trainer._generate, calls["gen"])
    trainer._calculate_rewards = _timed(trainer._calculate_rewards, calls["reward"])
    trainer._generate_and_score_completions = _timed(trainer._generate_and_score_completions, calls["prepare"])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    per_round, skip = job.optimizer_steps, spec["skip"]
    bounds = clock.ends[::per_round]
    round_s = [b - a for a, b in zip(bounds, bounds[1:])]
    counts = [0] + clock.tokens[per_round - 1 :: per_round]
    round_tokens = [b - a for a, b in zip(counts, counts[1:])][skip:]
    rounds = list(zip(round_s, calls["gen"], calls["reward"], calls["prepare"]))[skip:]
    phases = {
        "gen": statistics.median(g for _, g, _, _ in rounds),
        "reward": statistics.median(r for _, _, r, _ in rounds),
        "old_log_prob": statistics.median(p - g - r for _, g, r, p in rounds),
        "update": statistics.median(s - p for s, _, _, p in rounds),
    }
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {
        "step_s": statistics.median(round_s[skip:]),
        "tokens_per_s": sum(round_tokens) / sum(round_s[skip:]),
        "tokens_per_step": statistics.mean(round_tokens),
        "wall_s": wall,
        "phases": phases,
        "reward": statistics.mean(rewards[skip * per_round :]) if rewards else float("nan"),
        "steps": len(round_s) - skip,
        "trl_version": __import__("trl").__version__,
    }
    with open(spec["out"], "w") as f:
        json.dump(result, f)


def _row(name: str, figures: dict) -> list[str]:
    return [
        name,
        f"{figures['step_s']:.2f}",
        f"{figures['tokens_per_s']:.0f}",
        f"{figures['tokens_per_step']:.0f}",
        f"{figures['reward']:.3f}",
        f"{figures['wall_s']:.0f}",
    ]


def _load() -> str:
    """The machine's 1-minute load average (other processes share the cores)."""
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="builtin://tiny (default), builtin://NAME or a model folder; repeat it to run several in turn",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 steps (tiny), 4 steps (others)")
    parser.add_argument("--steps", type=int, default=None, help="default: 20 (tiny), 8 (others)")
    parser.add_argument("--skip-steps", type=int, default=None, help="warm-up steps left out of the medians (2)")
    parser.add_argument("--trl-path", default=None, help="a folder with trl and its dependencies, put on PYTHONPATH")
    parser.add_argument("--trl-threads", type=int, default=2)
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    parser.add_argument(
        "--override", action="append", default=[], help="KEY=VALUE for rlframe's run (repeatable), after the job's"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="rlframe's worker processes (trainer.n_gpus_per_node); TRL runs one"
    )
    parser.add_argument(
        "--rollout",
        action="append",
        choices=("hf", "vllm"),
        default=None,
        help="rlframe's rollout engine (default hf); repeat it for one row per engine",
    )
    parser.add_argument(
        "--response-length", type=int, default=None, help="max response tokens (default: 16 tiny, 32 others)"
    )
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        _trl_worker(json.loads(args.trl_worker))
        return
    with_trl = not args.no_trl and trl_importable(args.trl_path)
    ratios = {}
    for model in args.model or [TINY]:
        job = dataclasses.replace(job_for(model), workers=args.workers)
        if args.response_length:
            job = dataclasses.replace(job, max_response_length=args.response_length)
        ratios[model] = compare(job, args, with_trl)
    if with_trl:
        print(
            "\nrlframe / TRL tokens/s: "
            + ", ".join(f"{model} ({rollout}) {r:.2f}x" for model, by in ratios.items() for rollout, r in by.items())
        )
    else:
        print("\n" + ("TRL comparison skipped (--no-trl)." if args.no_trl else TRL_NOTE))


def compare(job: Job, args: argparse.Namespace, with_trl: bool) -> dict[str, float]:
    """Run `job` in rlframe (once per rollout engine) and TRL, print its tables; tokens/s rlframe / TRL by engine."""
    steps = args.steps or (20 if job.model == TINY else 8)
    skip = 2 if args.skip_steps is None else args.skip_steps
    if args.quick:
        steps, skip = (6, 1) if job.model == TINY else (4, 1)
    loads = [_load()]
    ours = {}
    for rollout in args.rollout or ["hf"]:
        ours[rollout] = run_rlframe(job, steps, skip, rollout_overrides(job, rollout) + args.override)
        loads.append(_load())
    theirs = None
    if with_trl:
        theirs = run_trl(job, steps, skip, args.trl_threads, args.trl_path)
        loads.append(_load())

    print(
        f"\nGRPO, {job.model} on builtin://countdown_add, {job.prompts} prompts x {job.samples} samples per step, "
        f"responses <= {job.max_response_length} tokens, {job.optimizer_steps} optimizer step(s) per step, "
        f"{steps} steps (medians skip the first {skip}); {os.cpu_count()} CPU cores; "
        f"1-min load average at start / after each rlframe run / after TRL: {' / '.join(loads)}\n"
    )
    headers = ["", "step s (median)", "tokens/s", "tokens/step", "mean reward", "run wall s"]
    rows = [_row(f"rlframe ({job.workers} workers, {rollout} rollout)", f) for rollout, f in ours.items()]
    ratios = {}
    if theirs is not None:
        rows.append(_row(f"TRL {theirs['trl_version']} GRPOTrainer", theirs))
        for rollout, figures in ours.items():
            ratios[rollout] = figures["tokens_per_s"] / theirs["tokens_per_s"]
            step_ratio = theirs["step_s"] / figures["step_s"]
            rows.append([f"rlframe ({rollout}) / TRL", f"{step_ratio:.2f}x", f"{ratios[rollout]:.2f}x", "", "", ""])
    print_table(headers, rows)
    named = [(f"rlframe ({rollout} rollout)", figures) for rollout, figures in ours.items()]
    for name, figures in named + ([("TRL", theirs)] if theirs is not None else []):
        phases = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in figures["phases"].items())
        print(f"\n{name} median seconds per phase: {phases}")
    print(
        "run wall s: rlframe's includes Ray start-up and model loading"
        + ("; TRL's is trainer.train() only" if theirs is not None else ""),
        flush=True,
    )
    return ratios


if __name__ == "__main__":
    main()
