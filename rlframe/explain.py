"""`rlframe explain`: the batch plan of a config, its keys in effect, and a packing simulation.

Under `trainer.v1.trainer_mode=separate_async` it also shows the two pools, the staleness bound and what the
batches in flight hold (`rlframe.trainer.async_plan`); its warnings are `rlframe train`'s launch warnings.

No Ray and no model weights: it runs `rlframe train`'s launch checks (config, model folder, device,
datasets; `--plan-only` skips those that need files), then prints the plan. The simulation runs the
real code path on made-up or recorded lengths:
the driver's `_balance_batch` (Karmarkar–Karp over DP ranks, weighted by `calculate_workload`),
then on each DP rank the mini-batch cut and the micro-batching of the actor update and of the
old-log-prob forward, with the dynamic micro-batch count taken as the MAX over DP ranks, as the
all_reduce does on a cluster. Everything comes from `rlframe.seqpack`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import textwrap

import numpy as np

from rlframe.batch_plan import BatchPlan, ModelShape
from rlframe.config.key_status import KeyStatus, key_statuses, launch_warnings, override_key
from rlframe.config.keys import ACTOR, LOG_PROB_FIELDS, UPDATE_FIELDS, VALUE_FIELDS, MicroFields
from rlframe.config.secrets import find_secrets
from rlframe.models.vision import is_vision_model
from rlframe.trainer.async_plan import ROLLOUT_TENSORS, AsyncPlan, make_async_plan

LENGTH_FIELDS = ("response_length", "response_lengths", "response_len", "num_response_tokens")
PROMPT_FIELDS = ("prompt_length", "prompt_lengths", "prompt_len", "num_prompt_tokens")
PACKING_SHOWN = ("num_groups", "min", "mean", "max", "imbalance_ratio", "max_over_mean", "utilization")

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


# ───────────────────────────── text ─────────────────────────────


def _micro_lines(p, micro_field: str, token_field: str, per_dp: int, update: bool) -> list[str]:
    if p.use_dynamic_bsz:
        return [
            f"dynamic: {token_field} {p.max_token_len_per_gpu} × sp {p.sequence_parallel_size} = "
            f"{p.max_token_len} tokens per micro-batch; count = ceil(tokens / budget), then "
            f"all_reduce(MAX) over the {p.dp_size} DP ranks; packing {p.packing_algorithm}"
        ]
    if update:
        return [
            f"static: {per_dp} / {micro_field} {p.micro_batch_size} = {p.grad_accum_steps} "
            "gradient-accumulation steps per optimizer step"
        ]
    return [f"static: {per_dp} / {micro_field} {p.micro_batch_size} → {p.num_micro_batches} micro-batches per DP rank"]


def _dispatch_line(p, degree_name: str, degree: int, world: int, sequences: int, group: str) -> str:
    return (
        f"{sequences} sequences / {world} workers = {p.sequences_per_gpu} per worker → × {degree_name} "
        f"{degree} after the {degree_name.upper()} all-gather = {p.sequences_per_dp} per {group}"
    )


def _update_lines(title: str, p, plan: BatchPlan, forward: MicroFields, forward_title: str) -> list[str]:
    """An update (the actor's or critic's, cut by UPDATE_FIELDS) and its forward pass (cut by `forward`)."""
    mini = "ppo_mini_batch_size"
    sp = p.sequence_parallel_size
    lines = [
        f"{title}  sp {sp}, dp = {plan.world_size} / {sp} = {p.dp_size}",
        "  dispatch     " + _dispatch_line(p, "sp", sp, plan.world_size, plan.sequences_per_step, "DP rank"),
        f"  mini-batch   {mini} {p.mini_batch_size} prompts × n {plan.n} = {p.mini_batch_size * plan.n} "
        f"sequences / dp {p.dp_size} = {p.mini_batch_size_per_dp} per DP rank",
        f"  optimizer    train_batch_size {plan.train_batch_size} / {mini} {p.mini_batch_size} = "
        f"{p.num_mini_batches} steps per epoch × ppo_epochs {p.ppo_epochs} = {p.optimizer_steps_per_step} per step",
    ]
    lines += [
        "  micro        " + line
        for line in _micro_lines(
            p, UPDATE_FIELDS.micro, UPDATE_FIELDS.max_token_len, p.mini_batch_size_per_dp, update=True
        )
    ]
    lines += [
        f"  {forward_title:<13}" + line
        for line in _micro_lines(
            p.forward, forward.micro, forward.max_token_len, p.forward.sequences_per_dp, update=False
        )
    ]
    return lines


def format_agents(cfg, plan: BatchPlan) -> str:
    """How the rollout runs its trajectories: agent-loop threads (mode=async) and the tool agent's turns."""
    from rlframe.workers.rollout.multi_turn import uses_tool_agent
    from rlframe.workers.rollout.tools import load_tools

    rollout, r = cfg.actor_rollout_ref.rollout, plan.rollout
    tool_agent = uses_tool_agent(rollout)
    lines = []
    if rollout.mode == "async":
        workers = int(rollout.agent.num_workers)
        lines.append(
            f"mode      async: each of the {r.dp_size} generation groups runs {workers} agent-loop threads over its "
            f"{r.sequences_per_dp} trajectories (≤ {-(-r.sequences_per_dp // workers)} each) against its rollout "
            + ("server (vLLM: continuous batching)" if r.name == "vllm" else f"server ({r.name}: batched requests)")
        )
    else:
        lines.append("mode      sync: the whole batch is generated at once" + (", tool rows turn by turn" * tool_agent))
    if not tool_agent:
        return "\n".join(lines) if rollout.mode == "async" else ""
    mt = rollout.multi_turn
    tools = load_tools(mt.tool_config_path, mt.function_tool_path)
    lines.append(
        f"agent     {rollout.agent.default_agent_loop} for rows without agent_name; tools: "
        + (", ".join(sorted(tools)) or "none configured")
    )
    assistant = "no limit" if mt.max_assistant_turns is None else f"≤ {mt.max_assistant_turns}"
    user = "no limit" if mt.max_user_turns is None else f"≤ {mt.max_user_turns}"
    lines += [
        f"turns     assistant turns {assistant}, tool turns {user}, ≤ {mt.max_parallel_calls} call(s) run per turn, "
        f"tool answers cut to {mt.max_tool_response_length} characters ({mt.tool_response_truncate_side})",
        f"tokens    the {plan.max_response_length} response tokens (data.max_response_length) hold every turn; tool "
        "turns and template tokens are attended to but get response_mask 0: no loss, KL, entropy or advantage",
    ]
    return "\n".join(lines)


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


def _size(nbytes: int) -> str:
    """Bytes in binary units: 2432 → "2.4 KiB"."""
    value, unit = float(nbytes), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{nbytes} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


STALE_STRATEGIES = {
    "drop": "a finished group older than η is never trained (training/off_policy/evicted_samples counts it); "
    "groups that finish out of order can fall behind",
    "regenerate": "a finished group older than η is generated again from its prompt at the current version, so "
    "every prompt is trained once",
    "wait": "a step waits for older generating groups whenever training the oldest finished ones would leave one "
    "past η, so no group is ever evicted",
}
OBJECTIVES = {
    "on_policy": "on-policy: L = 0, so every sample comes from the weights its step starts from (σ = 0), as in sync",
    "decoupled": "decoupled (verl's decoupled mode): the PPO ratio is taken against π_prox (the old-log-prob pass) and "
    "algorithm.rollout_correction corrects for the older weights that generated each sample",
    "bypass": "bypass: algorithm.rollout_correction.bypass_mode=true takes π_old := the rollout's log-probs, so the "
    "ratio is clipped around the stale behaviour policy (coupled, not the decoupled objective)",
    "uncorrected": "uncorrected: PPO around π_prox on samples up to L versions old, with no behaviour correction, "
    "which is biased (see the warning)",
}


def format_pools(ap: AsyncPlan) -> str:
    """separate_async: both pools, the staleness bound η, the lookahead L, and what L holds in memory."""
    v1, rollout = "trainer.v1", "actor_rollout_ref.rollout"
    dtypes: dict[str, list[str]] = {}
    for name, dtype, _, _ in ROLLOUT_TENSORS:
        if name in ap.rollout_tensors:
            dtypes.setdefault(dtype, []).append(name)
    counted = ", ".join(f"{', '.join(names)} ({dtype})" for dtype, names in dtypes.items())
    if ap.weight_parameters is None:
        weights = (
            f"{ap.weight_element_bytes} bytes per parameter ({ACTOR}.fsdp_config.model_dtype={ap.weight_dtype}) per "
            "copy; the model's config.json is not readable here, so its parameters are not counted"
        )
    else:
        weights = (
            f"{ap.weight_parameters:,} parameters × {ap.weight_element_bytes} bytes ({ACTOR}.fsdp_config.model_dtype="
            f"{ap.weight_dtype}) = {_size(ap.weight_push_bytes)} per copy"
        )
    return "\n".join(
        [
            f"training  nnodes {ap.training_nnodes} × n_gpus_per_node {ap.training_n_gpus_per_node} = "
            f"{_count(ap.training_processes, 'process', 'processes')}, each: {', '.join(ap.training_roles)}",
            f"rollout   {rollout}.nnodes {ap.rollout_nnodes} × n_gpus_per_node {ap.rollout_n_gpus_per_node} = "
            f"{_count(ap.rollout_processes, 'process', 'processes')}: {ap.rollout_engine}, tp {ap.rollout_tp}, "
            f"{_count(ap.rollout_replicas, 'replica', 'replicas')} generating with the last weights pushed to them",
            f"bound     η = {v1}.sampler.max_off_policy_threshold {ap.max_off_policy_threshold} − 1 = "
            f"{ap.staleness_bound}: a sample trained in step s comes from weights at most η versions older than "
            "the step's own (version s − 1)",
            f"lookahead L = min({v1}.separate_async.num_warmup_batches {ap.num_warmup_batches}, η "
            f"{ap.staleness_bound}) = {ap.lookahead}: the rollout pool generates up to "
            f"{_count(ap.lookahead, 'batch', 'batches')} ahead of training",
            f"admission a group starts only while finished-but-untrained plus generating groups stay within "
            f"(L + 1) × {ap.train_batch_size} = {ap.in_flight_groups} (AReaL's rule); each generate call takes "
            f"⌈{ap.train_batch_size} / {ap.rollout_replicas}⌉ = {ap.groups_per_call} groups to the replica with "
            "the fewest calls queued",
            f"stale     {v1}.sampler.max_off_policy_strategy={ap.max_off_policy_strategy}: "
            f"{STALE_STRATEGIES[ap.max_off_policy_strategy]}",
            f"partial   {rollout}.partial_rollout={str(ap.partial_rollout).lower()}: "
            + (
                "a push cuts the generations running on older weights; their rows continue from their tokens on "
                "the new weights (a sample's tokens may span versions, the oldest still within η)"
                if ap.partial_rollout
                else "a push waits behind the generations already queued: each chunk is generated by one version"
            ),
            f"in flight ≤ {ap.in_flight_groups} groups = {ap.in_flight_sequences} sequences (sync: "
            f"{ap.sequences_per_batch}), each ≤ {ap.max_prompt_length} + {ap.max_response_length} tokens: the step "
            "training and L batches generated ahead",
            f"memory    ≈ {_size(ap.in_flight_bytes)} of rollout tensors, on the driver or in Ray's object store "
            f"until trained: {ap.in_flight_sequences} × ({ap.bytes_per_prompt_token} × {ap.max_prompt_length} + "
            f"{ap.bytes_per_response_token} × {ap.max_response_length} = {ap.bytes_per_sequence:,} bytes)",
            f"          counted: {counted}. Not counted: what the step adds (log-probs, values, advantages), "
            "the non-tensor fields, the prompts on their way to the rollout pool",
            "weights   each push sends the actor's full state dict from training rank 0 through the driver to the "
            f"rollout pool, in Ray's object store (put once for all rollout processes): {weights}",
            f"objective {OBJECTIVES[ap.objective]}",
        ]
    )


def _attention_line(cfg) -> str:
    """The actor's attention kernel on this machine's packages (packed rows: distributed/attention.py picks it)."""
    from rlframe.config.checks import planned_device
    from rlframe.distributed.attention import varlen_kernel
    from rlframe.workers.fsdp_utils import resolve_dtype

    if not cfg.actor_rollout_ref.model.use_remove_padding:
        return "attention padded rows (use_remove_padding=false): transformers' sdpa"
    device = planned_device(cfg.trainer.device)
    dtype = resolve_dtype(str(cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype), device)
    return f"attention packed rows on {device}, {str(dtype).removeprefix('torch.')}: {varlen_kernel(device, dtype)}"


def _vision_line(model_path: str, cfg) -> list[str]:
    """A vision-language model's line: where the images come from and what they cost in prompt tokens."""
    config_file = os.path.join(model_path or "", "config.json")
    if not os.path.isfile(config_file):
        return []
    with open(config_file) as f:
        config = json.load(f)
    if not is_vision_model(config):
        return []
    return [
        f"images    {config.get('model_type')} vision tower: each prompt's images from column "
        f"data.image_key={cfg.data.image_key!r}; their tokens count in data.max_prompt_length (docs/multimodal.md)"
    ]


def format_plan(plan: BatchPlan) -> str:
    """The flow from data.train_batch_size to one GPU's micro-batch, role by role."""
    r = plan.rollout
    lines = [
        f"cluster   world_size = nnodes {plan.nnodes} × n_gpus_per_node {plan.n_gpus_per_node} = "
        f"{plan.world_size} workers",
        f"step      train_batch_size {plan.train_batch_size} prompts × n {plan.n} = {plan.sequences_per_step} "
        f"sequences, each ≤ {plan.max_prompt_length} + {plan.max_response_length} = {plan.max_sequence_length} tokens",
    ]
    if plan.filter_groups:
        limit = plan.max_num_gen_batches or "no limit"
        lines.append(
            f"sampling  DAPO dynamic sampling: rounds of gen_batch_size {plan.gen_batch_size} prompts × n {plan.n} = "
            f"{plan.sequences_per_gen_batch} sequences until train_batch_size {plan.train_batch_size} prompts have "
            f"groups whose metric varies, then cut to {plan.sequences_per_step} (max_num_gen_batches: {limit})"
        )
    lines += [
        "",
        f"rollout   {r.name}, tp {r.tensor_parallel_size}: {r.dp_size} generation groups"
        + (" (per generation round)" if plan.filter_groups else ""),
        "  dispatch     "
        + _dispatch_line(r, "tp", r.tensor_parallel_size, plan.world_size, plan.sequences_per_gen_batch, "group"),
    ]
    if r.micro_batch_size is not None:
        lines.append(
            f"  generate     micro_batch_size {r.micro_batch_size} → {r.num_generate_calls} generate call(s) per group"
        )
    lines += [
        "",
        f"balance   trainer.balance_batch={str(plan.balance_batch).lower()}: "
        + (
            f"Karmarkar–Karp splits the {plan.sequences_per_step} sequences into {plan.balance_partitions} "
            f"equal-count sets of similar workload, one per actor DP rank"
            if plan.balance_batch
            else "sequences stay in dispatch order"
        ),
        "",
    ]
    lines += _update_lines("actor  ", plan.actor, plan, LOG_PROB_FIELDS, "old log-prob")
    lines.append("")
    if plan.ref is None:
        lines.append("ref       off (no use_kl_loss, no use_kl_in_reward)")
    else:
        ref = plan.ref
        lines += [
            f"ref       sp {ref.sequence_parallel_size}, dp {ref.dp_size}",
            "  dispatch     "
            + _dispatch_line(
                ref, "sp", ref.sequence_parallel_size, plan.world_size, plan.sequences_per_step, "DP rank"
            ),
            *[
                "  log-prob     " + line
                for line in _micro_lines(
                    ref, LOG_PROB_FIELDS.micro, LOG_PROB_FIELDS.max_token_len, ref.sequences_per_dp, update=False
                )
            ],
        ]
    lines.append("")
    if plan.critic is None:
        lines.append("critic    off (only adv_estimator=gae trains a critic)")
    else:
        lines += _update_lines("critic ", plan.critic, plan, VALUE_FIELDS, "values")
    return "\n".join(lines)


def _user_set(key: str, overrides: list[str]) -> bool:
    return any(k and (k == key or k.startswith(key + ".")) for k in map(override_key, overrides))


def format_keys(cfg, rows: list[KeyStatus], overrides: list[str]) -> str:
    """Table of keys: value, whether the user set it, in effect or ignored, and why."""
    from omegaconf import DictConfig, OmegaConf

    table = []
    for row in rows:
        value = OmegaConf.select(cfg, row.key)
        shown = (
            "(section)"
            if isinstance(value, DictConfig)
            else json.dumps(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
        )
        key = row.key + (".*" if isinstance(value, DictConfig) else "")
        table.append(
            (
                key,
                shown,
                "set" if _user_set(row.key, overrides) else "",
                "in effect" if row.in_effect else "IGNORED",
                row.reason,
            )
        )
    head = ("key", "value", "set", "status", "why")
    widths = [max(len(t[i]) for t in table + [head]) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(t[:4], widths)) + "  " + t[4] for t in [head] + table
    ).rstrip()


def _summary(title: str, fn) -> str:
    """`title` and the first paragraph of a registered function's docstring (its formula and source), wrapped."""
    text = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
    return textwrap.fill(f"{title}: {text}", width=110, subsequent_indent=" " * 11)


def format_algorithm(cfg) -> str:
    """The estimator, policy loss, aggregation and KL terms the config trains with, each explained."""
    from rlframe.algorithms.advantage import get_adv_estimator_fn
    from rlframe.algorithms.kl import get_kl_penalty_fn
    from rlframe.algorithms.loss import TOKEN_SELECTORS, get_policy_loss_fn

    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    mode = actor.policy_loss.loss_mode
    lines = [
        _summary(f"advantage  {algo.adv_estimator}", get_adv_estimator_fn(algo.adv_estimator)),
        _summary(f"policy     {mode}", get_policy_loss_fn(mode)),
    ]
    if mode in TOKEN_SELECTORS:
        note = (
            "its tokens are chosen over each whole mini-batch, all DP ranks: one extra forward without "
            "gradients per optimizer step (docs/algorithms.md)"
        )
        lines.append(textwrap.fill(note, width=110, initial_indent=" " * 11, subsequent_indent=" " * 11))
    lines.append(f"aggregate  loss_agg_mode {actor.loss_agg_mode}")
    for on, name, where in (
        (actor.use_kl_loss, actor.kl_loss_type, f"kl loss    coef {actor.kl_loss_coef}, "),
        (algo.use_kl_in_reward, algo.kl_penalty, "kl reward  "),
    ):
        if on:
            lines.append(_summary(f"{where}{name}", get_kl_penalty_fn(name)))
    return "\n".join(lines)


def format_simulation(sim: dict, source: str) -> str:
    """The simulation report: per-rank balance, micro-batch counts and loads, packing metrics."""
    t, b = sim["tokens"], sim["balance"]
    lines = [
        f"lengths   {source}",
        f"          {sim['num_sequences']} sequences, tokens min {t['min']} / mean {t['mean']:.0f} / "
        f"max {t['max']}, total {t['total']}"
        + ("" if sim["hidden_size"] is None else f"; workload weights use hidden_size {sim['hidden_size']}"),
        f"balance   tokens per DP rank over {b['dp_size']} ranks"
        + ("" if b["enabled"] else " (trainer.balance_batch=false: the trainer keeps dispatch order)"),
    ]
    for name, row in (("before (dispatch order)", b["before"]), ("after (Karmarkar–Karp)", b["after"])):
        lines.append(
            f"  {name:<24} {_brief(row['rank_tokens'])}  spread {row['spread']}  max/min {row['max_min_ratio']:.3f}"
        )
    passes = [(f"update mini-batch {j + 1}", p) for j, p in enumerate(sim["actor_update"])]
    passes.append(("old log-prob", sim["old_log_prob"]))
    lines.append("micro     per DP rank: micro-batches (local → after all_reduce MAX), largest micro-batch")
    if len(passes) > 7:  # long runs of mini-batches: the first few, then the forward pass
        passes = passes[:5] + [(f"… {len(passes) - 6} more mini-batches", None)] + passes[-1:]
    for name, p in passes:
        if p is None:
            lines.append(f"  {name}")
            continue
        budget = f" / budget {p['max_token_len']}" if p["max_token_len"] else ""
        over = f", {p['over_budget']} OVER BUDGET" if p["over_budget"] else ""
        lines.append(
            f"  {name:<24} {_brief(p['local_micro_batches'])} → {p['micro_batches']}; largest "
            f"{p['largest_micro_batch_tokens']}{budget} tokens{over}"
        )
        lines.append(
            f"  {'':<24} " + ", ".join(f"{k} {_number(p['packing'][k])}" for k in PACKING_SHOWN if k in p["packing"])
        )
    return "\n".join(lines)


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3f}"


def _brief(values: list, limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"[{shown}{', …' if len(values) > limit else ''}]"


# ───────────────────────────── command ─────────────────────────────


def explain(
    overrides: list[str], lengths: str | None = None, fmt: str = "text", seed: int = 0, plan_only: bool = False
) -> str:
    """The whole report for `rlframe explain`; raises ValueError (the trainer's message) on a bad config.

    It runs the trainer's launch checks, in the same order, so the verdict is `rlframe train`'s.
    `plan_only` skips what needs files (model weights, device, datasets): for planning a run elsewhere.
    """
    from rlframe.trainer.main_ppo import check_config, load_data_and_rewards

    cfg, resolved, model, plan = check_config(overrides, check_files=not plan_only)
    secrets = find_secrets(cfg)  # the report and the data's errors show values and paths: never a secret one
    if not plan_only:
        with secrets.hidden_in_errors():
            load_data_and_rewards(resolved)
    model_path = resolved.actor_rollout_ref.model.path
    rows = key_statuses(cfg)
    warnings = launch_warnings(cfg, overrides)
    pools = make_async_plan(resolved, plan)  # None unless trainer.v1.trainer_mode=separate_async
    sim = source = None
    if lengths is not None:
        seqlens, source = sequence_lengths(lengths, plan, seed)
        sim = simulate(plan, seqlens, None if model is None else model.hidden_size)
    if fmt == "json":
        report = json.dumps(
            {
                "plan": plan.to_dict(),
                "model": None if model is None else {"path": model_path, **_asdict(model)},
                "keys": [
                    {"key": r.key, "in_effect": r.in_effect, "reason": r.reason, "set": _user_set(r.key, overrides)}
                    for r in rows
                ],
                "warnings": warnings,
                "simulation": None if sim is None else {"lengths": source, **sim},
                **({} if pools is None else {"async": pools.to_dict()}),
            },
            indent=2,
        )
        return secrets.scrub(report)
    model_line = (
        f"model     {model_path}: hidden_size {model.hidden_size}, heads {model.num_attention_heads}, "
        f"kv heads {model.num_key_value_heads}"
        if model
        else f"model     {model_path}: no config.json here, head checks skipped"
    )
    parts = [_rule("batch plan"), model_line, _attention_line(resolved), *_vision_line(model_path, cfg)]
    parts.append(format_plan(plan))
    agents = format_agents(cfg, plan)
    if agents:
        parts += [_rule("agent loop"), agents]
    if pools is not None:
        parts += [_rule("pools and staleness"), format_pools(pools)]
    parts += [_rule("algorithm"), format_algorithm(cfg)]
    parts += [_rule("keys"), format_keys(cfg, rows, overrides)]
    if warnings:
        parts += [_rule("warnings"), "\n".join(warnings)]
    if sim is not None:
        parts += [_rule("simulation"), format_simulation(sim, source)]
    return secrets.scrub("\n".join(parts).lstrip("\n"))


def _asdict(model: ModelShape) -> dict:
    from dataclasses import asdict

    return asdict(model)


def _rule(title: str) -> str:
    return f"\n── {title} " + "─" * max(3, 72 - len(title))


def main(argv: list[str] | None = None) -> int:
    """Entry of `rlframe explain KEY=VALUE ... [--lengths uniform|bimodal|FILE] [--format text|json]`."""
    parser = argparse.ArgumentParser(
        prog="rlframe explain",
        description="Print the batch plan of a config: the flow from data.train_batch_size to one GPU's "
        "micro-batch for each role, the keys in effect and ignored, and optionally a simulation "
        "of balancing and micro-batching. Takes the trainer's key=value overrides.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as given to the trainer")
    parser.add_argument(
        "--lengths",
        help="simulate with uniform | bimodal | a parquet/jsonl of response lengths or a run's metrics folder",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths")
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="skip the checks that need files (model weights, device, datasets): plan a run for "
        "another machine from a folder holding only the model's config.json",
    )
    args = parser.parse_intermixed_args(argv)
    try:
        print(explain(args.overrides, args.lengths, args.format, args.seed, args.plan_only))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # Hydra's composition errors (unknown key, bad syntax) carry their own text
        if type(err).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
