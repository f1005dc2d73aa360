"""Advantage estimators: each returns (advantages, returns), both [bs, resp_len], zero outside response_mask.

An estimator receives, by name, the inputs its signature names (`compute_advantage`); of the
algorithm's keys (`ALGORITHM_KEYS`), it reads those (`algorithm_keys`), and the config reports the
others as without effect. Masked positions inside a response (e.g. tool output in multi-turn) are
transparent to the backward recursions: they neither add a time step nor reset the running sums.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable

import numpy as np
import torch

from rlframe.algorithms.masked import lookup, masked_sum, masked_whiten, register

logger = logging.getLogger(__name__)

ADV_ESTIMATORS: dict[str, Callable] = {}
# the `algorithm.*` keys the trainer passes every estimator by name; each reads those its signature names
ALGORITHM_KEYS = ("gamma", "lam", "norm_adv_by_std_in_grpo")
# the estimators that read π_t and Σπ² of the old-log-prob pass (actor.calculate_sum_pi_squared)
OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
# The largest |score| (and gdpo component) whose statistics stay finite in float32. The widest reduction a
# score enters is a sum of squared deviations: a group's std (grpo, grpo_passk, gdpo) over its n samples, or
# the batch whitening (gae, reinforce_plus_plus[_baseline], gdpo) over every response token. For N values of
# magnitude <= M each deviation from the mean is <= 2M, so that sum is <= 4·N·M², and 4·N·M² <= float32 max
# (~2**128) keeps it finite; with M = 2**48 that holds for N up to 2**29 values (2 GiB per float32 tensor, beyond
# any batch), with a factor 2 to spare for rounding. Sums, means and leave-one-out baselines (rloo, opo, gpg)
# stay far from overflow at this M.
MAX_ABS_SCORE = 2.0**48


def register_adv_estimator(name: str) -> Callable:
    """Decorator: make an advantage estimator available as `algorithm.adv_estimator=name`."""
    return register(ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator_fn(name: str) -> Callable:
    """The advantage estimator registered as `name`."""
    return lookup(ADV_ESTIMATORS, "advantage estimator", name)


def adv_estimator_help() -> str:
    """The adv_estimator key's help: every registered estimator."""
    return " | ".join(ADV_ESTIMATORS) + " (docs/algorithms.md)"


def algorithm_keys(name: str) -> tuple[str, ...]:
    """The `algorithm.*` keys estimator `name` reads: the ALGORITHM_KEYS it takes."""
    return tuple(_taken(get_adv_estimator_fn(name), ALGORITHM_KEYS))


def compute_advantage(adv_estimator: str, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named `adv_estimator`, passing it only the `inputs` its signature names."""
    fn = get_adv_estimator_fn(adv_estimator)
    return fn(**{name: inputs[name] for name in _taken(fn, inputs)})


def _taken(fn: Callable, names) -> list[str]:
    """Of `names`, those estimator `fn` takes (all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return list(names)
    return [name for name in names if name in params]


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
    advantages = _grpo_normalized(scores, index, epsilon, norm_adv_by_std_in_grpo).unsqueeze(-1) * response_mask
    return advantages, advantages


def _grpo_normalized(scores, index, epsilon, norm_by_std):
    """(s_i − mean_g) / (std_g + ε) per sample ([bs]); a group of one uses mean 0, std 1."""
    size, _, mean, std = _group_stats(scores, index)
    single = size < 2
    mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
    return (scores - mean) / (std + epsilon) if norm_by_std else scores - mean


@register_adv_estimator("gdpo")
def compute_gdpo_outcome_advantage(response_mask, index, gdpo_scores, gdpo_reward_weights=None):
    """GDPO (Group reward-Decoupled normalization Policy Optimization, arXiv 2601.05242, as verl 0.9.1):
    each reward component k is normalized within its groups on its own, A_k = (s_k − mean_g) / (std_g + 1e-6)
    (`grpo`'s form; a group of one: s_k), and the batch whitening of Σ_k w_k A_k over the valid tokens is the
    advantage, so that a dominant component does not drown out the others. `gdpo_scores` [bs, K] are the
    components named by `algorithm.gdpo_reward_keys` (entries of the scorer's dict), taken in fp32;
    w = `algorithm.gdpo_reward_weights` (1 each when null). As in verl, every sample's components enter its
    group's statistics, an empty or fully masked response's too, and std normalization always applies (verl
    never passes gdpo `norm_adv_by_std_in_grpo`).
    """
    scores = gdpo_scores.to(torch.float32)
    total = scores.new_zeros(scores.shape[0])
    for k in range(scores.shape[-1]):
        weight = torch.tensor(1.0 if gdpo_reward_weights is None else float(gdpo_reward_weights[k]))
        total = total + weight * _grpo_normalized(scores[:, k], index, 1e-6, True)
    advantages = total.unsqueeze(-1) * response_mask  # verl: the sum of the components' masked advantages
    advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


def gdpo_component_scores(extra_info: dict, keys, batch_size: int) -> torch.Tensor:
    """[bs, K] fp32: the scorer's per-sample entries named by `algorithm.gdpo_reward_keys`, in that order."""
    columns = []
    for key in keys:
        if key not in extra_info:
            raise ValueError(
                f"algorithm.gdpo_reward_keys names {key!r}, which the reward function did not return; it returned "
                f"{sorted(extra_info) or 'no extra entries'}: return a dict with {key!r} from compute_score "
                "(or name one of those)"
            )
        if len(extra_info[key]) != batch_size:
            raise ValueError(
                f"algorithm.gdpo_reward_keys: {key!r} has {len(extra_info[key])} values, not one per sample"
            )
        values = np.array([_component(value, key, row) for row, value in enumerate(extra_info[key])])
        # NaN, or a value past MAX_ABS_SCORE (inf or NaN in the group's std), would spread through the group's
        # statistics and the batch whitening to every sample
        missing = ~(np.abs(values) <= MAX_ABS_SCORE)
        if missing.any():
            logger.warning(
                "algorithm.gdpo_reward_keys: %d of %d samples have no usable %r (their scorer failed, or returned "
                "no such key, NaN, inf or a value beyond ±%.3g = 2**48); it counts as 0 for them, as a failed "
                "sample's score does",
                int(missing.sum()),
                batch_size,
                key,
                MAX_ABS_SCORE,
            )
            values[missing] = 0.0
        columns.append(torch.from_numpy(values.astype(np.float32)))
    return torch.stack(columns, dim=-1)


def _component(value, key: str, row: int) -> float:
    """One sample's reward component as a float (NaN when absent); text or other values are an error."""
    if value is None:
        return math.nan
    if isinstance(value, (numbers.Real, np.bool_)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float64
            return math.inf
    text = repr(value)
    raise ValueError(
        f"algorithm.gdpo_reward_keys: {key!r} of sample {row} is {type(value).__name__} {text[:60]}; "
        "a reward component must be a number"
    )


def gdpo_metrics(gdpo_scores: torch.Tensor, keys) -> dict[str, float]:
    """verl 0.9.1's `gdpo/<key>/{mean,std,max,min}` of each component over the step's batch (population std)."""
    out = {}
    for key, column in zip(keys, gdpo_scores.unbind(-1)):
        values = column.numpy()
        stats = {"mean": np.mean(values), "std": np.std(values), "max": np.max(values), "min": np.min(values)}
        out.update({f"gdpo/{key}/{name}": float(value) for name, value in stats.items()})
    return out


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


@register_adv_estimator("grpo_vectorized")
def compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    """verl's vectorized GRPO: GRPO with std normalization, always.

    verl 0.9.1's trainer does not pass `norm_adv_by_std_in_grpo` to this estimator, so it always
    divides by the group std; rlframe reports that key as without effect here.
    """
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, True)


@register_adv_estimator("rloo_vectorized")
def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index):
    """verl's vectorized RLOO: as `rloo`, except that a group of size 1 gets advantage 0 (not its score)."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    size, total, _, _ = _group_stats(scores, index)
    baseline = (total - scores) / (size - 1).clamp(min=1)
    advantages = torch.where(size > 1, scores - baseline, 0.0).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("opo")
def compute_opo_outcome_advantage(token_level_rewards, response_mask, index):
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585): the score
    minus the group's length-weighted mean score b_g = Σ_j |o_j| s_j / Σ_j |o_j| (0 for a group of one;
    0 for a group whose responses are all empty, where verl divides 0 by 0).
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    size, length_sum, _, _ = _group_stats(lengths, index)
    _, weighted_sum, _, _ = _group_stats(lengths * scores, index)
    baseline = torch.where(size > 1, weighted_sum / length_sum.clamp(min=1), 0.0)
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("gpg")
def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index):
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline", arXiv 2504.02546):
    α·(s_i − mean_g) with α = B / (number of samples with a non-zero score), B the batch size — the
    correction for groups whose samples all score alike (they add no gradient). No std division;
    a group of one uses mean 0.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    size, _, mean, _ = _group_stats(scores, index)
    # in the scores' dtype (verl 0.9.1 divides two integers into an fp32 α)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    advantages = (alpha * (scores - mean.masked_fill(size < 2, 0.0))).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True
):
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595, as verl implements it): in each group only
    the best sample gets an advantage, r_max − r_second (divided by the group's unbiased std + ε when
    `norm_adv_by_std_in_grpo`); ties for the best give 0. Every group needs ≥ 2 samples.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    size, _, _, std = _group_stats(scores, index)
    if (size < 2).any():
        raise ValueError(
            "algorithm.adv_estimator=grpo_passk needs at least 2 samples per prompt "
            "(actor_rollout_ref.rollout.n >= 2); a group has 1"
        )
    advantages = torch.zeros_like(scores)
    for rows in _group_rows(index).values():
        group = scores[rows]
        top = torch.topk(group, 2)
        gap = top.values[0] - top.values[1]
        if norm_adv_by_std_in_grpo:
            gap = gap / (std[rows[0]] + epsilon)
        advantages[rows[int(top.indices[0])]] = gap
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def _group_rows(index: np.ndarray) -> dict:
    """uid -> the row indices of its samples, in batch order."""
    rows: dict = {}
    for i, uid in enumerate(index):
        rows.setdefault(uid, []).append(i)
    return rows


@register_adv_estimator("optimal_token_baseline")
def compute_optimal_token_baseline_advantage(
    token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None, epsilon=1e-8
):
    """Optimal Token Baseline (verl 0.9.1; Yingru Li, "The Optimal Token Baseline"): a per-step baseline
    B_t = Σ_i G_{i,t} W_{i,t} / (Σ_i W_{i,t} + ε) over the valid tokens of a prompt group, where
    G_t is the reward-to-go and W_t = Σ_{j≤t} ρ̄_j² (1 − 2π_j + Σ_v π(v)²) the cumulative path-variance
    proxy (π_j = exp(old_log_probs), Σπ² = `sum_pi_squared` from the actor's old-log-prob pass; ρ̄_j the
    rollout-correction IS weight `rollout_is_weights`, 1 without it). The sum runs over the valid
    tokens j ≤ t only: a masked position (a hole, a cut prefix) adds nothing to W, and its own W_t
    does not enter the baseline's sums.
    A_t = G_t − B_t. A group of one has no baseline; in a group whose longest response is longer
    than all others, that response's baseline is 0 beyond the second-longest length.
    Returns (advantages, reward-to-go).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _reward_to_go(token_level_rewards, mask)
    path_variance = _path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, mask)
    baselines = _otb_baselines(returns, path_variance * mask, mask.sum(-1), _group_rows(index).values(), epsilon)
    advantages = (returns - baselines) * mask
    return advantages, returns


@register_adv_estimator("tir_optimal_token_baseline")
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None, epsilon=1e-8
):
    """Optimal Token Baseline for tool-integrated (multi-turn) responses (verl 0.9.1's
    `tir_optimal_token_baseline`): `optimal_token_baseline` with time counted in the response's own
    tokens. Each response's valid tokens are packed together (tool-output holes removed), so that B_k
    averages the group's k-th generated tokens rather than the tokens at one position:
    B_k = Σ_i G_{i,(k)} W_{i,(k)} / (Σ_i W_{i,(k)} + ε) over the responses that have a k-th valid token, with
    G the reward-to-go and W the cumulative path variance ρ̄²(1 − 2π + Σπ²) as in `optimal_token_baseline`.
    A_(k) = G_(k) − B_k. Empty responses join no group; a group of one has no baseline; a unique
    longest response gets B = 0 from the second-longest's token count on. Returns (advantages, reward-to-go).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    valid = mask.bool()
    lengths = valid.sum(-1)
    returns = _reward_to_go(token_level_rewards, mask)
    packed_returns = _pack_valid(returns, valid)
    packed_variance = _pack_valid(_path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, mask), valid)
    groups = [[i for i in rows if lengths[i] > 0] for rows in _group_rows(index).values()]
    baselines = _otb_baselines(packed_returns, packed_variance, lengths, groups, epsilon)
    advantages = torch.zeros_like(returns)
    advantages[valid] = (packed_returns - baselines)[_packed_mask(lengths)]
    return advantages * mask, returns


def _reward_to_go(token_level_rewards, mask):
    """G_t = Σ_{u≥t} m_u r_u."""
    return (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def _path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, mask):
    """W_t = Σ_{j≤t, m_j=1} ρ̄_j² ‖s_j‖²: the cumulative path-variance proxy over the valid tokens."""
    return (_per_token_path_variance(old_log_probs, sum_pi_squared, rollout_is_weights) * mask).cumsum(-1)


def _otb_baselines(returns, weight, lengths, groups, epsilon):
    """Per-step baselines Σ_i G_i W_i / (Σ_i W_i + ε) within each group of ≥ 2 rows (0 elsewhere).

    `weight` is 0 where a row has no token; in a group whose longest row (by `lengths`) is longer than all
    others, that row's baseline is 0 from the second-longest length on.
    """
    baselines = torch.zeros_like(returns)
    for rows in groups:
        if len(rows) < 2:
            continue
        rows = torch.tensor(rows, device=returns.device)
        baselines[rows] = (returns[rows] * weight[rows]).sum(0) / (weight[rows].sum(0) + epsilon)
        longest, second = torch.topk(lengths[rows], 2).values.tolist()
        if longest > second:
            baselines[rows[lengths[rows].argmax()], int(second) :] = 0.0
    return baselines


def _packed_mask(lengths):
    """[bs, max length]: the first `lengths[i]` positions of row i."""
    return torch.arange(int(lengths.max()) if len(lengths) else 0, device=lengths.device) < lengths.unsqueeze(-1)


def _pack_valid(values, valid):
    """Each row's values at its valid positions, moved to the front in order (zeros after), [bs, max length]."""
    packed_mask = _packed_mask(valid.sum(-1))
    packed = values.new_zeros(packed_mask.shape)
    packed[packed_mask] = values[valid]
    return packed


def _per_token_path_variance(old_log_probs, sum_pi_squared, rollout_is_weights):
    """‖s_j‖² = 1 − 2π_j + Σπ², scaled by ρ̄_j² under rollout-correction IS weights (verl 0.9.1: the
    variance of the IS-weighted score, so the baseline minimises the MSE of the truncated-IS gradient)."""
    variance = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        variance = variance * rollout_is_weights.square()
    return variance
