"""Dynamic (token budget) vs static (sequence count) micro-batching: actor update step time.

    python bench/dynamic_bsz.py            # 64 sequences; micro-batch 1 and 4 vs budgets of 1 and 4 rows
    python bench/dynamic_bsz.py --quick    # 32 sequences, micro-batch 4 only, 2 steps each

One `PPOActor.update_policy` call on a single process (no FSDP): one mini-batch holding the whole
batch, one optimizer step (AdamW), remove-padding on, GRPO-style loss (KL loss, no entropy).
Static micro-batching cuts `micro_batch_size` sequences at a time; dynamic packs sequences
into micro-batches of at most `micro_batch_size x (prompt_width + response_width)` real tokens:
the same worst-case memory as the static micro-batch, which is how one would pick the budget.
On the bimodal mix most sequences are short, so the budget holds many more of them and the
step runs far fewer, fuller micro-batches. Lengths: see `bench/_common.py`.
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    CPU_MIX,
    add_thread_flag,
    make_rl_batch,
    median,
    padding_stats,
    print_table,
    sample_lengths,
    timed,
    tiny_causal_lm,
)

from rlframe.batch_plan import ForwardPlan, UpdatePlan
from rlframe.workers.actor import PPOActor
from rlframe.workers.batching import split_micro_batches
from rlframe.workers.config.actor import ActorConfig
from rlframe.workers.config.model import OptimConfig
from rlframe.workers.updater import ModelOptions, RoleModel

MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512)


def one_pass(num_seqs: int, micro_batch_size: int | None = None, max_token_len: int | None = None) -> UpdatePlan:
    """The plan of one process's update of one mini-batch of `num_seqs`, its update and forward cut alike: by
    `micro_batch_size` sequences (static), else by a budget of `max_token_len` tokens (dynamic)."""
    dynamic = max_token_len is not None
    cut = {
        "sequence_parallel_size": 1,
        "dp_size": 1,
        "sequences_per_gpu": num_seqs,
        "sequences_per_dp": num_seqs,
        "use_dynamic_bsz": dynamic,
        "micro_batch_size": micro_batch_size,
        "max_token_len_per_gpu": max_token_len,
        "max_token_len": max_token_len,
        "packing_algorithm": "kk" if dynamic else None,
    }
    return UpdatePlan(
        **cut,
        mini_batch_size=num_seqs,
        mini_batch_size_per_dp=num_seqs,
        num_mini_batches=1,
        ppo_epochs=1,
        optimizer_steps_per_step=1,
        grad_accum_steps=None,
        forward=ForwardPlan(**cut, num_micro_batches=None),
    )


def make_actor(model, plan: UpdatePlan) -> PPOActor:
    """A one-process actor cut as `plan`."""
    config = ActorConfig(clip_ratio_high=0.28, use_kl_loss=True, optim=OptimConfig(clip_grad=1.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return PPOActor(RoleModel(model, ModelOptions(use_remove_padding=True), optimizer), config, plan)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sequences and steps (a smoke run)")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument(
        "--micro-batch-sizes",
        type=int,
        nargs="+",
        default=[1, 4],
        help="static micro-batch sizes; each is compared with a budget of that many full-width rows",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    add_thread_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_seqs, args.steps, args.micro_batch_sizes = 32, 2, [4]
    torch.set_num_threads(args.threads)

    width = CPU_MIX.prompt_width + CPU_MIX.response_width
    prompt_lens, response_lens = sample_lengths(CPU_MIX, args.num_seqs, args.seed)
    data = make_rl_batch(
        prompt_lens, response_lens, CPU_MIX.prompt_width, CPU_MIX.response_width, MODEL["vocab_size"], args.seed
    )
    real, _ = padding_stats(data)
    print(
        f"PPOActor.update_policy on CPU ({torch.get_num_threads()} threads), one process, no FSDP, "
        f"remove-padding on; Qwen2 hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers"
    )
    print(
        f"{args.num_seqs} sequences ({real} real tokens, width {width}), {CPU_MIX.describe()}; "
        f"median of {args.steps} steps after 1 warm-up\n"
    )
    rows = []
    for size in args.micro_batch_sizes:
        modes = {
            f"static {size} seqs": one_pass(args.num_seqs, micro_batch_size=size),
            f"dynamic {size * width} tokens": one_pass(args.num_seqs, max_token_len=size * width),
        }
        step_s, counts = compare(modes, data, args.steps)
        static_s = next(iter(step_s.values()))
        for name in modes:
            tokens = counts[name]
            rows.append(
                [
                    name,
                    len(tokens),
                    f"{sum(tokens) / len(tokens):.0f}",
                    max(tokens),
                    f"{step_s[name]:.2f}",
                    f"{step_s[name] / static_s:.2f}",
                    f"{static_s / step_s[name]:.2f}",
                ]
            )
    print_table(
        ["micro-batching", "micro-batches", "mean tokens", "max tokens", "step s", "time ratio", "speedup"], rows
    )


def compare(modes: dict[str, UpdatePlan], data, steps: int) -> tuple[dict, dict]:
    """Median update_policy seconds and per-micro-batch real token counts of each mode."""
    actors, counts = {}, {}
    for name, plan in modes.items():
        model = tiny_causal_lm(**MODEL, use_remove_padding=True)  # same seed: same weights in every mode
        actors[name] = make_actor(model, plan)
        micro_batches, _ = split_micro_batches(data.batch, plan)
        counts[name] = [int(m["attention_mask"].sum()) for m in micro_batches]
    times = {name: [] for name in modes}
    for actor in actors.values():
        actor.update_policy(data)  # warm-up
    for _ in range(steps):  # interleaved, so background load hits every mode alike
        for name, actor in actors.items():
            times[name].append(timed(lambda: actor.update_policy(data)))
    return {name: median(t) for name, t in times.items()}, counts


if __name__ == "__main__":
    main()
