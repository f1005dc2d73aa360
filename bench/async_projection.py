"""From phase times measured on a few cores to an 8-GPU node: sync against separate_async with partial rollout.

    python bench/async_projection.py                       # the phase times of docs/benchmarks.md §7
    python bench/async_projection.py --gen-s 0.386 --train-s 0.323 --mean-length 38.7 --max-length 48 --push-s 0.039

A model, not a measurement: it says what the measured phases would give on a node of `--gpus` devices under the
assumptions below (docs/benchmarks.md §7 states them beside its table).

- sync (the hybrid engine): every device generates, then every device trains; the generation of a step lasts as long
  as its longest response, so its time is `gen_s` as measured (the tail included), and the step is gen + train +
  push (the in-place weight sync).
- separate_async, η ≥ 1, one batch ahead, partial rollout: `r` devices only generate, `gpus - r` only train. The
  rollout engines keep generating new groups while the longest responses finish (continuous batching, as vLLM
  does), so a batch costs its mean length, not its longest: gen_s × mean/max on all devices, × gpus / r on r of them.
  Training scales ideally to its devices: train_s × gpus / (gpus - r). Generation and training overlap, so a step
  lasts the longer of the two, plus the push, which the training pool waits for.
- Both scale from the measured phase times in proportion: the shares of generation, training and the push in a
  step are what matters, not the machine's speed.
"""

from __future__ import annotations

import argparse

from _common import print_table


def sync_step(gen_s: float, train_s: float, push_s: float) -> float:
    return gen_s + train_s + push_s


def async_step(gen_s: float, train_s: float, push_s: float, tail: float, gpus: int, rollout: int) -> float:
    """One step of separate_async with `rollout` of `gpus` devices generating; `tail` = max / mean length."""
    return max(gen_s / tail * gpus / rollout, train_s * gpus / (gpus - rollout)) + push_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen-s", type=float, default=0.386, help="sync: a step's generation (its tail included)")
    parser.add_argument("--train-s", type=float, default=0.323, help="sync: a step's training (step - generation)")
    parser.add_argument("--push-s", type=float, default=0.039, help="a weight push (timing_s/update_weights)")
    parser.add_argument("--mean-length", type=float, default=38.7)
    parser.add_argument("--max-length", type=float, default=48)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    measured_tail = args.max_length / args.mean_length
    base = sync_step(args.gen_s, args.train_s, args.push_s)
    print(
        f"measured: generation {args.gen_s / base:.0%} of a sync step, training {args.train_s / base:.0%}, push "
        f"{args.push_s / base:.1%}; tail (max / mean length) {measured_tail:.2f}"
    )
    rows = []
    for tail in sorted({round(measured_tail, 2), 2.0, 3.0}):
        for share in sorted({round(args.gen_s / (args.gen_s + args.train_s), 2), 0.5, 0.7, 0.8}):
            gen = share * (args.gen_s + args.train_s)
            train = (1 - share) * (args.gen_s + args.train_s)
            sync = sync_step(gen, train, args.push_s)
            best = min(range(1, args.gpus), key=lambda r: async_step(gen, train, args.push_s, tail, args.gpus, r))
            rows.append(
                [
                    f"{tail:.2f}",
                    f"{share:.0%}",
                    f"{best} + {args.gpus - best}",
                    f"{sync / async_step(gen, train, args.push_s, tail, args.gpus, best):.2f}x",
                ]
            )
    print_table(["tail (max/mean)", "generation share of sync", "best split rollout + train", "vs sync"], rows)


if __name__ == "__main__":
    main()
