"""On-policy distillation losses (verl 0.9.1's `distillation.distillation_loss.*`), as pure functions.

The student samples its responses; a teacher scores the same tokens. Per response token the loss is a divergence
between student and teacher:

- a single-sample KL estimator of KL(student ‖ teacher) on the sampled token (`loss_mode` k1/kl, abs, k2/mse,
  k3/low_var_kl: the estimators of `rlframe.algorithms.kl`, the teacher in the reference's place), or
- `forward_kl_topk`: KL(teacher ‖ student) over the teacher's top-k tokens at each position, Σ p_t (log p_t − log p_s)
  with both distributions restricted to those k tokens (not renormalized, so it is floored at 0).

The token losses are clamped to ±`loss_max_clamp`, then either back-propagated directly (aggregated by the actor's
loss_agg_mode; Agarwal et al. 2023, arXiv:2306.13649) or, with `use_policy_gradient`, used as a per-token negative
reward in the PPO clipped surrogate (Thinking Machines' "On-policy distillation"), with their own clip ratios.
`combine` adds the result to the task (PPO) loss per `use_task_rewards` and `distillation_loss_coef`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlframe.algorithms.kl import kl_penalty
from rlframe.algorithms.loss import Aggregation, PolicyLossArgs, get_policy_loss_fn
from rlframe.algorithms.masked import masked_mean

ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk",)
LOSS_MODES = ESTIMATOR_MODES + TOPK_MODES
POLICY_LOSS_MODES = ("vanilla",)  # verl 0.9.1 implements only vanilla for the distillation policy gradient
# verl's distillation policy loss reads clip_ratio_c from a config that has none: its 3.0 fallback applies
DUAL_CLIP_RATIO_C = 3.0


@dataclass(frozen=True)
class DistillationLoss:
    """The `distillation.distillation_loss` section as the actor's loss reads it, fixed when the actor is built."""

    loss_mode: str = "k3"
    topk: int | None = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    @classmethod
    def from_config(cls, section) -> DistillationLoss:
        """The settings of a `distillation.distillation_loss` section; clip_ratio_low/high null take clip_ratio."""
        clip = float(section.clip_ratio)
        low, high = section.clip_ratio_low, section.clip_ratio_high
        return cls(
            loss_mode=str(section.loss_mode),
            topk=None if section.topk is None else int(section.topk),
            use_task_rewards=bool(section.use_task_rewards),
            distillation_loss_coef=float(section.distillation_loss_coef),
            loss_max_clamp=None if section.loss_max_clamp is None else float(section.loss_max_clamp),
            log_prob_min_clamp=None if section.log_prob_min_clamp is None else float(section.log_prob_min_clamp),
            use_policy_gradient=bool(section.use_policy_gradient),
            policy_loss_mode=str(section.policy_loss_mode),
            clip_ratio_low=clip if low is None else float(low),
            clip_ratio_high=clip if high is None else float(high),
        )

    @property
    def uses_topk(self) -> bool:
        """The loss reads the teacher's top-k log-probs and ids and the student's full distribution."""
        return self.loss_mode in TOPK_MODES


def estimator_losses(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, loss_mode: str) -> torch.Tensor:
    """[bs, len] KL(student ‖ teacher) estimated on the sampled tokens by `loss_mode` (rlframe.algorithms.kl)."""
    if loss_mode not in ESTIMATOR_MODES:
        raise ValueError(f"unknown distillation estimator {loss_mode!r}; valid names: {', '.join(ESTIMATOR_MODES)}")
    return kl_penalty(student_log_probs, teacher_log_probs, loss_mode)


def topk_forward_kl(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    log_prob_min_clamp: float | None = None,
) -> dict[str, torch.Tensor]:
    """`topk_forward_kl_of_log_probs` with the student's log-probs of the teacher's top-k tokens from its logits.

    `student_logits` [..., vocab]; `teacher_topk_*` [..., k].
    """
    student_topk = F.log_softmax(student_logits, dim=-1).gather(-1, teacher_topk_ids.long())
    return topk_forward_kl_of_log_probs(student_topk, teacher_topk_log_probs, log_prob_min_clamp)


def topk_forward_kl_of_log_probs(
    student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor, log_prob_min_clamp: float | None = None
) -> dict[str, torch.Tensor]:
    """Forward KL over the teacher's top-k tokens per position, and how much mass those tokens hold.

    Both inputs [..., k] are log-probs of the teacher's top-k tokens (the student's of the full vocabulary,
    gathered). Returns `losses` (Σ_k p_t·(log p_t − log p_s), floored at 0: over k tokens neither distribution sums
    to 1, so the sum can dip below 0), `student_mass` and `teacher_mass` (Σ_k p: how much of each distribution the
    loss sees). Log-probs are clamped from below at `log_prob_min_clamp` (after the masses are taken) when set.
    """
    student_topk, teacher_topk = student_topk_log_probs, teacher_topk_log_probs
    student_mass = student_topk.exp().sum(-1)
    teacher_mass = teacher_topk.exp().sum(-1)
    if log_prob_min_clamp is not None:
        student_topk = student_topk.clamp_min(log_prob_min_clamp)
        teacher_topk = teacher_topk.clamp_min(log_prob_min_clamp)
    student_topk, teacher_topk = student_topk.float(), teacher_topk.float()
    losses = (teacher_topk.exp() * (teacher_topk - student_topk)).sum(-1)
    return {"losses": losses.clamp_min(0.0), "student_mass": student_mass, "teacher_mass": teacher_mass}


def distillation_loss(
    token_losses: torch.Tensor,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    settings: DistillationLoss,
    agg: Aggregation,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation term of one micro-batch from its [bs, len] token losses, and its metrics.

    Clamped to ±loss_max_clamp; then aggregated by `agg` (supervised), or with `use_policy_gradient` the
    `policy_loss_mode` surrogate (vanilla PPO clip) of `log_probs` against `old_log_probs` with advantages −losses
    (detached), scaled per token by the rollout-correction `is_weights` when given. Metrics are local means over
    the valid tokens.
    """
    metrics = {"abs_loss": masked_mean(token_losses.abs(), response_mask).detach()}
    if settings.loss_max_clamp is not None:  # the lower bound matters for k1, which can be negative
        token_losses = token_losses.clamp(-settings.loss_max_clamp, settings.loss_max_clamp)
    if not settings.use_policy_gradient:
        return agg(token_losses, response_mask), metrics
    advantages = -token_losses.detach()
    if is_weights is not None:  # the vanilla surrogate is homogeneous in A: ℓ(w·A) = w·ℓ(A) for w ≥ 0
        advantages = advantages * is_weights
    if settings.policy_loss_mode not in POLICY_LOSS_MODES:
        raise ValueError(
            f"distillation policy loss {settings.policy_loss_mode!r}: verl 0.9.1 implements only "
            f"{', '.join(POLICY_LOSS_MODES)} for the distillation policy gradient"
        )
    args = PolicyLossArgs(settings.clip_ratio_low, settings.clip_ratio_high, DUAL_CLIP_RATIO_C, agg)
    policy_loss_fn = get_policy_loss_fn(settings.policy_loss_mode)
    loss, pg_metrics = policy_loss_fn(old_log_probs, log_probs, advantages, response_mask, args)
    metrics.update(pg_metrics)
    return loss, metrics


def combine(task_loss: torch.Tensor | None, distill_loss: torch.Tensor, settings: DistillationLoss) -> torch.Tensor:
    """The actor's loss: task + coef·distillation with `use_task_rewards`, else the distillation term alone."""
    if not settings.use_task_rewards:
        return distill_loss
    return task_loss + settings.distillation_loss_coef * distill_loss
