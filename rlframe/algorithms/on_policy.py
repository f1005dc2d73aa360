"""When the update can compute the old log-probs itself, so that the separate old-log-prob pass is skipped.

A PPO/GRPO step's old log-probs are the policy's log-probs of the sampled tokens under the
parameters the update starts from. In an update of one epoch, the first optimizer step's own forward
runs under exactly those parameters, so its log-probs, detached, are the old ones of its mini-batch
(TRL does the same with num_iterations=1); the later mini-batches' rows take one forward without
gradients before that step, inside the same worker call. Either way the numbers are the separate
pass's, without its round trip through the driver (and without its forward over the first
mini-batch). That holds only if nothing needs them before the update: `old_log_prob_pass_reason`
names what does, from the config (`actor_rollout_ref.actor.skip_on_policy_old_log_prob`, an rlframe
key, turns the skip off).
"""

from __future__ import annotations

from typing import Any

from rlframe.algorithms.advantage import OTB_ESTIMATORS
from rlframe.algorithms.loss import TOKEN_SELECTORS
from rlframe.config.keys import ACTOR

SKIP_KEY = f"{ACTOR}.skip_on_policy_old_log_prob"


def old_log_prob_pass_reason(actor: Any, algorithm: Any) -> str | None:
    """Why every step needs the separate old-log-prob pass; None when it can be skipped.

    `actor` and `algorithm` are the typed sections `actor_rollout_ref.actor` and `algorithm`.
    """
    if not actor.skip_on_policy_old_log_prob:
        return f"{SKIP_KEY}=false"
    correction = algorithm.rollout_correction
    if correction.bypass_mode:
        return "algorithm.rollout_correction.bypass_mode=true: the old log-probs are the rollout's, no pass runs"
    if actor.ppo_epochs != 1:
        return f"{ACTOR}.ppo_epochs={actor.ppo_epochs}: later epochs reuse the old log-probs of every mini-batch"
    if algorithm.use_kl_in_reward:
        return "algorithm.use_kl_in_reward=true: the reward's KL penalty reads the old log-probs"
    if algorithm.adv_estimator in OTB_ESTIMATORS:
        return f"algorithm.adv_estimator={algorithm.adv_estimator}: the advantage reads the old log-probs and Σπ²"
    loss_mode = actor.policy_loss.loss_mode
    if loss_mode in TOKEN_SELECTORS:
        return f"{ACTOR}.policy_loss.loss_mode={loss_mode}: its token choice reads the old log-probs"
    for name in ("rollout_is", "rollout_rs"):
        value = getattr(correction, name)
        if value is not None:
            return (
                f"algorithm.rollout_correction.{name}={value}: its weights or rejection, computed before the "
                "update, read the old log-probs"
            )
    return None
