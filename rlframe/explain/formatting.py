"""`rlframe explain`'s text: the plan, the agent loop, the pools, the algorithm, the keys and the simulation."""

from __future__ import annotations

import json
import os
import textwrap

from rlframe.batch_plan import BatchPlan
from rlframe.config.key_status import KeyStatus, override_key
from rlframe.config.keys import ACTOR, LOG_PROB_FIELDS, UPDATE_FIELDS, VALUE_FIELDS, MicroFields
from rlframe.distributed.parallel_dims import ParallelPlan
from rlframe.models.vision import is_vision_model
from rlframe.trainer.async_plan import ROLLOUT_TENSORS, AsyncPlan
from rlframe.workers.config.distillation import routes_rows, teachers_of

PACKING_SHOWN = ("num_groups", "min", "mean", "max", "imbalance_ratio", "max_over_mean", "utilization")


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


def _groups_line(name: str, p: ParallelPlan, rollout: bool = False) -> str:
    """One worker group's process groups, as `ParallelDims.build` makes them from the plan."""
    shards = f"FSDP over {p.fsdp_size} ranks" + (
        f", {p.world_size // p.fsdp_size} replicas (HSDP)" if p.fsdp_size < p.world_size else ""
    )
    parts = [f"dp {p.dp_size} × sp {p.sp_size}", shards]
    if rollout:
        pools = ", on CPU generation may pool on rank 0" if p.pools_generation else ""
        parts.append(f"rollout tp {p.tp_size}{pools}")
    return f"  {name:<19} " + "; ".join(parts)


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
    from rlframe.workers.rollout.config import uses_tool_agent
    from rlframe.workers.rollout.registry import engine_for
    from rlframe.workers.rollout.tools import load_tools

    rollout, r = cfg.actor_rollout_ref.rollout, plan.rollout
    tool_agent = uses_tool_agent(rollout)
    lines = []
    if rollout.mode == "async":
        workers = int(rollout.agent.num_workers)
        lines.append(
            f"mode      async: each of the {r.dp_size} generation groups runs {workers} agent-loop threads over its "
            f"{r.sequences_per_dp} trajectories (≤ {-(-r.sequences_per_dp // workers)} each) against its rollout "
            + (
                "server (vLLM: continuous batching)"
                if engine_for(r.name, rollout.mode).capabilities.continuous_batching
                else f"server ({r.name}: batched requests)"
            )
        )
    else:
        lines.append("mode      sync: the whole batch is generated at once" + (", tool rows turn by turn" * tool_agent))
    if rollout.agent.default_agent_loop == "openai_agent":
        lines += _openai_agent_lines(rollout.agent.openai_agent, plan)
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


def _openai_agent_lines(agent, plan: BatchPlan) -> list[str]:
    """The user's agent behind the OpenAI endpoint (docs/agents.md)."""

    def limit(value, unit: str) -> str:
        return f"≤ {value:g} {unit}" if value else f"no {unit} limit"

    return [
        f"agent     openai_agent: `await {agent.name}(base_url, sample)` from {agent.path} per row, each against its "
        f"own session of the replica's OpenAI endpoint on {agent.host}",
        f"budgets   per episode {limit(agent.timeout_s, 's')}, {limit(agent.max_requests, 'requests')}, "
        f"{limit(agent.max_generated_tokens, 'generated tokens')}; a trajectory's first prompt ≤ "
        f"{plan.max_prompt_length} tokens, the rest ≤ {plan.max_response_length} (response_mask 1 on sampled tokens)",
    ]


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


PUSHED = {  # AsyncPlan.weight_form
    "full": "the actor's full state dict",
    "lora_merged": "the LoRA actor's merged weights (the base model's state dict)",
    "lora_adapter": "the LoRA adapter alone (not counted here; the base model's state dict, counted, only at the "
    "first push when the engine starts from load_format=dummy)",
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


def _weights(ap: AsyncPlan) -> str:
    """How each step's weights reach the engines that generate, and what a copy weighs."""
    if ap.mode == "colocate_async":
        return (
            "after each step every training process syncs its actor's weights into its own engine in place (the "
            "sync mode's hybrid sync): nothing goes through the driver"
        )
    if ap.weight_parameters is None:
        size = (
            f"{ap.weight_element_bytes} bytes per parameter ({ACTOR}.fsdp_config.model_dtype={ap.weight_dtype}) per "
            "copy; the model's config.json is not readable here, so its parameters are not counted"
        )
    else:
        size = (
            f"{ap.weight_parameters:,} parameters × {ap.weight_element_bytes} bytes ({ACTOR}.fsdp_config.model_dtype="
            f"{ap.weight_dtype}) = {_size(ap.weight_push_bytes)} per copy"
        )
    engine = "actor_rollout_ref.rollout.checkpoint_engine"
    if ap.push_backend != "naive":
        return (
            f"each push sends {PUSHED[ap.weight_form]} from training rank 0 to every rollout process over a process "
            f"group of their own ({engine}.backend={ap.push_backend}), in buckets of "
            f"{ap.push_bucket_megabytes} MB ({engine}.update_weights_bucket_megabytes); the broadcast runs behind the "
            f"next step: {size}"
        )
    return (
        f"each push sends {PUSHED[ap.weight_form]} from training rank 0 through the driver to the rollout "
        f"pool, in Ray's object store ({engine}.backend=naive: put once for all rollout processes): {size}"
    )


def _generation(ap: AsyncPlan) -> tuple[str, str, str]:
    """(where generation runs, who generates ahead, when running generation is cut)."""
    rollout = "actor_rollout_ref.rollout"
    if ap.mode == "colocate_async":
        where = (
            f"rollout   trainer.v1.trainer_mode=colocate_async: the training processes' own engines "
            f"({ap.rollout_engine}, tp {ap.rollout_tp}) as one replica, each generate call split over the "
            f"{_count(ap.training_processes, 'process', 'processes')}; generation and training take turns"
        )
        cut = (
            "cut       always (verl's colocate_async): once a step's batch is sampled, what generates ahead stops at "
            "its next decoding step; the step trains; the engines take the new weights and the cut rows continue "
            "from their tokens on them (a sample's tokens may span versions, the oldest still within η)"
        )
        return where, "the training processes' engines generate", cut
    where = (
        f"rollout   {rollout}.nnodes {ap.rollout_nnodes} × n_gpus_per_node {ap.rollout_n_gpus_per_node} = "
        f"{_count(ap.rollout_processes, 'process', 'processes')}: {ap.rollout_engine}, tp {ap.rollout_tp}, "
        f"{_count(ap.rollout_replicas, 'replica', 'replicas')} generating with the last weights pushed to them"
    )
    cut = f"partial   {rollout}.partial_rollout={str(ap.partial_rollout).lower()}: " + (
        "a push cuts the generations running on older weights; their rows continue from their tokens on "
        "the new weights (a sample's tokens may span versions, the oldest still within η)"
        if ap.partial_rollout
        else "a push waits behind the generations already queued: each chunk is generated by one version"
    )
    return where, "the rollout pool generates", cut


def format_pools(ap: AsyncPlan) -> str:
    """The async modes: where generation runs, the staleness bound η, the lookahead L, when generation is cut, and
    what L holds in memory."""
    v1 = "trainer.v1"
    dtypes: dict[str, list[str]] = {}
    for name, dtype, _, _ in ROLLOUT_TENSORS:
        if name in ap.rollout_tensors:
            dtypes.setdefault(dtype, []).append(name)
    counted = ", ".join(f"{', '.join(names)} ({dtype})" for dtype, names in dtypes.items())
    where, generates, cut = _generation(ap)
    training = (
        f"training  nnodes {ap.training_nnodes} × n_gpus_per_node {ap.training_n_gpus_per_node} = "
        f"{_count(ap.training_processes, 'process', 'processes')}, each: {', '.join(ap.training_roles)}"
    )
    return "\n".join(
        [
            training,
            where,
            f"bound     η = {v1}.sampler.max_off_policy_threshold {ap.max_off_policy_threshold} − 1 = "
            f"{ap.staleness_bound}: a sample trained in step s comes from weights at most η versions older than "
            "the step's own (version s − 1)",
            f"lookahead L = min({v1}.{ap.mode}.num_warmup_batches {ap.num_warmup_batches}, η "
            f"{ap.staleness_bound}) = {ap.lookahead}: {generates} up to "
            f"{_count(ap.lookahead, 'batch', 'batches')} ahead of training",
            f"admission a group starts only while finished-but-untrained plus generating groups stay within "
            f"(L + 1) × {ap.train_batch_size} = {ap.in_flight_groups} (AReaL's rule); each generate call takes "
            f"⌈{ap.train_batch_size} / {ap.rollout_replicas}⌉ = {ap.groups_per_call} groups to the replica with "
            "the fewest calls queued",
            f"stale     {v1}.sampler.max_off_policy_strategy={ap.max_off_policy_strategy}: "
            f"{STALE_STRATEGIES[ap.max_off_policy_strategy]}",
            cut,
            f"in flight ≤ {ap.in_flight_groups} groups = {ap.in_flight_sequences} sequences (sync: "
            f"{ap.sequences_per_batch}), each ≤ {ap.max_prompt_length} + {ap.max_response_length} tokens: the step "
            "training and L batches generated ahead",
            f"memory    ≈ {_size(ap.in_flight_bytes)} of rollout tensors, on the driver or in Ray's object store "
            f"until trained: {ap.in_flight_sequences} × ({ap.bytes_per_prompt_token} × {ap.max_prompt_length} + "
            f"{ap.bytes_per_response_token} × {ap.max_response_length} = {ap.bytes_per_sequence:,} bytes)",
            f"          counted: {counted}. Not counted: what the step adds (log-probs, values, advantages), "
            "the non-tensor fields, the prompts on their way to the rollout pool",
            f"weights   {_weights(ap)}",
            f"objective {OBJECTIVES[ap.objective]}",
        ]
    )


def attention_line(cfg) -> str:
    """The actor's attention kernel on this machine's packages (packed rows: distributed/attention.py picks it)."""
    from rlframe.config.checks import planned_device
    from rlframe.distributed.attention import varlen_kernel
    from rlframe.workers.dtypes import resolve_dtype

    if not cfg.actor_rollout_ref.model.use_remove_padding:
        return "attention padded rows (use_remove_padding=false): transformers' sdpa"
    device = planned_device(cfg.trainer.device)
    dtype = resolve_dtype(str(cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype), device)
    return f"attention packed rows on {device}, {str(dtype).removeprefix('torch.')}: {varlen_kernel(device, dtype)}"


def vision_lines(model_path: str, cfg) -> list[str]:
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
    lines.append("groups    the process groups of each worker group (ParallelDims.build)")
    lines.append(_groups_line("actor, rollout, ref", plan.actor_parallel, rollout=True))
    for name, parallel in (("critic", plan.critic_parallel), ("reward model", plan.reward_model_parallel)):
        if parallel is not None:
            lines.append(_groups_line(name, parallel))
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


def user_set(key: str, overrides: list[str]) -> bool:
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
                "set" if user_set(row.key, overrides) else "",
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
    if cfg.distillation.enabled:
        lines.append(_distillation_line(cfg.distillation))
    return "\n".join(lines)


def _distillation_line(distillation) -> str:
    """What the actor's distillation term is, from whom, and how it joins the task loss (docs/distillation.md)."""
    loss = distillation.distillation_loss
    mode = f"{loss.loss_mode} (top {loss.topk})" if loss.loss_mode == "forward_kl_topk" else loss.loss_mode
    how = "as a policy-gradient reward" if loss.use_policy_gradient else "back-propagated"
    joined = f"added × {loss.distillation_loss_coef} to the task loss" if loss.use_task_rewards else "alone"
    teachers = teachers_of(distillation)
    if routes_rows(distillation):
        routed = ", ".join(f"{t.key} → {t.model_path}" for t in teachers.values())
        source = f"the teachers by {distillation.teacher_key} ({routed})"
    else:
        source = f"the teacher {next(iter(teachers.values())).model_path}"
    return f"distill    {mode} to {source} at T = 1, {how}, {joined}"


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
