"""The actor's sections (`actor_rollout_ref.actor`): the policy update and its policy loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlframe.algorithms.advantage import OTB_ESTIMATORS
from rlframe.algorithms.kl import get_kl_penalty_fn
from rlframe.algorithms.loss import (
    LOSS_AGG_MODES,
    POLICY_LOSS_INFO,
    config_parameters,
    get_policy_loss_fn,
    policy_loss_help,
)
from rlframe.algorithms.on_policy import old_log_prob_pass_reason
from rlframe.config.checks import STRATEGIES
from rlframe.config.keys import REF, ROLLOUT, UPDATE_FIELDS, micro_batch_inactive, ref_enabled
from rlframe.config.schema import Section, fields_of, key, section
from rlframe.seqpack import ALLOCATE_FNS
from rlframe.workers.config.model import CheckpointConfig, FSDPConfig, OptimConfig, log_prob_pass_switches
from rlframe.workers.config.profiler import RoleProfilerConfig


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
        False,
        "the old-log-prob pass also returns Σπ² per token (algorithm.adv_estimator=optimal_token_baseline, "
        "tir_optimal_token_baseline)",
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
    freeze_vision_tower: bool = key(False, "a vision-language model's vision tower (model.visual) is not trained")
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
        if estimator in OTB_ESTIMATORS and not self.calculate_sum_pi_squared:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} needs the policy's Σπ² per token: set "
                f"{path}.calculate_sum_pi_squared=true (as verl 0.9.1 requires)"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(self, path, UPDATE_FIELDS, "actor update")
        out[f"{path}.grad_clip"] = f"verl 0.9.1 clips by {path}.optim.clip_grad (as rlframe does)"
        out.update(log_prob_pass_switches(path, root))
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
        if reason is None:  # only the OTB estimators read Σπ², and they keep the pass
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
