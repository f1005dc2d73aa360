"""The fields that cut each pass into micro-batches, the sections' paths, and the switches that turn the
reference model and the critic on.

The actor and critic updates, the old- and ref-log-prob passes and the critic's value pass each read one
section's four micro-batching fields (a static count, verl's global count, a dynamic switch, a token
budget); the three namings below say which fields. A section's other batch keys are read by name where
they are used (`rlframe.batch_plan`).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"
MODEL = "actor_rollout_ref.model"
CRITIC = "critic"


@dataclass(frozen=True)
class MicroFields:
    """The names of the fields, in one section, that cut one pass into micro-batches."""

    dynamic: str  # true: micro-batches are packed by a token budget
    micro: str  # static: sequences per micro-batch on one GPU
    global_micro: str  # verl's deprecated global form of `micro`: per GPU = global // dp
    max_token_len: str  # dynamic: tokens per micro-batch on one GPU

    def under(self, path: str) -> MicroFields:
        """The same fields as full dotted keys of the section at `path`."""
        return MicroFields(*(f"{path}.{name}" for name in astuple(self)))


# actor (actor_rollout_ref.actor) and critic updates
UPDATE_FIELDS = MicroFields(
    "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_micro_batch_size", "ppo_max_token_len_per_gpu"
)
# old log-probs (actor_rollout_ref.rollout) and ref log-probs (actor_rollout_ref.ref)
LOG_PROB_FIELDS = MicroFields(
    "log_prob_use_dynamic_bsz",
    "log_prob_micro_batch_size_per_gpu",
    "log_prob_micro_batch_size",
    "log_prob_max_token_len_per_gpu",
)
# the critic's value pass
VALUE_FIELDS = MicroFields(
    "use_dynamic_bsz", "forward_micro_batch_size_per_gpu", "forward_micro_batch_size", "forward_max_token_len_per_gpu"
)


def ref_enabled(root: Any) -> bool:
    """A reference model is loaded for a KL loss or a KL penalty in the reward."""
    return root.actor_rollout_ref.actor.use_kl_loss or root.algorithm.use_kl_in_reward


def critic_enabled(root: Any) -> bool:
    """Only GAE learns a value function."""
    return root.algorithm.adv_estimator == "gae"


def micro_batch_inactive(section: Any, path: str, fields: MicroFields, what: str) -> dict[str, str]:
    """Static micro size vs token budget: exactly one of the two applies ({key: reason} of the other).

    `section` is the typed section at `path` that holds `fields`; a packing key is left to the caller
    (several passes share it).
    """
    keys = fields.under(path)
    if getattr(section, fields.dynamic):
        because = f"{keys.dynamic}=true: {what} micro-batches are cut by {keys.max_token_len}"
        return {keys.micro: because, keys.global_micro: because}
    out = {keys.max_token_len: f"{keys.dynamic}=false: {what} micro-batches are cut by a sequence count"}
    unused = keys.global_micro if getattr(section, fields.global_micro) is None else keys.micro
    out[unused] = f"{what} micro-batches are cut by {keys.micro if unused == keys.global_micro else keys.global_micro}"
    return out
