"""Asynchronous GRPO (trainer.v1.trainer_modes separate_async, colocate_async) against the sync loop, same cores.

    python bench/async_grpo.py                 # 40 steps each, the first 6 skipped, responses up to 128 tokens
    python bench/async_grpo.py --steps 24 --skip-steps 4 --response-length 48
    python bench/async_grpo.py --job tools --steps 8 --skip-steps 2    # the agentic job (needs the smollm2 extra)
    python bench/async_grpo.py --only colocate  # sync and the colocate_async row
    python bench/async_grpo.py --job tools --tool-latency 1.0   # the agentic job with a slow tool

`--job add_digits` (the default): GRPO on builtin://add_digits with the quickstart's untrained model
(builtin://tiny-quickstart, a 64-token vocabulary), 16 prompts x 8 samples per step, responses up to
--response-length tokens: an untrained policy stops at a random place (an EOS about one token in 64), so the lengths
are geometric, cut at the budget: with 128 tokens the mean is ~70 and a batch's longest reaches the budget, the long
tail of a reasoning batch (reported: the median over the steps of the mean response length, and the longest
response). With 48 tokens most rows run to the budget and the tail is short (docs/benchmarks.md §7 has both).
One optimizer step per training step, lr 3e-4, fp32, remove-padding.

`--job tools`: the agentic job. SmolLM2-135M-Instruct with the tool agent and the calculator on
builtin://calc_multiply (examples/grpo_smollm2_tools_cpu.sh's task), 4 prompts x 6 samples per step at temperature
0.7, up to 3 policy turns and --response-length tokens (default 96 here): trajectories differ in their number of
turns (no call, one call, a malformed call and a retry) and in their lengths, a heavy tail per group.
With `--tool-latency S` the calculator answers after a delay, as a sandbox or a web API does: log-normal with median
S seconds and σ = 1 (a heavy tail: one call in 20 waits over 5 S), drawn from the expression's hash, so every layout
sees the same delay for the same call. The agent loop runs tool calls on threads, so the other trajectories keep
generating while one waits.

Rows, all on the same 2 CPU processes of one thread each:
- sync: both processes generate, then both train (the hybrid engine), the quickstart's layout;
- separate_async η=0: one training process, one rollout process, no overlap (the sync schedule on two pools);
- one-step-off, separate_async η=1 (threshold 2, one batch ahead, partial_rollout=false): the rollout process
  generates the next step's groups while the training process trains, with token-level importance weights for the
  stale samples (rollout_is=token); a push waits for the generation running;
- separate_async η=2 with partial rollout (threshold 3, two batches ahead): the same, streaming, and a push cuts the
  generation running, whose rows (for the tool job: trajectories, inside or between turns) continue on the new
  weights;
- colocate_async η=1 (threshold 2, one batch ahead): both processes generate and train, as sync, and the next
  batch generates between steps, cut once a step's batch is sampled and continued on the new weights.
Step time is the median `timing_s/step` after the warm-up steps: for the async rows the whole cycle, the wait for
samples included. The ratio is sync's step time over each row's (above 1: faster than sync). The machine is shared,
so the runs go one after the other in one process and are compared only with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from _common import print_table

ASYNC = [
    "trainer.n_gpus_per_node=1",
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "trainer.v1.separate_async.parameter_sync_step=1",
]
ROWS = {
    "sync (2 processes, colocated)": ["trainer.n_gpus_per_node=2"],
    "separate_async η=0 (1 + 1)": [*ASYNC, "trainer.v1.sampler.max_off_policy_threshold=1"],
    "one-step-off: separate_async η=1, no partial rollout (1 + 1)": [
        *ASYNC,
        "trainer.v1.sampler.max_off_policy_threshold=2",
        "trainer.v1.separate_async.num_warmup_batches=1",
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.rollout.partial_rollout=false",
    ],
    "separate_async η=2, partial rollout (1 + 1)": [
        *ASYNC,
        "trainer.v1.sampler.max_off_policy_threshold=3",
        "trainer.v1.separate_async.num_warmup_batches=2",
        "algorithm.rollout_correction.rollout_is=token",
    ],
    "colocate_async η=1 (2 processes)": [
        "trainer.n_gpus_per_node=2",
        "trainer.v1.trainer_mode=colocate_async",
        "trainer.v1.sampler.max_off_policy_threshold=2",
        "algorithm.rollout_correction.rollout_is=token",
    ],
}


def add_digits_job(response_length: int) -> list[str]:
    return [
        "actor_rollout_ref.model.path=builtin://tiny-quickstart",
        "data.train_files=builtin://add_digits",
        "data.val_files=builtin://add_digits",
        "data.train_batch_size=16",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.micro_batch_size=64",
        "actor_rollout_ref.actor.optim.lr=3e-4",
        "data.max_prompt_length=16",
        f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=true",
    ]


def tools_job(response_length: int) -> list[str]:
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tools")
    return [
        "actor_rollout_ref.model.path=builtin://smollm2-135m-instruct",
        "data.train_files=builtin://calc_multiply",
        "data.val_files=builtin://calc_multiply",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=12",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=12",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.rollout.temperature=0.7",
        "data.max_prompt_length=192",
        f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}/calculator.yaml",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    ]


JOBS = {"add_digits": (add_digits_job, 128), "tools": (tools_job, 96)}

# --tool-latency: the calculator behind a delay, a function tool file written for the run (its median baked in)
SLOW_CALCULATOR = """
import asyncio
import hashlib
import math
import random
import time

from rlframe.workers.rollout.tools import CalculatorTool, function_tool

CALCULATOR = CalculatorTool({{}}, None)


@function_tool(schema=CALCULATOR.tool_schema)
def calculator(expression: str) -> str:
    seed = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "little")
    time.sleep({median} * math.exp(random.Random(seed).gauss(0.0, 1.0)))
    return asyncio.run(CALCULATOR.execute("", {{"expression": expression}}))[0].text
"""


def slow_calculator(median_s: float, folder: str) -> list[str]:
    path = os.path.join(folder, "slow_calculator.py")
    with open(path, "w") as f:
        f.write(SLOW_CALCULATOR.format(median=median_s))
    return [
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=null",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={path}",
    ]


def job(name: str, steps: int, response_length: int, run_dir: str) -> list[str]:
    return [
        "algorithm.adv_estimator=grpo",
        *JOBS[name][0](response_length),
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.model.use_remove_padding=true",
        "trainer.device=cpu",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]


def run(name: str, overrides: list[str], steps: int, skip: int, response_length: int) -> dict:
    from rlframe.trainer.main_ppo import run_ppo

    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        run_ppo(job(name, steps, response_length, run_dir) + overrides)
        wall = time.perf_counter() - start
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if "timing_s/step" in line][skip:]
    return {
        "step_s": statistics.median(r["timing_s/step"] for r in rows),
        "gen_s": statistics.median(r["timing_s/gen"] for r in rows),
        "length_mean": statistics.median(r["response_length/mean"] for r in rows),
        "length_max": max(r["response_length/max"] for r in rows),
        "turns": statistics.median(r.get("multi_turn/assistant_turns_mean", 1.0) for r in rows),
        "push_s": statistics.median(r.get("timing_s/update_weights", 0.0) for r in rows),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip-steps", type=int, default=6)
    parser.add_argument("--job", choices=sorted(JOBS), default="add_digits")
    parser.add_argument("--response-length", type=int, default=None, help="default: 128 (add_digits), 96 (tools)")
    parser.add_argument("--only", nargs="*", default=None, help="the rows whose name holds one of these (and sync)")
    parser.add_argument("--tool-latency", type=float, default=0.0, help="tools job: the calculator's median delay, s")
    parser.add_argument("--set", nargs="*", default=[], help="key=value overrides for every row (e.g. the push)")
    args = parser.parse_args()
    length = args.response_length or JOBS[args.job][1]
    extra = list(args.set)
    if args.tool_latency:
        if args.job != "tools":
            parser.error("--tool-latency needs --job tools")
        extra += slow_calculator(args.tool_latency, tempfile.mkdtemp(prefix="rlframe_bench_tools_"))
    rows = {
        name: overrides
        for name, overrides in ROWS.items()
        if args.only is None or name.startswith("sync") or any(part in name for part in args.only)
    }
    results = {}
    for name, overrides in rows.items():
        results[name] = run(args.job, overrides + extra, args.steps, args.skip_steps, length)
        print(f"[bench] {name}: {results[name]}", flush=True)  # each row as it ends, before the table
    sync = results["sync (2 processes, colocated)"]["step_s"]
    print_table(
        [
            "layout",
            "step s (median)",
            "waiting for samples s",
            "weight push s",
            "mean length",
            "max length",
            "policy turns (mean)",
            "run wall s",
            "vs sync",
        ],
        [
            [
                name,
                f"{r['step_s']:.3f}",
                f"{r['gen_s']:.3f}",
                f"{r['push_s']:.3f}",
                f"{r['length_mean']:.1f}",
                f"{r['length_max']:.0f}",
                f"{r['turns']:.2f}",
                f"{r['wall_s']:.1f}",
                f"{sync / r['step_s']:.2f}x",
            ]
            for name, r in results.items()
        ],
    )


if __name__ == "__main__":
    main()
