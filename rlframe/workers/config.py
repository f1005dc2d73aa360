"""The sections the FSDP workers read: model, actor, reference, critic, reward model, FSDP and optimizer."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from rlframe.algorithms.kl import get_kl_penalty_fn
from rlframe.algorithms.loss import (
    LOSS_AGG_MODES,
    POLICY_LOSS_INFO,
    config_parameters,
    get_policy_loss_fn,
    policy_loss_help,
)
from rlframe.algorithms.on_policy import old_log_prob_pass_reason
from rlframe.config.checks import SAVE_CONTENTS, STRATEGIES, check_fsdp_size, planned_device
from rlframe.config.keys import (
    ACTOR,
    LOG_PROB_FIELDS,
    REF,
    ROLLOUT,
    UPDATE_FIELDS,
    VALUE_FIELDS,
    micro_batch_inactive,
    ref_enabled,
)
from rlframe.config.schema import Section, each_of, fields_of, key, section
from rlframe.models.builtin import SHM_ROOT
from rlframe.reward.dapo import RewardKwargsConfig
from rlframe.reward.manager import get_reward_manager_cls
from rlframe.seqpack import ALLOCATE_FNS
from rlframe.workers.fsdp_utils import DTYPES
from rlframe.workers.profiler import RoleProfilerConfig

DTYPE_NAMES = ("auto", *DTYPES)
WARMUP_STYLES = ("constant", "cosine")


def _log_prob_pass_switches(path: str, root: Any) -> dict[str, str]:
    """The verl switches of a log-prob pass (actor or ref) that have no effect here, with why."""
    # rlframe always computes entropy a chunk of tokens at a time and recomputes each chunk in backward:
    # the same numbers as verl with either switch, in less memory than verl with both off
    reason = "rlframe always computes entropy in chunks and recomputes them in backward (same values, less memory)"
    out = {f"{path}.{name}": reason for name in ("entropy_from_logits_with_chunking", "entropy_checkpointing")}
    if planned_device(root.trainer.device) != "cuda":
        out[f"{path}.use_torch_compile"] = "torch.compile is applied on CUDA only (the device here is cpu)"
    return out


def _check_shm(path: str, use_shm: bool) -> None:
    if use_shm and not os.path.isdir(SHM_ROOT):
        raise ValueError(f"{path}.use_shm=true needs {SHM_ROOT} (a Linux shared-memory mount); set it to false")


def _check_impl_backend(name: str) -> None:
    if name in ("triton", "liger"):
        raise ValueError(
            f"verl's {name} kernel (a CUDA GPU kernel) is not implemented in rlframe; impl_backend=torch gives the "
            "same log-probs and entropy from a chunked computation (docs/fsdp_engine.md)"
        )
    if name != "torch":
        raise ValueError("verl 0.9.1's backends are torch, triton and liger; rlframe implements torch")


@dataclass
class FusedKernelOptions(Section):
    impl_backend: str = key(
        "torch", "torch (chunked fused head); verl's triton and liger kernels are refused", check=_check_impl_backend
    )


def _offload_inactive(path: str, enabled: bool, root: Any) -> dict[str, str]:
    """enable_activation_offload has nothing to move when the activations already live in host memory."""
    if enabled and planned_device(root.trainer.device) != "cuda":
        return {f"{path}.enable_activation_offload": "the device here is cpu: activations already live in host memory"}
    return {}


@dataclass
class ModelConfig(Section):
    path: str = key("builtin://tiny", "local HF model dir; builtin://tiny = tiny random Qwen2 built offline")
    external_lib: Optional[str] = key(None, "python module imported in workers before loading (custom models)")
    override_config: Dict[str, Any] = key({}, "fields merged into the model's HF config")
    enable_gradient_checkpointing: bool = key(True, "recompute activations in backward (saves memory)")
    use_remove_padding: bool = key(True, "pack sequences into one row with cu_seqlens (no pad compute)")
    trust_remote_code: bool = key(False, "passed to from_pretrained")
    use_shm: bool = key(False, "copy the model folder to /dev/shm once per node and load from there")
    enable_activation_offload: bool = key(
        False, "keep saved activations in host memory from forward to backward (CUDA; docs/fsdp_engine.md)"
    )
    use_fused_kernels: bool = key(
        False, "log-probs and entropy from the last hidden states a chunk at a time, never the full logits"
    )
    fused_kernel_options: FusedKernelOptions = section(FusedKernelOptions)
    lora_rank: int = key(0, "LoRA rank; 0 = train the full model, > 0 = train a PEFT LoRA adapter (docs/lora.md)")
    lora_alpha: int = key(16, "LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank")
    target_modules: Any = key("all-linear", "modules given an adapter: all-linear, a regex, or a list of names")
    exclude_modules: Any = key(None, "modules never given an adapter: null, a regex, or a list of names")
    lora_adapter_path: Optional[str] = key(None, "PEFT adapter folder to continue training (needs lora_rank > 0)")

    def check(self, path: str, root: Any) -> None:
        _check_shm(path, self.use_shm)
        _check_lora(path, self)
        if self.use_fused_kernels and root.actor_rollout_ref.actor.calculate_sum_pi_squared:
            raise ValueError(
                f"{path}.use_fused_kernels=true with actor_rollout_ref.actor.calculate_sum_pi_squared=true: "
                "Σπ² needs the full logits, which the fused head never builds (as in verl 0.9.1); turn one off"
            )
        rollout = root.actor_rollout_ref.rollout
        on_gpu = planned_device(root.trainer.device) == "cuda"  # vLLM's CPU build serves fp32 adapters
        if self.lora_rank > 0 and rollout.name == "vllm" and rollout.dtype in ("fp32", "float32") and on_gpu:
            raise ValueError(
                f"{path}.lora_rank={self.lora_rank} with actor_rollout_ref.rollout.name=vllm needs "
                "actor_rollout_ref.rollout.dtype bf16, fp16 or auto on a GPU (vLLM's CUDA LoRA kernels have no fp32; "
                f"got {rollout.dtype}); or use rollout.name=hf, which generates with merged weights in any dtype"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = _offload_inactive(path, self.enable_activation_offload, root)
        if not self.use_fused_kernels:
            out[f"{path}.fused_kernel_options"] = f"{path}.use_fused_kernels=false"
        shaping = ("lora_alpha", "target_modules", "exclude_modules")
        if self.lora_rank == 0:
            out.update({f"{path}.{name}": f"{path}.lora_rank=0 (LoRA off)" for name in (*shaping, "lora_adapter_path")})
            return out
        if self.lora_adapter_path is not None:
            reason = f"{path}.lora_adapter_path is set: the adapter's adapter_config.json decides"
            out.update({f"{path}.{name}": reason for name in shaping})
        if ref_enabled(root):
            out[f"{REF}.fsdp_config"] = (
                f"{path}.lora_rank > 0: the reference policy is the actor's base model with the adapter "
                "disabled (verl's ref_in_actor); no separate reference model is built"
            )
        return out


def _check_lora(path: str, model: ModelConfig) -> None:
    """LoRA keys: types PEFT accepts, and an adapter folder only together with lora_rank > 0."""
    if model.lora_rank < 0:
        raise ValueError(f"{path}.lora_rank={model.lora_rank} must be >= 0 (0 turns LoRA off)")
    for name in ("target_modules", "exclude_modules"):
        value = getattr(model, name)
        if name == "exclude_modules" and value is None:
            continue
        names = isinstance(value, Sequence) and all(isinstance(v, str) for v in value)
        if not isinstance(value, str) and not names:
            raise ValueError(
                f"{path}.{name}={value!r} must be a string (all-linear or a regex) or a list of module names"
            )
    adapter = model.lora_adapter_path
    if adapter is None:
        return
    if model.lora_rank == 0:
        raise ValueError(
            f"{path}.lora_adapter_path={adapter} needs {path}.lora_rank > 0 (as in verl 0.9.1's FSDP engine, "
            "LoRA is on only with a positive rank; the adapter's own rank is used)"
        )
    if not os.path.isfile(os.path.join(os.path.expanduser(adapter), "adapter_config.json")):
        raise ValueError(
            f"{path}.lora_adapter_path={adapter} is not a PEFT adapter folder (no adapter_config.json there)"
        )


@dataclass
class PolicyLossConfig(Section):
    loss_mode: str = key("vanilla", policy_loss_help(), check=get_policy_loss_fn)
    clip_cov_ratio: float = key(0.0002, "clip_cov: fraction of the mini-batch's tokens whose gradient is detached")
    clip_cov_lb: float = key(1.0, "clip_cov: a candidate token's covariance term lies above this")
    clip_cov_ub: float = key(5.0, "clip_cov: ... and below this")
    kl_cov_ratio: float = key(0.0002, "kl_cov: fraction of the mini-batch's tokens given the |log ratio| penalty")
    ppo_kl_coef: float = key(0.1, "kl_cov: weight of that penalty")
    dro_beta: Optional[float] = key(None, "dro: weight of the quadratic log-ratio penalty; required (> 0) for dro")

    def check(self, path: str, root: Any) -> None:
        mode = self.loss_mode
        if mode not in POLICY_LOSS_INFO:
            return  # loss_mode's own check names it and the valid ones
        if mode == "dro" and (self.dro_beta is None or self.dro_beta <= 0):
            raise ValueError(f"{path}.loss_mode=dro needs {path}.dro_beta > 0 (got {self.dro_beta})")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if name in config_parameters(mode) and not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{path}.{name}={getattr(self, name)} must be in (0, 1] for loss_mode={mode}")
        if mode == "clip_cov" and self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"{path}.clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub} "
                "(the covariance window of clip_cov's candidate tokens)"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        return _loss_parameters_inactive(path, self.loss_mode, {f.name for f in fields_of(self)})


def _loss_parameters_inactive(path: str, mode: str, names: set[str]) -> dict[str, str]:
    """Of `names` (keys of the section at `path`), the loss parameters the chosen policy loss does not read."""
    readers: dict[str, list[str]] = {}
    for loss in POLICY_LOSS_INFO:
        for name in config_parameters(loss):
            readers.setdefault(name, []).append(loss)
    return {
        f"{path}.{name}": f"{path.removesuffix('.policy_loss')}.policy_loss.loss_mode={mode}: only "
        f"{' and '.join(losses)} {'reads' if len(losses) == 1 else 'read'} it"
        for name, losses in readers.items()
        if name in names and mode not in losses
    }


@dataclass
class OptimConfig(Section):
    lr: float = key(1.0e-6, "peak learning rate")
    lr_warmup_steps: int = key(-1, "warmup steps; <= 0 = use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = key(0.0, "warmup as a fraction of total training steps")
    lr_scheduler_type: str = key("constant", "schedule after warmup: constant | cosine", choices=WARMUP_STYLES)
    warmup_style: Optional[str] = key(
        None, "deprecated (verl 0.9.1) name of lr_scheduler_type; set, it wins", choices=(None, *WARMUP_STYLES)
    )
    min_lr_ratio: float = key(0.0, "cosine floor as a fraction of lr")
    weight_decay: float = key(0.01, "AdamW weight decay")
    clip_grad: float = key(1.0, "max global grad norm (verl 0.9.1's clipping key); a non-finite norm skips the step")
    betas: List[float] = key([0.9, 0.999], "AdamW betas")
    total_training_steps: int = key(-1, "filled in by the trainer from the data; do not set")

    def check(self, path: str, root: Any) -> None:
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"{path}.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] (the cosine floor as a fraction of lr)"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {
            f"{path}.total_training_steps": "filled in by the trainer from the data; set "
            "trainer.total_training_steps instead"
        }
        if self.lr_warmup_steps > 0:  # as in verl, 0 or -1 defers to the ratio
            out[f"{path}.lr_warmup_steps_ratio"] = (
                f"{path}.lr_warmup_steps={self.lr_warmup_steps} (> 0) takes precedence"
            )
        if self.warmup_style is not None:
            out[f"{path}.lr_scheduler_type"] = f"{path}.warmup_style={self.warmup_style} (deprecated) replaces it"
        style = self.warmup_style or self.lr_scheduler_type
        if style != "cosine":
            out[f"{path}.min_lr_ratio"] = f"the schedule is {style}: only cosine decays"
        return out


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = key(1.0e-5, "peak learning rate")


@dataclass
class MixedPrecisionConfig(Section):
    param_dtype: str = key(
        "auto", "FSDP computes in this dtype; auto = bf16 on GPU (verl's), fp32 on CPU", choices=DTYPE_NAMES
    )
    reduce_dtype: str = key("fp32", "gradients are reduced across ranks in this dtype", choices=DTYPE_NAMES)
    buffer_dtype: str = key(
        "fp32", "buffers (rotary inv_freq) in this dtype (FSDP1; FSDP2 keeps them as loaded)", choices=DTYPE_NAMES
    )


def _check_trained_dtypes(path: str, model_dtype: str, mixed: MixedPrecisionConfig) -> None:
    """fp16 training needs loss scaling (verl's ShardedGradScaler), which rlframe does not implement."""
    for name, value in (("model_dtype", model_dtype), ("mixed_precision.param_dtype", mixed.param_dtype)):
        if value in ("fp16", "float16"):
            raise ValueError(
                f"{path}.{name}={value}: fp16 training needs loss scaling, which rlframe does not implement; "
                "use bf16 or fp32"
            )


@dataclass
class FSDPConfig(Section):
    param_offload: bool = key(False, "keep parameters on CPU between uses")
    optimizer_offload: bool = key(False, "keep optimizer state on CPU between steps")
    reshard_after_forward: bool = key(True, "free gathered params after forward (ZeRO-3 style)")
    fsdp_size: int = key(-1, "shard group size; -1 = all ranks, else HSDP (shard within groups of this size)")
    model_dtype: str = key(
        "fp32",
        "dtype the HF model is loaded in, so the dtype FSDP holds (and steps) parameters in",
        choices=DTYPE_NAMES[1:],
    )
    mixed_precision: MixedPrecisionConfig = section(MixedPrecisionConfig)
    forward_prefetch: bool = key(False, "all-gather the next layer during this one's forward (FSDP1; FSDP2 depth 1)")

    def check(self, path: str, root: Any) -> None:
        _check_trained_dtypes(path, self.model_dtype, self.mixed_precision)


@dataclass
class CheckpointConfig(Section):
    save_contents: List[str] = key(
        ["model", "optimizer", "extra"],
        "what a checkpoint holds; add hf_model for an HF export",
        check=each_of(SAVE_CONTENTS),
    )


@dataclass
class ActorConfig(Section):
    strategy: str = key("fsdp2", "fsdp2 (fully_shard) | fsdp (FSDP1)", choices=STRATEGIES)
    ppo_mini_batch_size: int = key(256, "prompts per optimizer step (x rollout.n sequences)")
    ppo_micro_batch_size_per_gpu: Optional[int] = key(
        None, "sequences per forward/backward on one GPU (use_dynamic_bsz=false)"
    )
    ppo_micro_batch_size: Optional[int] = key(None, "deprecated (verl) global form: per GPU = this // dp")
    use_dynamic_bsz: bool = key(False, "micro-batch by token budget instead of sequence count")
    ppo_max_token_len_per_gpu: int = key(16384, "token budget per micro-batch per GPU (dynamic; x sp inside)")
    packing_algorithm: str = key(
        "kk", "dynamic micro-batch packing: kk (Karmarkar-Karp) | ffd", choices=tuple(ALLOCATE_FNS)
    )
    grad_clip: float = key(1.0, "verl's old clipping key; no effect: verl 0.9.1 and rlframe clip by optim.clip_grad")
    clip_ratio: float = key(0.2, "PPO clip epsilon, used where clip_ratio_low/high are null (as in verl)")
    clip_ratio_low: Optional[float] = key(0.2, "lower clip epsilon; null = clip_ratio")
    clip_ratio_high: Optional[float] = key(0.2, "upper clip epsilon (DAPO clip-higher); null = clip_ratio")
    clip_ratio_c: float = key(3.0, "dual-clip bound for negative advantages (> 1); dppo_*: truncated-IS bound")
    tau_pos: float = key(1.0, "sapo: gate temperature where the advantage is positive")
    tau_neg: float = key(1.05, "sapo: gate temperature where the advantage is not positive")
    calculate_sum_pi_squared: bool = key(
        False, "the old-log-prob pass also returns Σπ² per token (algorithm.adv_estimator=optimal_token_baseline)"
    )
    loss_agg_mode: str = key("token-mean", " | ".join(LOSS_AGG_MODES), choices=LOSS_AGG_MODES)
    entropy_coeff: float = key(0.0, "entropy bonus coefficient")
    use_kl_loss: bool = key(False, "add KL(actor || ref) to the loss (GRPO style)")
    kl_loss_coef: float = key(0.001, "weight of the KL loss")
    kl_loss_type: str = key(
        "low_var_kl",
        "kl|k1|abs|mse|k2|low_var_kl|k3; with a + (k3+): that value, k2's gradient",
        check=get_kl_penalty_fn,
    )
    ppo_epochs: int = key(1, "passes over each batch")
    shuffle: bool = key(False, "shuffle sequences before cutting mini-batches")
    ulysses_sequence_parallel_size: int = key(1, "Ulysses SP degree (needs use_remove_padding)")
    use_torch_compile: bool = key(True, "torch.compile the log-prob and entropy kernels (CUDA)")
    entropy_from_logits_with_chunking: bool = key(False, "verl's memory switch; no effect: rlframe always chunks")
    entropy_checkpointing: bool = key(False, "verl's memory switch; no effect: rlframe always recomputes")
    skip_on_policy_old_log_prob: bool = key(
        True,
        "rlframe: a one-epoch update computes the old log-probs itself (its first step's, detached) instead of a pass",
    )
    policy_loss: PolicyLossConfig = section(PolicyLossConfig)
    optim: OptimConfig = section(OptimConfig)
    fsdp_config: FSDPConfig = section(FSDPConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling on global_profiler.steps (docs/profiling.md)")

    def check(self, path: str, root: Any) -> None:
        estimator = root.algorithm.adv_estimator
        if estimator == "optimal_token_baseline" and not self.calculate_sum_pi_squared:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} needs the policy's Σπ² per token: set "
                f"{path}.calculate_sum_pi_squared=true (as verl 0.9.1 requires)"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(self, path, UPDATE_FIELDS, "actor update")
        out[f"{path}.grad_clip"] = f"verl 0.9.1 clips by {path}.optim.clip_grad (as rlframe does)"
        out.update(_log_prob_pass_switches(path, root))
        actor_rollout_ref = root.actor_rollout_ref
        dynamic = {f"{path}.use_dynamic_bsz": self.use_dynamic_bsz}
        dynamic[f"{ROLLOUT}.log_prob_use_dynamic_bsz"] = actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
        if ref_enabled(root):
            dynamic[f"{REF}.log_prob_use_dynamic_bsz"] = actor_rollout_ref.ref.log_prob_use_dynamic_bsz
        if not any(dynamic.values()):
            out[f"{path}.packing_algorithm"] = f"{', '.join(k + '=false' for k in dynamic)}: no pass packs by tokens"
        if self.clip_ratio_low is not None and self.clip_ratio_high is not None:
            out[f"{path}.clip_ratio"] = (
                f"{path}.clip_ratio_low and clip_ratio_high are set (verl's defaults set both "
                "to 0.2); clip_ratio applies only where they are null"
            )
        if not self.use_kl_loss:
            out.update({f"{path}.{name}": f"{path}.use_kl_loss=false" for name in ("kl_loss_coef", "kl_loss_type")})
        out.update(_policy_loss_inactive(path, self))
        reason = old_log_prob_pass_reason(self, root.algorithm)
        if self.skip_on_policy_old_log_prob and reason is not None:
            out[f"{path}.skip_on_policy_old_log_prob"] = f"the separate old-log-prob pass runs: {reason}"
        if reason is None:  # only optimal_token_baseline reads Σπ², and it keeps the pass
            out[f"{path}.calculate_sum_pi_squared"] = (
                f"the update computes the old log-probs ({path}.skip_on_policy_old_log_prob): no pass returns Σπ²"
            )
        return out


def clip_ratio_bounds(actor: ActorConfig) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high) by verl's rule: a null bound falls back to clip_ratio."""
    low, high = actor.clip_ratio_low, actor.clip_ratio_high
    return float(actor.clip_ratio if low is None else low), float(actor.clip_ratio if high is None else high)


def _policy_loss_inactive(path: str, actor: ActorConfig) -> dict[str, str]:
    """The actor keys the chosen policy loss does not read (from what the loss registered it reads)."""
    mode = actor.policy_loss.loss_mode
    info = POLICY_LOSS_INFO.get(mode)
    if info is None:  # an unknown loss: PolicyLossConfig's check names it and the valid ones
        return {}
    out = _loss_parameters_inactive(path, mode, {f.name for f in fields_of(actor)})
    if not info.clips_ratio:
        reason = f"{path}.policy_loss.loss_mode={mode} does not clip the ratio"
        out.update({f"{path}.{name}": reason for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")})
    if not info.dual_clip:
        out[f"{path}.clip_ratio_c"] = f"{path}.policy_loss.loss_mode={mode} has no dual clip or IS truncation"
    return out


@dataclass
class RefFSDPConfig(Section):
    param_offload: bool = key(False, "keep ref parameters on CPU between uses")
    reshard_after_forward: bool = key(True, "free gathered params after forward")
    model_dtype: str = key("fp32", "dtype the reference model is loaded in (FSDP holds it so)", choices=DTYPE_NAMES[1:])
    mixed_precision: MixedPrecisionConfig = section(MixedPrecisionConfig)
    forward_prefetch: bool = key(False, "all-gather the next layer during this one's forward (FSDP1; FSDP2 depth 1)")


@dataclass
class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: Optional[int] = key(None, "sequences per ref forward on one GPU (static)")
    log_prob_micro_batch_size: Optional[int] = key(None, "deprecated (verl) global form: per GPU = this // dp")
    log_prob_use_dynamic_bsz: bool = key(f"${{{ACTOR}.use_dynamic_bsz}}", "token-budget micro-batches")
    log_prob_max_token_len_per_gpu: int = key(f"${{{ACTOR}.ppo_max_token_len_per_gpu}}", "token budget (dynamic)")
    ulysses_sequence_parallel_size: int = key(f"${{{ACTOR}.ulysses_sequence_parallel_size}}", "SP degree")
    use_torch_compile: bool = key(f"${{{ACTOR}.use_torch_compile}}", "torch.compile the log-prob kernels (CUDA)")
    entropy_from_logits_with_chunking: bool = key(False, "verl's memory switch; no effect: rlframe always chunks")
    entropy_checkpointing: bool = key(False, "verl's memory switch; no effect: rlframe always recomputes")
    fsdp_config: RefFSDPConfig = section(RefFSDPConfig)
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling on global_profiler.steps (docs/profiling.md)")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(self, path, LOG_PROB_FIELDS, "ref log-prob")
        out.update(_log_prob_pass_switches(path, root))
        return out


@dataclass
class CriticModelConfig(Section):
    path: str = key("${actor_rollout_ref.model.path}", "value model init (backbone + scalar head)")
    tokenizer_path: str = key("${actor_rollout_ref.model.path}", "tokenizer for the critic")
    override_config: Dict[str, Any] = key({}, "fields merged into the critic's HF config")
    external_lib: Optional[str] = key("${actor_rollout_ref.model.external_lib}", "module imported before loading")
    enable_gradient_checkpointing: bool = key(True, "recompute activations in backward")
    use_remove_padding: bool = key("${actor_rollout_ref.model.use_remove_padding}", "packed sequences")
    trust_remote_code: bool = key(False, "passed to from_pretrained")
    use_shm: bool = key(False, "copy the model folder to /dev/shm once per node and load from there")
    enable_activation_offload: bool = key(
        False, "keep saved activations in host memory from forward to backward (CUDA; docs/fsdp_engine.md)"
    )
    fsdp_config: FSDPConfig = section(FSDPConfig)

    def check(self, path: str, root: Any) -> None:
        _check_shm(path, self.use_shm)

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        return _offload_inactive(path, self.enable_activation_offload, root)


@dataclass
class CriticConfig(Section):
    strategy: str = key(f"${{{ACTOR}.strategy}}", "fsdp2 | fsdp", choices=STRATEGIES)
    model: CriticModelConfig = section(CriticModelConfig)
    optim: CriticOptimConfig = section(CriticOptimConfig)
    ppo_mini_batch_size: int = key(f"${{{ACTOR}.ppo_mini_batch_size}}", "prompts per critic optimizer step")
    ppo_micro_batch_size_per_gpu: Optional[int] = key(None, "sequences per critic forward/backward on one GPU")
    ppo_micro_batch_size: Optional[int] = key(None, "deprecated (verl) global form: per GPU = this // dp")
    forward_micro_batch_size_per_gpu: Optional[int] = key(
        "${critic.ppo_micro_batch_size_per_gpu}", "sequences per value forward on one GPU"
    )
    forward_micro_batch_size: Optional[int] = key(
        "${critic.ppo_micro_batch_size}", "deprecated (verl) global form: per GPU = this // dp"
    )
    use_dynamic_bsz: bool = key(f"${{{ACTOR}.use_dynamic_bsz}}", "token-budget micro-batches")
    ppo_max_token_len_per_gpu: int = key(32768, "token budget per micro-batch per GPU (dynamic)")
    forward_max_token_len_per_gpu: int = key("${critic.ppo_max_token_len_per_gpu}", "token budget for value forward")
    packing_algorithm: str = key(f"${{{ACTOR}.packing_algorithm}}", "kk | ffd", choices=tuple(ALLOCATE_FNS))
    ulysses_sequence_parallel_size: int = key(1, "Ulysses SP degree for the critic")
    ppo_epochs: int = key(f"${{{ACTOR}.ppo_epochs}}", "passes over each batch")
    shuffle: bool = key(f"${{{ACTOR}.shuffle}}", "shuffle before mini-batches")
    grad_clip: float = key(1.0, "verl's old clipping key; no effect: verl 0.9.1 and rlframe clip by optim.clip_grad")
    cliprange_value: float = key(0.5, "value clipping range")
    loss_agg_mode: str = key(f"${{{ACTOR}.loss_agg_mode}}", "aggregation of the value loss", choices=LOSS_AGG_MODES)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling on global_profiler.steps (docs/profiling.md)")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(self, path, UPDATE_FIELDS, "critic update")
        out[f"{path}.grad_clip"] = f"verl 0.9.1 clips by {path}.optim.clip_grad (as rlframe does)"
        out.update(micro_batch_inactive(self, path, VALUE_FIELDS, "value"))
        if not self.use_dynamic_bsz:
            out[f"{path}.packing_algorithm"] = f"{path}.use_dynamic_bsz=false: no critic pass packs by tokens"
        return out


@dataclass
class RewardModelFSDPConfig(Section):
    param_offload: bool = key(False, "keep reward-model parameters on CPU between uses")
    reshard_after_forward: bool = key(True, "free gathered params after forward")
    fsdp_size: int = key(-1, "shard group size; -1 = all ranks, else HSDP (shard within groups of this size)")
    forward_prefetch: bool = key(False, "all-gather the next layer during this one's forward (FSDP1; FSDP2 depth 1)")


@dataclass
class RewardModelModelConfig(Section):
    path: Optional[str] = key(None, "sequence-classification model dir")
    input_tokenizer: str = key("${actor_rollout_ref.model.path}", "tokenizer of the policy (to decode responses)")
    use_remove_padding: bool = key(False, "score packed sequences (cu_seqlens, no pad compute); same scores")
    fsdp_config: RewardModelFSDPConfig = section(RewardModelFSDPConfig)


# verl 0.9.1 serves a reward model from an inference engine in its reward loop; these are that engine's
# settings (verl's legacy `reward_model.rollout.*` spelling, null = verl's reward.reward_model.rollout value).
# rlframe scores the same text with its FSDP reward worker inside the training processes, so none of them
# changes a score: each is reported without effect when set.
_RM_SERVER = "rlframe scores the reward model with its FSDP reward worker, not an inference server"


@dataclass
class RewardModelRolloutConfig(Section):
    name: Optional[str] = key(None, "verl's reward-model server: vllm | sglang", choices=(None, "vllm", "sglang"))
    dtype: Optional[str] = key(None, "server dtype (the FSDP worker computes in bf16 on GPU, fp32 on CPU)")
    gpu_memory_utilization: Optional[float] = key(None, "server memory fraction")
    enforce_eager: Optional[bool] = key(None, "server CUDA graphs off")
    cudagraph_capture_sizes: Optional[Any] = key(None, "server CUDA graph batch sizes")
    free_cache_engine: Optional[bool] = key(None, "server sleeps between uses")
    data_parallel_size: Optional[int] = key(None, "server replicas' DP size")
    expert_parallel_size: Optional[int] = key(None, "server EP size")
    tensor_model_parallel_size: Optional[int] = key(None, "server TP size")
    max_num_batched_tokens: Optional[int] = key(None, "server tokens per scheduler step")
    max_model_len: Optional[int] = key(None, "server context length")
    max_num_seqs: Optional[int] = key(None, "server sequences per scheduler step")
    load_format: Optional[str] = key(None, "server weight loading")
    engine_kwargs: Optional[Any] = key(None, "more server engine arguments")
    limit_images: Optional[int] = key(None, "server images per prompt (multimodal)")
    enable_chunked_prefill: Optional[bool] = key(None, "server chunked prefill")
    enable_prefix_caching: Optional[bool] = key(None, "server prefix caching")
    disable_log_stats: Optional[bool] = key(None, "server statistics logging")
    skip_tokenizer_init: Optional[bool] = key(None, "server without a tokenizer (verl requires false)")
    prompt_length: Optional[int] = key(None, "generative reward models' prompt budget")
    response_length: Optional[int] = key(None, "generative reward models' response budget")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        why = _RM_SERVER if root.reward_model.enable else "reward_model.enable=false"
        return {f"{path}.{field}": why for field in self.__dataclass_fields__}


@dataclass
class RewardModelConfig(Section):
    enable: bool = key(False, "score with a reward model: its score is the reward (rules: reward/rule_score/mean)")
    use_reward_loop: bool = key(
        True,
        "verl 0.8's switch, always on in 0.9.1: score the text verl's reward loop sends its server (the raw chat "
        "+ the decoded response, in the reward model's chat template); false = verl 0.8's legacy FSDP worker inputs",
    )
    num_workers: Optional[int] = key(None, "verl's reward-loop workers (scoring concurrency); no effect here")
    rollout: RewardModelRolloutConfig = section(RewardModelRolloutConfig, "verl's reward-model server settings")
    model: RewardModelModelConfig = section(RewardModelModelConfig)
    micro_batch_size_per_gpu: int = key(4, "sequences per reward model forward")
    reward_manager: str = key(
        "naive",
        "naive (one call per sample) | batch (one call per batch) | dapo (naive + overlong penalty)",
        check=get_reward_manager_cls,
    )
    reward_kwargs: RewardKwargsConfig = section(RewardKwargsConfig)

    def check(self, path: str, root: Any) -> None:
        if self.enable and not self.model.path:
            raise ValueError(
                "reward_model.enable=true needs reward_model.model.path (a sequence-classification model folder)"
            )
        if self.enable and self.use_reward_loop and root.custom_reward_function.path:
            raise ValueError(
                "reward_model.enable=true with custom_reward_function.path and reward_model.use_reward_loop=true: "
                "verl 0.9.1's reward loop then scores with the custom function alone, which reaches the reward model "
                "through the loop's server (reward_router_address), and rlframe runs no such server. Keep one of "
                "the two, or set reward_model.use_reward_loop=false (verl 0.8's legacy worker: the reward model's "
                "score is the reward)"
            )
        if self.enable:
            world_size = root.trainer.nnodes * root.trainer.n_gpus_per_node
            check_fsdp_size(self.model.fsdp_config.fsdp_size, world_size, f"{path}.model.fsdp_config.fsdp_size")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        # verl's count of reward-loop actors scoring concurrently; rlframe's reward manager scores on the driver
        # and its reward worker on every training rank: the scores do not depend on it
        out = {f"{path}.num_workers": "rlframe scores on the driver (rules) and on every training rank (model)"}
        if self.enable:
            return out
        out.update({f"{path}.{name}": "reward_model.enable=false" for name in ("model", "micro_batch_size_per_gpu")})
        # without a reward model, verl's reward loop runs the same reward manager on the same scorers
        out[f"{path}.use_reward_loop"] = (
            "reward_model.enable=false: the rewards come from the reward manager either way (verl's reward loop "
            "runs the same manager and scorers)"
        )
        return out
