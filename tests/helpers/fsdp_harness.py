"""Run the actor/critic on N gloo processes with FSDP and compare against a single-process reference.

Each scenario: the same fixed RL batch, one mini-batch, no clipping; the optimizer records the full
(unsharded) accumulated gradient right before its step. Gradients are compared directly rather
than as parameter deltas: a delta `(p - lr·g) - p` loses the low bits of `g` whenever |p| >> |lr·g|
(norm weights sit at 1.0), which would put a rounding floor above the 1e-5 we want to check.
Rank 0 returns the gradients, every rank the outputs of its DP shard; the test reassembles them. The ranks are a
session's `spawned_world` (tests/helpers/world.py), spawned once per world size.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

from helpers.world import spawned_world
from rlframe.algorithms.config import RolloutCorrection, RolloutCorrectionConfig
from rlframe.algorithms.distillation import DistillationLoss
from rlframe.algorithms.update_mode import ActorUpdate, UpdateMode
from rlframe.batch_plan import ForwardPlan, UpdatePlan
from rlframe.distributed.parallel_dims import ParallelDims, ParallelPlan
from rlframe.protocol import DataProto
from rlframe.workers.actor import PPOActor
from rlframe.workers.config.actor import ActorConfig, PolicyLossConfig
from rlframe.workers.config.critic import CriticConfig, CriticOptimConfig
from rlframe.workers.config.model import OptimConfig
from rlframe.workers.critic import PPOCritic
from rlframe.workers.fsdp_wrap import FSDPSpec, decoder_layers, wrap_fsdp
from rlframe.workers.lora import LoraSpec, adapter_disabled, apply_lora
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.updater import ModelOptions, RoleModel

PROMPT_LEN, RESPONSE_LEN = 8, 8
# policy-loss parameters under which every mode acts on this batch (clip_cov / kl_cov pick ~20% of tokens)
POLICY_LOSS_PARAMS = {
    "clip_cov_ratio": 0.2,
    "clip_cov_lb": 0.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.2,
    "ppo_kl_coef": 0.5,
    "dro_beta": 0.3,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
}


def assert_forward_prefetch(model, strategy: str) -> None:
    """The wrapped model really prefetches: FSDP1's flag, or every FSDP2 layer but the last naming the next."""
    if strategy == "fsdp":
        assert model.forward_prefetch
        return
    layers = decoder_layers(model)
    for layer, following in zip(layers, layers[1:]):
        assert layer._get_fsdp_state()._states_to_forward_prefetch == [following._get_fsdp_state()]


@dataclass(frozen=True)
class Scenario:
    world: int = 1
    sp: int = 1
    strategy: str = "fsdp2"  # fsdp2 | fsdp | none (plain module, single process)
    use_remove_padding: bool = True
    use_dynamic_bsz: bool = False
    micro_batch_size: int = 2
    max_token_len: int = 64  # per GPU, before × sp
    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"  # actor.policy_loss.loss_mode (parameters: POLICY_LOSS_PARAMS)
    role: str = "actor"
    mini_batch_size: int | None = None  # sequences per optimizer step, global; None = whole batch
    param_offload: bool = False
    fsdp_size: int = -1  # -1: shard over all ranks; else hybrid sharding (HSDP)
    gradient_checkpointing: bool = False
    forward_prefetch: bool = False  # fsdp_config.forward_prefetch: overlaps gathers, must not change a number
    reshard_after_forward: bool = True  # fsdp_config.reshard_after_forward: False keeps gathers, same numbers
    dtype: torch.dtype = torch.float32  # parameters and compute; float64 tells rounding from math (docs/models.md)
    lora_adapter: str | None = None  # a PEFT adapter folder: train it on the frozen model (lora_adapter_path)
    freeze_vision_tower: bool = False  # actor.freeze_vision_tower: a vision-language model's tower does not train
    update_mode: str = "decoupled"  # the actor's UpdateMode: decoupled | bypass | on_policy
    correction: dict = field(default_factory=dict)  # algorithm.rollout_correction keys over their defaults
    distillation: dict = field(default_factory=dict)  # DistillationLoss fields over its defaults; {}: no teacher term
    extra: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.world // self.sp


def make_batch(
    vocab_size: int,
    num_seqs: int = 8,
    seed: int = 0,
    skew: bool = False,
    dtype: torch.dtype = torch.float32,
    holes: bool = False,
) -> DataProto:
    """Left-padded prompts + right-padded responses of random lengths, with PPO inputs.

    `holes`: multi-turn trajectories: a `response_mask` that leaves out a tool turn (a span inside each
    response of 4 or more tokens, attended to but not trained), as the tool agent lays them out.
    """
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (num_seqs,), generator=gen)
    response_lens = torch.randint(1, RESPONSE_LEN + 1, (num_seqs,), generator=gen)
    if skew:  # first half all short, second half all long: DP ranks get very different loads
        half = num_seqs // 2
        prompt_lens[:half], response_lens[:half] = 2, 1
        prompt_lens[half:], response_lens[half:] = PROMPT_LEN, RESPONSE_LEN
    ids = torch.randint(3, vocab_size, (num_seqs, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    mask = torch.zeros_like(ids)
    for i in range(num_seqs):
        mask[i, PROMPT_LEN - prompt_lens[i] : PROMPT_LEN + response_lens[i]] = 1
    ids = ids * mask  # pad id 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    responses = ids[:, PROMPT_LEN:]
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "responses": responses,
        "old_log_probs": -5.0 + 0.3 * torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
        "ref_log_prob": -5.0 + 0.3 * torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
        "advantages": torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
        "values": torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
        "returns": torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
    }
    if holes:
        response_mask = mask[:, PROMPT_LEN:].clone()
        for i in range(num_seqs):
            if response_lens[i] >= 4:
                response_mask[i, 1 : 1 + int(response_lens[i]) // 2] = 0  # the tool turn after the first token
        tensors["response_mask"] = response_mask
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return DataProto.from_dict(tensors)


def update_plan(sc: Scenario, num_seqs: int, ppo_epochs: int = 1) -> UpdatePlan:
    """The batch plan of a scenario's role: one DP rank's mini-batches and micro-batches (forward cut alike)."""
    mini_global = sc.mini_batch_size or num_seqs
    mini_per_dp, per_dp = mini_global // sc.dp, num_seqs // sc.dp
    micro = None if sc.use_dynamic_bsz else sc.micro_batch_size
    budget = sc.max_token_len * sc.sp if sc.use_dynamic_bsz else None
    cut = {
        "sequence_parallel_size": sc.sp,
        "dp_size": sc.dp,
        "sequences_per_gpu": num_seqs // sc.world,
        "sequences_per_dp": per_dp,
        "use_dynamic_bsz": sc.use_dynamic_bsz,
        "micro_batch_size": micro,
        "max_token_len_per_gpu": None if budget is None else sc.max_token_len,
        "max_token_len": budget,
        "packing_algorithm": "kk" if sc.use_dynamic_bsz else None,
        "max_token_len_key": f"{sc.role}.ppo_max_token_len_per_gpu" if sc.use_dynamic_bsz else None,
    }
    forward = ForwardPlan(**cut, num_micro_batches=None if micro is None else -(-per_dp // micro))
    return UpdatePlan(
        **cut,
        mini_batch_size=mini_global,
        mini_batch_size_per_dp=mini_per_dp,
        num_mini_batches=num_seqs // mini_global,
        ppo_epochs=ppo_epochs,
        optimizer_steps_per_step=num_seqs // mini_global * ppo_epochs,
        grad_accum_steps=None if micro is None else mini_per_dp // micro,
        forward=forward,
    )


def role_for(sc: Scenario, num_seqs: int) -> tuple:
    """(typed config section, update plan, model options) of the scenario's role; `sc.extra` overrides any."""
    extra = dict(sc.extra)
    plan = update_plan(sc, num_seqs, extra.pop("ppo_epochs", 1))
    option_names = {f.name for f in fields(ModelOptions)}
    options = ModelOptions(
        use_remove_padding=sc.use_remove_padding,
        reshard_after_forward=sc.reshard_after_forward,
        **{k: extra.pop(k) for k in list(extra) if k in option_names},
    )
    if sc.role == "critic":
        config = CriticConfig(
            shuffle=False, cliprange_value=0.5, loss_agg_mode=sc.loss_agg_mode, optim=CriticOptimConfig(clip_grad=1e9)
        )
        return replace(config, **extra), plan, options
    losses = {k: v for k, v in POLICY_LOSS_PARAMS.items() if k not in ("tau_pos", "tau_neg")}
    config = ActorConfig(
        shuffle=False,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        tau_pos=POLICY_LOSS_PARAMS["tau_pos"],
        tau_neg=POLICY_LOSS_PARAMS["tau_neg"],
        loss_agg_mode=sc.loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=sc.loss_mode, **losses),
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        optim=OptimConfig(clip_grad=1e9),
    )
    return replace(config, **extra), plan, options


def actor_update(sc: Scenario) -> ActorUpdate:
    """The actor's update of a scenario: its mode, its rollout correction parsed, its distillation term; T = 1."""
    correction = RolloutCorrection.parse(RolloutCorrectionConfig(**sc.correction))
    distillation = DistillationLoss(**sc.distillation) if sc.distillation else None
    return ActorUpdate(UpdateMode(sc.update_mode), correction, distillation=distillation)


def make_role(sc: Scenario, num_seqs: int, module, optimizer=None, dims=None):
    """The scenario's PPOActor or PPOCritic around `module` (dims: the DP/SP groups; None = one process)."""
    config, plan, options = role_for(sc, num_seqs)
    if sc.role == "critic":
        return PPOCritic(RoleModel(module, options, optimizer), config, plan, dims)
    return PPOActor(RoleModel(module, options, optimizer), config, plan, dims, update=actor_update(sc))


def single_dims(sc: Scenario, dp_group=None, sp_group=None) -> ParallelDims:
    """The ParallelDims of a scenario's rank from its groups."""
    return ParallelDims(dp_size=sc.dp, sp_size=sc.sp, dp_group=dp_group, sp_group=sp_group)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a full copy of the gradient it is about to apply (a collective under FSDP); `keep=False` takes
    part in the collective and keeps nothing (the ranks whose copy nobody reads: a model's worth of memory each)."""

    def __init__(self, model, lr: float = 1.0, keep: bool = True):
        super().__init__(model.parameters(), lr=lr)
        self.model, self.keep = model, keep
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, closure=None):
        self.grads = full_grads(self.model, self.keep)
        return super().step(closure)


def full_grads(model, keep: bool = True) -> dict[str, torch.Tensor]:
    """{name: the full gradient}, one parameter gathered at a time; {} where `keep` is False."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, with_grads=True, writeback=False):
            named = [(n, p.grad) for n, p in model.named_parameters()]
            return {_plain(n): g.detach().to("cpu", copy=True) for n, g in named if g is not None and keep}
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        if keep:
            grads[_plain(name)] = grad.detach().to("cpu", copy=True)
    return grads


def _plain(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def run_scenario(
    sc: Scenario, model_path: str, data: DataProto, dp_rank: int = 0, dp_group=None, sp_group=None, mesh=None
) -> dict:
    """One rank's part of a scenario: outputs of its DP shard, metrics and the full gradient."""
    spec = ModelSpec(
        path=model_path,
        role=sc.role,
        dtype=sc.dtype,
        use_remove_padding=sc.use_remove_padding,
        gradient_checkpointing=sc.gradient_checkpointing,
        freeze_vision_tower=sc.freeze_vision_tower,
    )
    torch.manual_seed(0)  # the critic's fresh value head must start equal everywhere
    model = load_hf_model(spec)
    if sc.lora_adapter is not None:
        model = apply_lora(model, LoraSpec(1, 1, "all-linear", None, adapter_path=sc.lora_adapter))
    if sc.strategy != "none":
        spec = FSDPSpec(
            sc.strategy, sc.dtype, sc.dtype, sc.param_offload, sc.reshard_after_forward, sc.forward_prefetch
        )
        model = wrap_fsdp(model, spec, mesh, "cpu")
        if sc.forward_prefetch:
            assert_forward_prefetch(model, sc.strategy)
    optimizer = RecordingSGD(model, keep=not dist.is_initialized() or dist.get_rank() == 0)
    shard = data.chunk(sc.dp)[dp_rank]
    role = make_role(sc, len(data), model, optimizer, single_dims(sc, dp_group, sp_group))
    if sc.role == "critic":
        critic = role
        outputs = {"values": critic.compute_values(shard)}
        metrics = critic.update_critic(shard)
    else:
        actor = role
        log_probs, entropy = actor.compute_log_prob(shard, calculate_entropy=True)
        outputs = {"log_probs": log_probs, "entropy": entropy}
        if sc.lora_adapter is not None:  # the reference policy: the base model, adapter disabled
            with adapter_disabled(model):
                outputs["ref_log_probs"] = actor.compute_log_prob(shard)[0]
        with counting_all_gathers() as gathers:
            metrics, _ = actor.update_policy(shard)
    result = {"outputs": outputs, "metrics": metrics, "grads": optimizer.grads}
    return result if sc.role == "critic" else {**result, "update_all_gathers": gathers[0]}


@contextlib.contextmanager
def counting_all_gathers():
    """Counts the all-gathers FSDP2 issues for its parameters while inside: through gloo
    (`dist.all_gather_single`) or, on one machine's CPU ranks, through shared memory."""
    import torch.distributed as dist

    from rlframe.distributed.shm_gather import SharedMemoryAllGather

    count, original, shared = [0], dist.all_gather_single, SharedMemoryAllGather.__call__

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    def counted_shared(*args, **kwargs):
        count[0] += 1
        return shared(*args, **kwargs)

    dist.all_gather_single, SharedMemoryAllGather.__call__ = counted, counted_shared
    try:
        yield count
    finally:
        dist.all_gather_single, SharedMemoryAllGather.__call__ = original, shared


def scenario_dims(sc: Scenario) -> ParallelDims:
    """The process groups of `sc` over this process's world (a `spawned_world(sc.world)` rank), built as a worker
    builds them: `ParallelDims.build` from the scenario's layout."""
    return ParallelDims.build(ParallelPlan(sc.world, sc.sp, sc.fsdp_size), "cpu")


def _rank_scenario(rank: int, sc: Scenario, model_path: str, data_path: str) -> dict:
    dims = scenario_dims(sc)
    data = DataProto.load_from_disk(data_path)
    result = run_scenario(sc, model_path, data, dims.dp_rank, dims.dp_group, dims.sp_group, dims.fsdp_mesh)
    result["dp_rank"], result["sp_rank"] = dims.dp_rank, dims.sp_rank
    return result


def run_distributed(sc: Scenario, model_path: str, data: DataProto, out_dir: str) -> dict:
    """Spawn `sc.world` gloo processes; return outputs re-assembled in the input order, metrics, grads."""
    data_path = os.path.join(out_dir, "data.pkl")
    data.save_to_disk(data_path)
    results = spawned_world(sc.world).run(_rank_scenario, sc, model_path, data_path)
    collectors = sorted((r for r in results if r["sp_rank"] == 0), key=lambda r: r["dp_rank"])
    outputs = {k: torch.cat([r["outputs"][k] for r in collectors]) for k in collectors[0]["outputs"]}
    return {
        "outputs": outputs,
        "metrics": results[0]["metrics"],
        "grads": results[0]["grads"],
        "all_metrics": [r["metrics"] for r in results],
        "update_all_gathers": results[0].get("update_all_gathers"),
    }


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (0 when both are 0)."""
    denom = b.double().norm()
    diff = (a.double() - b.double()).norm()
    return float(diff / denom) if denom > 0 else float(diff)
