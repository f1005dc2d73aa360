"""Balance quality and speed of rlframe.seqpack, side by side with verl's when it is importable.

    python bench/seqpack.py            # full run (about a minute on two cores)
    python bench/seqpack.py --quick    # fewer seeds and repeats

verl is optional: `pip install --no-deps verl` next to torch, tensordict, ray, omegaconf and
transformers makes `verl.utils.seqlen_balancing` importable. Timings are the best CPU time of
several runs (both sides are single-threaded Python/numpy).
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from rlframe.seqpack import (
    ffd_allocate,
    get_seqlen_balanced_partitions,
    karmarkar_karp,
    kk_allocate,
    packing_metrics,
)

try:
    from verl.utils import seqlen_balancing as verl_balancing
except Exception:  # not installed, or its imports fail: report our own figures only
    verl_balancing = None


def make_lengths(kind: str, num: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "bimodal":  # 30% long 800-2048, 70% short 50-200
        is_long = rng.random(num) < 0.3
        return np.where(is_long, rng.integers(800, 2049, num), rng.integers(50, 201, num))
    if kind == "uniform":
        return rng.integers(1, 4097, num)
    if kind == "random":  # heavy-tailed, like real response lengths
        return np.minimum(rng.lognormal(6.0, 1.0, num).astype(np.int64) + 1, 32768)
    raise ValueError(kind)


KINDS = ("random", "uniform", "bimodal")


def spread(lengths: np.ndarray, groups) -> int:
    sums = [int(lengths[g].sum()) for g in groups]
    return max(sums) - min(sums)


def spread_lower_bound(lengths: np.ndarray, k: int) -> int:
    """No k-way split beats this: integer sums, and the largest item's group against the rest."""
    total, largest = int(lengths.sum()), int(lengths.max())
    return max(int(total % k != 0), largest - (total - largest) // (k - 1))


def best_time(fn, repeats: int) -> float:
    """Best CPU time of `repeats` calls: on a shared machine, wall time mostly measures the neighbours."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def bench_speed(repeats: int) -> None:
    print(f"\n== speed: partitioning (best of {repeats} runs; spread in tokens) ==")
    header = f"{'case':34s} {'ours kk':>9s} {'spread':>7s}"
    if verl_balancing:
        header += f" {'verl kk':>9s} {'spread':>7s} {'speedup':>8s}"
    header += f" {'ours balanced':>14s} {'spread':>7s}"
    print(header)
    for num, k, equal_size in [(16384, 64, True), (4096, 16, False)]:
        for kind in KINDS:
            lengths = make_lengths(kind, num, np.random.default_rng(0))
            values = lengths.tolist()  # both sides get a Python list, as the trainer passes
            ours = karmarkar_karp(values, k, equal_size)
            t_ours = best_time(lambda: karmarkar_karp(values, k, equal_size), repeats)
            t_bal = best_time(lambda: get_seqlen_balanced_partitions(values, k, equal_size), repeats)
            balanced = get_seqlen_balanced_partitions(values, k, equal_size)
            name = f"{kind} {num}->{k} {'equal' if equal_size else 'free'}-size"
            line = f"{name:34s} {t_ours * 1e3:7.2f}ms {spread(lengths, ours):7d}"
            if verl_balancing:
                theirs = verl_balancing.karmarkar_karp(values, k, equal_size)
                verl_repeats = max(2, repeats // 3)  # verl's free-size run takes a third of a second
                t_verl = best_time(lambda: verl_balancing.karmarkar_karp(values, k, equal_size), verl_repeats)
                line += f" {t_verl * 1e3:7.1f}ms {spread(lengths, theirs):7d} {t_verl / t_ours:7.1f}x"
            line += f" {t_bal * 1e3:12.2f}ms {spread(lengths, balanced):7d}"
            print(line)
    if not verl_balancing:
        print("(verl not importable: `pip install --no-deps verl` to compare)")


def bench_quality(seeds: int) -> None:
    print(f"\n== quality: same group count, {seeds} seeds each (spreads in tokens) ==")
    print(
        f"{'case':26s} {'kk mean':>9s} {'kk max':>8s} {'ffd mean':>9s} {'lower bd':>9s} "
        f"{'kk worse':>9s} {'kk better':>9s}"
    )
    for kind in KINDS:
        for num, k in [(16, 4), (64, 8), (256, 8), (1024, 16), (4096, 16)]:
            kk_spreads, ffd_spreads, bounds = [], [], []
            for seed in range(seeds):
                lengths = make_lengths(kind, num, np.random.default_rng(seed))
                capacity = int(lengths.sum())  # never binding: compares balance alone
                kk_spreads.append(spread(lengths, kk_allocate(lengths, capacity, k)))
                ffd_spreads.append(spread(lengths, ffd_allocate(lengths, capacity, k)))
                bounds.append(spread_lower_bound(lengths, k))
            kk_arr, ffd_arr = np.array(kk_spreads), np.array(ffd_spreads)
            worse, better = int((kk_arr > ffd_arr).sum()), int((kk_arr < ffd_arr).sum())
            print(
                f"{kind + f' {num}->{k}':26s} {kk_arr.mean():9.1f} {kk_arr.max():8d} {ffd_arr.mean():9.1f} "
                f"{np.mean(bounds):9.1f} {worse:9d} {better:9d}"
            )


def bench_budget(seeds: int) -> None:
    print("\n== token budget: micro-batches of <= 8192 tokens, 512 sequences per rank ==")
    print(f"{'case':10s} {'algo':4s} {'micro':>6s} {'spread':>8s} {'imbalance':>9s} {'util':>6s}")
    for kind in KINDS:
        for name, allocate in (("kk", kk_allocate), ("ffd", ffd_allocate)):
            counts, spreads, ratios, utils = [], [], [], []
            for seed in range(seeds):
                lengths = make_lengths(kind, 512, np.random.default_rng(seed))
                lengths = np.minimum(lengths, 8192)
                groups = allocate(lengths, 8192, 1)
                metrics = packing_metrics([int(lengths[g].sum()) for g in groups], capacity=8192)
                counts.append(len(groups))
                spreads.append(metrics["spread"])
                ratios.append(metrics["imbalance_ratio"])
                utils.append(metrics["utilization"])
            print(
                f"{kind:10s} {name:4s} {np.mean(counts):6.1f} {np.mean(spreads):8.1f} "
                f"{np.mean(ratios):9.4f} {np.mean(utils):6.3f}"
            )


def main() -> None:
    # kk_allocate warns when it falls back to FFD; a tight budget over many seeds makes that noise.
    logging.getLogger("rlframe.seqpack").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds and repeats")
    args = parser.parse_args()
    repeats, seeds = (5, 10) if args.quick else (15, 50)
    bench_speed(repeats)
    bench_quality(seeds)
    bench_budget(seeds)


if __name__ == "__main__":
    main()
