"""Which config keys each role reads: the key sets of the actor update, the old/ref log-prob passes
and the critic, and the switches that turn the reference model and the critic on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"
MODEL = "actor_rollout_ref.model"


# ───────────────────────────── key sets per role ─────────────────────────────


@dataclass(frozen=True)
class ForwardKeys:
    """Config keys of one forward-only pass (old log-probs, ref log-probs, critic values)."""

    sp: str
    remove_padding: str
    dynamic: str
    micro: str
    global_micro: str  # verl's deprecated global form of `micro`: per GPU = global // dp
    max_token_len: str
    packing: str


@dataclass(frozen=True)
class UpdateKeys:
    """Config keys of one model's PPO update (actor or critic) and of its forward pass."""

    sp: str
    remove_padding: str
    mini: str
    epochs: str
    dynamic: str
    micro: str
    global_micro: str  # verl's deprecated global form of `micro`: per GPU = global // dp
    max_token_len: str
    packing: str
    forward: ForwardKeys


ACTOR_KEYS = UpdateKeys(
    sp=f"{ACTOR}.ulysses_sequence_parallel_size",
    remove_padding=f"{MODEL}.use_remove_padding",
    mini=f"{ACTOR}.ppo_mini_batch_size",
    epochs=f"{ACTOR}.ppo_epochs",
    dynamic=f"{ACTOR}.use_dynamic_bsz",
    micro=f"{ACTOR}.ppo_micro_batch_size_per_gpu",
    global_micro=f"{ACTOR}.ppo_micro_batch_size",
    max_token_len=f"{ACTOR}.ppo_max_token_len_per_gpu",
    packing=f"{ACTOR}.packing_algorithm",
    forward=ForwardKeys(  # old log-probs: the actor model, with the rollout's log_prob_* keys
        sp=f"{ACTOR}.ulysses_sequence_parallel_size",
        remove_padding=f"{MODEL}.use_remove_padding",
        dynamic=f"{ROLLOUT}.log_prob_use_dynamic_bsz",
        micro=f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        global_micro=f"{ROLLOUT}.log_prob_micro_batch_size",
        max_token_len=f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
        packing=f"{ACTOR}.packing_algorithm",
    ),
)
REF_KEYS = ForwardKeys(
    sp=f"{REF}.ulysses_sequence_parallel_size",
    remove_padding=f"{MODEL}.use_remove_padding",
    dynamic=f"{REF}.log_prob_use_dynamic_bsz",
    micro=f"{REF}.log_prob_micro_batch_size_per_gpu",
    global_micro=f"{REF}.log_prob_micro_batch_size",
    max_token_len=f"{REF}.log_prob_max_token_len_per_gpu",
    packing=f"{ACTOR}.packing_algorithm",
)
CRITIC_KEYS = UpdateKeys(
    sp="critic.ulysses_sequence_parallel_size",
    remove_padding="critic.model.use_remove_padding",
    mini="critic.ppo_mini_batch_size",
    epochs="critic.ppo_epochs",
    dynamic="critic.use_dynamic_bsz",
    micro="critic.ppo_micro_batch_size_per_gpu",
    global_micro="critic.ppo_micro_batch_size",
    max_token_len="critic.ppo_max_token_len_per_gpu",
    packing="critic.packing_algorithm",
    forward=ForwardKeys(
        sp="critic.ulysses_sequence_parallel_size",
        remove_padding="critic.model.use_remove_padding",
        dynamic="critic.use_dynamic_bsz",
        micro="critic.forward_micro_batch_size_per_gpu",
        global_micro="critic.forward_micro_batch_size",
        max_token_len="critic.forward_max_token_len_per_gpu",
        packing="critic.packing_algorithm",
    ),
)


def get(cfg: Any, key: str) -> Any:
    """`cfg[key]` for a dotted key of a DictConfig or a typed config; a missing key is a ValueError naming it."""
    if isinstance(cfg, DictConfig):
        value = OmegaConf.select(cfg, key, default="<missing>")
    else:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part, "<missing>")
    if isinstance(value, str) and value == "<missing>":
        raise ValueError(f"{key} is missing from the config")
    return value


def get_bool(cfg: Any, key: str) -> bool:
    """A config key that must be true or false."""
    value = get(cfg, key)
    if not isinstance(value, bool):
        raise ValueError(f"{key} = {value!r} must be true or false")
    return value


def ref_enabled(cfg: Any) -> bool:
    """A reference model is loaded for a KL loss or a KL penalty in the reward."""
    return get_bool(cfg, f"{ACTOR}.use_kl_loss") or get_bool(cfg, "algorithm.use_kl_in_reward")


def critic_enabled(cfg: Any) -> bool:
    """Only GAE learns a value function."""
    return get(cfg, "algorithm.adv_estimator") == "gae"


def micro_batch_inactive(cfg: Any, keys: ForwardKeys | UpdateKeys, what: str) -> dict[str, str]:
    """Static micro size vs token budget: exactly one of the two applies ({key: reason} of the other).

    `cfg` is the typed root config; the packing key is left to the caller (several passes share it).
    """
    if get(cfg, keys.dynamic):
        because = f"{keys.dynamic}=true: {what} micro-batches are cut by {keys.max_token_len}"
        return {keys.micro: because, keys.global_micro: because}
    out = {keys.max_token_len: f"{keys.dynamic}=false: {what} micro-batches are cut by a sequence count"}
    unused = keys.global_micro if get(cfg, keys.global_micro) is None else keys.micro
    out[unused] = f"{what} micro-batches are cut by {keys.micro if unused == keys.global_micro else keys.global_micro}"
    return out
