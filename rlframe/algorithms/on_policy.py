"""When a step is exactly on-policy, so that the separate old-log-prob forward can be skipped.

A PPO/GRPO step's old log-probs are the policy's log-probs of the sampled tokens under the
parameters the update starts from. When the step takes exactly one optimizer step (one mini-batch,
one epoch), the update's own forward runs under those same parameters, so its log-probs, detached,
are the old ones (TRL does the same with num_iterations=1). That holds only if nothing needs them
before the update: `old_log_prob_pass_reason` names what does, from the config
(`actor_rollout_ref.actor.skip_on_policy_old_log_prob`, an rlframe key, turns the skip off).
"""

from __future__ import annotations

from typing import Any

from rlframe.algorithms.loss import TOKEN_SELECTORS
from rlframe.config.keys import ACTOR, get

SKIP_KEY = f"{ACTOR}.skip_on_policy_old_log_prob"


def old_log_prob_pass_reason(cfg: Any) -> str | None:
    """Why every step needs the separate old-log-prob pass under `cfg`; None when it can be skipped."""
    if not get(cfg, SKIP_KEY):
        return f"{SKIP_KEY}=false"
    if get(cfg, "algorithm.rollout_correction.bypass_mode"):
        return "algorithm.rollout_correction.bypass_mode=true: the old log-probs are the rollout's, no pass runs"
    epochs = int(get(cfg, f"{ACTOR}.ppo_epochs"))
    if epochs != 1:
        return f"{ACTOR}.ppo_epochs={epochs}: the epochs after the first are off-policy"
    train, mini = int(get(cfg, "data.train_batch_size")), int(get(cfg, f"{ACTOR}.ppo_mini_batch_size"))
    if train // mini != 1:
        return (
            f"{train // mini} optimizer steps per step (data.train_batch_size={train} / {ACTOR}.ppo_mini_batch_size"
            f"={mini}): only the first mini-batch is on-policy"
        )
    if get(cfg, "algorithm.use_kl_in_reward"):
        return "algorithm.use_kl_in_reward=true: the reward's KL penalty reads the old log-probs"
    if get(cfg, "algorithm.adv_estimator") == "optimal_token_baseline":
        return "algorithm.adv_estimator=optimal_token_baseline: the advantage reads the old log-probs and Σπ²"
    loss_mode = get(cfg, f"{ACTOR}.policy_loss.loss_mode")
    if loss_mode in TOKEN_SELECTORS:
        return f"{ACTOR}.policy_loss.loss_mode={loss_mode}: its token choice reads the old log-probs"
    for name in ("rollout_is", "rollout_rs"):
        value = get(cfg, f"algorithm.rollout_correction.{name}")
        if value is not None:
            return (
                f"algorithm.rollout_correction.{name}={value}: its weights or rejection, computed before the "
                "update, read the old log-probs"
            )
    return None
