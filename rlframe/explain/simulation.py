"""`rlframe explain --lengths`: the lengths of one step, then the balancing and micro-batching they go through.

The lengths are made up (`uniform`, `bimodal`) or read from a file of response lengths or a run's metrics. The
simulation runs the real code path on them: the driver's `_balance_batch` (Karmarkar–Karp over DP ranks,
weighted by `calculate_workload`), then on each DP rank the mini-batch cut and the micro-batching of the actor
update and of the old-log-prob forward, with the dynamic micro-batch count taken as the MAX over DP ranks, as
the all_reduce does on a cluster. Everything comes from `rlframe.seqpack`.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from rlframe.batch_plan import BatchPlan

LENGTH_FIELDS = ("response_length", "response_lengths", "response_len", "num_response_tokens")
PROMPT_FIELDS = ("prompt_length", "prompt_lengths", "prompt_len", "num_prompt_tokens")

# ───────────────────────────── lengths of one step ─────────────────────────────


def _synthetic_prompts(plan: BatchPlan, rng: np.random.Generator) -> np.ndarray:
    """One prompt length per prompt, repeated n times in place (the trainer's repeat(interleave=True))."""
    low = max(1, plan.max_prompt_length // 2)
    return np.repeat(rng.integers(low, plan.max_prompt_length + 1, plan.train_batch_size), plan.n)


def _records(path: str) -> list[dict]:
    """Rows of a parquet or jsonl file (a bare number or list per jsonl line is a response length)."""
    if path.endswith(".parquet"):
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append(row if isinstance(row, dict) else {"response_length": row})
    return rows


def _length_files(spec: str) -> list[str]:
    """The file itself, or every jsonl/parquet file under a folder (a run's folder, say)."""
    if os.path.isfile(spec):
        return [spec]
    return sorted(
        path for ext in ("jsonl", "parquet") for path in glob.glob(os.path.join(spec, "**", f"*.{ext}"), recursive=True)
    )


def _field(rows: list[dict], names: tuple[str, ...]) -> list[int]:
    """All values of the first field of `names` found in `rows` (list-valued fields are flattened)."""
    values: list[int] = []
    for row in rows:
        name = next((n for n in names if n in row and row[n] is not None), None)
        if name is None:
            continue
        value = row[name]
        values.extend(int(v) for v in (value if isinstance(value, (list, tuple, np.ndarray)) else [value]))
    return values


def _from_metrics(rows: list[dict], plan: BatchPlan, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    """Lengths drawn to match the last logged step's response/prompt min, mean, max and clip ratio."""
    stats = [r for r in rows if "response_length/mean" in r]
    if not stats:
        raise ValueError("no per-sequence lengths and no response_length/mean metrics found")
    last = stats[-1]
    count = plan.sequences_per_step
    clipped = rng.random(count) < last.get("response_length/clip_ratio", 0.0)

    def draw(prefix: str, size: int, mean_target: float) -> np.ndarray:
        low, high = last[f"{prefix}/min"], last[f"{prefix}/max"]
        values = rng.uniform(low, high, size)
        if values.size and values.mean() > low:  # stretch around the minimum so that the mean matches
            values = low + (values - low) * (mean_target - low) / (values.mean() - low)
        return np.clip(np.rint(values), max(low, 1), high).astype(np.int64)

    clip_ratio = clipped.mean() if count else 0.0
    free_mean = (last["response_length/mean"] - clip_ratio * last["response_length/max"]) / max(1 - clip_ratio, 1e-9)
    responses = np.where(clipped, int(last["response_length/max"]), draw("response_length", count, free_mean))
    if "prompt_length/mean" in last:
        prompts = np.repeat(draw("prompt_length", plan.train_batch_size, last["prompt_length/mean"]), plan.n)
    else:
        prompts = _synthetic_prompts(plan, rng)
    return prompts, responses, f"drawn to match step {last.get('step', '?')}'s length metrics"


def sequence_lengths(spec: str, plan: BatchPlan, seed: int = 0) -> tuple[np.ndarray, str]:
    """Prompt + response tokens of each sequence of one step, in dispatch order, and where they came from.

    `spec`: `uniform` (responses uniform in [1, max_response_length]), `bimodal` (half short, half
    near the limit, as when some responses hit the cap), or a parquet/jsonl file or folder with a
    `response_length` column (optional `prompt_length`); a run's metrics folder (`metrics.jsonl`
    only) gives lengths drawn to match its last step's length statistics. Recorded lengths use the
    last `sequences_per_step` values, cycled when there are fewer.
    """
    rng = np.random.default_rng(seed)
    count, max_response = plan.sequences_per_step, plan.max_response_length
    if spec == "uniform":
        prompts, responses = _synthetic_prompts(plan, rng), rng.integers(1, max_response + 1, count)
        source = "uniform: responses uniform in [1, max_response_length], prompts in [max/2, max] per group"
    elif spec == "bimodal":
        long = rng.random(count) < 0.5
        short_len = rng.uniform(0.05, 0.3, count) * max_response
        long_len = rng.uniform(0.7, 1.0, count) * max_response
        responses = np.maximum(1, np.rint(np.where(long, long_len, short_len))).astype(np.int64)
        prompts = _synthetic_prompts(plan, rng)
        source = "bimodal: half the responses 5-30% of max_response_length, half 70-100%"
    elif os.path.exists(spec):
        rows = [row for path in _length_files(spec) for row in _records(path)]
        recorded = _field(rows, LENGTH_FIELDS)
        if recorded:
            responses = np.resize(np.asarray(recorded[-count:], dtype=np.int64), count)
            recorded_prompts = _field(rows, PROMPT_FIELDS)
            prompts = (
                np.resize(np.asarray(recorded_prompts[-count:], dtype=np.int64), count)
                if len(recorded_prompts) == len(recorded)
                else _synthetic_prompts(plan, rng)
            )
            source = f"{spec}: last {min(count, len(recorded))} of {len(recorded)} recorded response lengths"
        else:
            try:
                prompts, responses, how = _from_metrics(rows, plan, rng)
            except ValueError as err:
                raise ValueError(
                    f"--lengths {spec}: {err}; expected a field named one of "
                    f"{', '.join(LENGTH_FIELDS)} (optionally one of {', '.join(PROMPT_FIELDS)})"
                ) from None
            source = f"{spec}: {how}"
    else:
        raise ValueError(f"--lengths {spec!r}: use uniform, bimodal, or a parquet/jsonl file or folder that exists")
    responses = np.clip(responses, 0, max_response)
    prompts = np.clip(prompts, 1, plan.max_prompt_length)
    return (prompts + responses).astype(np.int64), source


# ───────────────────────────── simulation ─────────────────────────────


def balance_ranks(seqlens, num_ranks: int, hidden_size: int | None = None, balance: bool = True) -> list[list[int]]:
    """Each DP rank's sequence indices: Karmarkar–Karp on workloads (balance) or dispatch order."""
    from rlframe.seqpack import balance_dp_partitions

    if not balance:
        per_rank = len(seqlens) // num_ranks
        return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(num_ranks)]
    return balance_dp_partitions(seqlens, num_ranks, **({} if hidden_size is None else {"hidden_size": hidden_size}))


def static_micro_batches(seqlens, micro_batch_size: int) -> list[list[int]]:
    """Index groups of the static path: consecutive runs of `micro_batch_size` sequences."""
    return [list(range(i, min(i + micro_batch_size, len(seqlens)))) for i in range(0, len(seqlens), micro_batch_size)]


def _mask_batch(seqlens):
    """A TensorDict whose attention_mask has the given lengths (left-padded), as the worker sees it."""
    import torch
    from tensordict import TensorDict

    lengths = torch.as_tensor(np.asarray(seqlens, dtype=np.int64))
    width = int(lengths.max()) if len(lengths) else 0
    mask = torch.arange(width).expand(len(lengths), width) >= (width - lengths)[:, None]
    return TensorDict({"attention_mask": mask.to(torch.int64)}, batch_size=[len(lengths)])


def dynamic_micro_batches(
    rank_seqlens: list, max_token_len: int, packing_algorithm: str = "kk"
) -> tuple[list[int], list[list[list[int]]]]:
    """Each rank's micro-batch count before the all_reduce(MAX), and its index groups after it."""
    from rlframe.seqpack import rearrange_micro_batches

    def groups(seqlens, min_num=None):
        _, index_lists = rearrange_micro_batches(
            _mask_batch(seqlens),
            max_token_len=max_token_len,
            min_num_micro_batch=min_num,
            packing_algorithm=packing_algorithm,
        )
        return [list(map(int, g)) for g in index_lists]

    local_counts = [len(groups(seqlens)) for seqlens in rank_seqlens]
    agreed = max(local_counts)  # what all_reduce(MAX) over the DP group hands every rank
    while True:  # as on a cluster: repeat while a capacity fallback opens extra groups on some rank
        per_rank = [groups(seqlens, agreed) for seqlens in rank_seqlens]
        most = max(len(g) for g in per_rank)
        if most == agreed:
            return local_counts, per_rank
        agreed = most


def _spread(totals: list[int]) -> dict:
    low, high = min(totals), max(totals)
    return {"rank_tokens": totals, "spread": high - low, "max_min_ratio": high / low if low else float("inf")}


def _simulate_pass(
    rank_seqlens: list[list[int]],
    use_dynamic_bsz: bool,
    micro_batch_size: int | None,
    max_token_len: int | None,
    packing_algorithm: str | None,
) -> dict:
    """Micro-batch one chunk per DP rank the way the worker does; loads, counts and packing metrics."""
    from rlframe.seqpack import packing_metrics

    if use_dynamic_bsz:
        local_counts, groups = dynamic_micro_batches(rank_seqlens, max_token_len, packing_algorithm or "kk")
    else:
        groups = [static_micro_batches(seqlens, micro_batch_size) for seqlens in rank_seqlens]
        local_counts = [len(g) for g in groups]
    loads = [
        [int(sum(seqlens[i] for i in group)) for group in rank_groups]
        for seqlens, rank_groups in zip(rank_seqlens, groups)
    ]
    flat = [load for rank_loads in loads for load in rank_loads]
    return {
        "local_micro_batches": local_counts,
        "micro_batches": len(groups[0]),
        "micro_batch_tokens": loads,
        "largest_micro_batch_tokens": max(flat),
        "max_token_len": max_token_len,
        "over_budget": sum(load > max_token_len for load in flat) if max_token_len else 0,
        "packing": {k: float(v) for k, v in packing_metrics(flat, capacity=max_token_len).items()},
    }


def simulate(plan: BatchPlan, seqlens, hidden_size: int | None = None) -> dict:
    """Balance one step over the actor's DP ranks, then micro-batch each rank's update and log-prob pass."""
    seqlens = [int(s) for s in seqlens]
    dp, actor = plan.actor.dp_size, plan.actor
    dispatch = balance_ranks(seqlens, dp, balance=False)
    balanced = balance_ranks(seqlens, dp, hidden_size, balance=True)
    ranks = balanced if plan.balance_batch else dispatch
    rank_seqlens = [[seqlens[i] for i in indices] for indices in ranks]
    mini = actor.mini_batch_size_per_dp
    update = []
    for j in range(actor.num_mini_batches):
        chunk = [lens[j * mini : (j + 1) * mini] for lens in rank_seqlens]
        update.append(
            _simulate_pass(
                chunk, actor.use_dynamic_bsz, actor.micro_batch_size, actor.max_token_len, actor.packing_algorithm
            )
        )
    fwd = actor.forward
    return {
        "num_sequences": len(seqlens),
        "tokens": {"min": min(seqlens), "mean": float(np.mean(seqlens)), "max": max(seqlens), "total": sum(seqlens)},
        "hidden_size": hidden_size,
        "balance": {
            "enabled": plan.balance_batch,
            "dp_size": dp,
            "before": _spread([sum(seqlens[i] for i in r) for r in dispatch]),
            "after": _spread([sum(seqlens[i] for i in r) for r in balanced]),
        },
        "actor_update": update,
        "old_log_prob": _simulate_pass(
            rank_seqlens, fwd.use_dynamic_bsz, fwd.micro_batch_size, fwd.max_token_len, fwd.packing_algorithm
        ),
    }
