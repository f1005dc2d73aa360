"""Advantage estimators: each returns (advantages, returns), both [bs, resp_len], zero outside response_mask.

Masked positions inside a response (e.g. tool output in multi-turn) are transparent to the backward
recursions: they neither add a time step nor reset the running sums.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch

from rlframe.algorithms.masked import lookup, masked_sum, masked_whiten, register

ADV_ESTIMATORS: dict[str, Callable] = {}


def register_adv_estimator(name: str) -> Callable:
    """Decorator: make an advantage estimator available as `algorithm.adv_estimator=name`."""
    return register(ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator_fn(name: str) -> Callable:
    """The advantage estimator registered as `name`."""
    return lookup(ADV_ESTIMATORS, "advantage estimator", name)


def compute_advantage(adv_estimator: str, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named `adv_estimator`, passing it only the `inputs` its signature names."""
    fn = get_adv_estimator_fn(adv_estimator)
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        inputs = {k: v for k, v in inputs.items() if k in params}
    return fn(**inputs)


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score per sequence: the sum of its masked token rewards, [bs]."""
    return masked_sum(token_level_rewards, response_mask, axis=-1)


def _group_stats(scores: torch.Tensor, index: np.ndarray):
    """Per-sample (group size, group sum, group mean, unbiased group std) for groups given by uid."""
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} uids but the batch has {scores.shape[0]} samples")
    group_of: dict = {}
    group = torch.tensor([group_of.setdefault(uid, len(group_of)) for uid in index], device=scores.device)
    zeros = scores.new_zeros(len(group_of))
    size = zeros.index_add(0, group, torch.ones_like(scores))[group]
    total = zeros.index_add(0, group, scores)[group]
    mean = total / size
    sq_dev = zeros.index_add(0, group, (scores - mean) ** 2)[group]
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    return size, total, mean, std


@register_adv_estimator("gae")
def compute_gae_advantage_return(token_level_rewards, response_mask, values, gamma, lam):
    """Generalized advantage estimation (Schulman et al. 2016); advantages are whitened over the batch.

    returns = raw advantages + values (the critic's target).
    """
    mask = response_mask.to(values.dtype)
    next_value = values.new_zeros(values.shape[0])
    running_adv = values.new_zeros(values.shape[0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        running_adv = m * (delta + gamma * lam * running_adv) + (1 - m) * running_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = running_adv
    returns = (advantages + values) * mask
    advantages = masked_whiten(advantages, response_mask) * mask
    return advantages, returns


@register_adv_estimator("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True
):
    """GRPO: (score - group mean) / (group std + eps), or Dr.GRPO without the std division.

    A group of size 1 uses mean 0 and std 1, so its advantage is its raw score.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    size, _, mean, std = _group_stats(scores, index)
    single = size < 2
    mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
    advantages = scores - mean
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (std + epsilon)
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("rloo")
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index):
    """RLOO: score minus the mean score of the *other* samples of its group (0 baseline if alone)."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    size, total, _, _ = _group_stats(scores, index)
    baseline = torch.where(size > 1, (total - scores) / (size - 1).clamp(min=1), 0.0)
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma):
    """REINFORCE++: discounted reward-to-go per token, whitened over all tokens of the batch."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        running = m * (token_level_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running
    returns = returns * mask
    advantages = masked_whiten(returns, response_mask) * mask
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index):
    """REINFORCE++ with baseline: score minus its group mean, broadcast to tokens, batch-whitened."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    size, _, mean, _ = _group_stats(scores, index)
    centered = (scores - mean.masked_fill(size < 2, 0.0)).unsqueeze(-1) * response_mask
    advantages = masked_whiten(centered, response_mask) * response_mask
    return advantages, advantages


@register_adv_estimator("remax")
def compute_remax_outcome_advantage(token_level_rewards, response_mask, reward_baselines):
    """ReMax: undiscounted reward-to-go minus the greedy rollout's score (`reward_baselines`, [bs])."""
    rewards = torch.where(response_mask.bool(), token_level_rewards, 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * response_mask
    advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns
