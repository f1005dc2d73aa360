"""The `bypass_mode` policy loss: the rollout correction's bypass loss under a loss_mode of its own.

It lives apart from `loss.py` because it calls `rollout_correction.bypass_policy_loss`, which builds on
`loss.py`'s vanilla loss; `rlframe/algorithms/__init__.py` imports this module, so the name is registered
whenever any of the package is imported, right after `loss.py`'s own losses.
"""

from __future__ import annotations

from rlframe.algorithms.loss import PolicyLossArgs, register_policy_loss
from rlframe.algorithms.rollout_correction import BYPASS_LOSS_DEFAULT, bypass_policy_loss


@register_policy_loss("bypass_mode", clips_ratio=True, dual_clip=True, summary="rollout-correction bypass loss")
def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """verl 0.9.1's `bypass_mode` loss, which takes `old_log_prob` as π_rollout: the rollout correction of
    π_θ against it (weights and rejection), then `loss_type=ppo_clip` (the vanilla loss on π_θ/π_old, the
    weights only reported) or `reinforce`. As a loss_mode of its own (outside
    `algorithm.rollout_correction.bypass_mode=true`, where the actor runs this loss with the algorithm's
    correction keys whatever the loss_mode), it reads verl's defaults (`rollout_correction.BYPASS_LOSS_DEFAULT`):
    sequence-level weights for the `rollout_corr/*` metrics, no rejection, PPO-clip — the vanilla loss.
    """
    return bypass_policy_loss(old_log_prob, log_prob, advantages, response_mask, BYPASS_LOSS_DEFAULT, args)
