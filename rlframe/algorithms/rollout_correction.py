"""Rollout correction: importance weights and rejection between the rollout engine's policy and the trainer's.

The rollout engine samples from π_rollout (e.g. vLLM in bf16) while the trainer scores with π_old
(FSDP in fp32); their gap makes the data off-policy. verl 0.9.1's `algorithm.rollout_correction`
(Liu, Li, Fu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch") corrects it, and this module holds its math on [bs, len] tensors
with log r_t = log π_old(y_t) − log π_rollout(y_t):

- IS weights (`rollout_is`): token level w_t = r_t, or sequence level w = Π_t r_t = exp(Σ_t log r_t),
  both with log r clamped to ±20 before exp. A single threshold U truncates (TIS: min(w, U)); a
  "lower_upper" threshold zeroes weights outside [L, U] (IcePop). Weights are constants (no gradient).
- batch normalization (`rollout_is_batch_normalize`): w / mean(w), the mean over valid tokens
  (token level) or over sequences with a valid token (sequence level) of the whole batch.
- rejection (`rollout_rs`, comma-separated options all of which must pass): per token or per
  sequence divergences k1 = −log r, k2 = ½(log r)², k3 = r − 1 − log r, aggregated by sum, mean or
  max over the sequence; k1 options take ratio bounds "lower_upper" (a single U means 1/U_U), the
  others an upper bound. Rejected tokens leave the response mask.
- off-policy diagnostics (KL, k3-KL, perplexities, χ²) and verl's metric names (`rollout_corr/*`).
- bypass mode: π_old := π_rollout (no old-log-prob pass); the actor's loss is PPO-clip on
  π_θ/π_rollout or REINFORCE with the IS weights of π_θ/π_rollout (`compute_policy_loss_reinforce`).

Batch normalization of a whole batch needs the batch's mean: on the driver (decoupled mode) the whole
batch is at hand; in the actor (bypass mode) `normalizer_sums` gives each micro-batch's part of the
mean's numerator and denominator, which the worker sums over micro-batches and DP ranks.

The keys (`RolloutCorrectionConfig`) and their parsed form (`RolloutCorrection`, built once when the driver
and the actor are built) are in `rlframe/algorithms/config.py`; the functions here take parsed numbers.
"""

from __future__ import annotations

import math

import torch

from rlframe.algorithms.config import IS_LEVELS, RolloutCorrection
from rlframe.algorithms.loss import Aggregation, PolicyLossArgs, compute_policy_loss_vanilla
from rlframe.algorithms.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # |log r| is clamped here before exp (exp(20) ≈ 4.9e8)
PREFIX = "rollout_corr/"


# ───────────────────────────── IS weights ─────────────────────────────


def _masked_max(values, mask, axis=None):
    return values.masked_fill(~mask.bool(), float("-inf")).amax() if axis is None else _seq_max(values, mask)


def _seq_max(values, mask):
    out = values.masked_fill(~mask.bool(), float("-inf")).amax(dim=-1)
    return torch.where(torch.isinf(out) & (out < 0), torch.zeros_like(out), out)


def _masked_min(values, mask):
    return values.masked_fill(~mask.bool(), float("inf")).amin()


def is_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, bounds: tuple[float, float | None]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated (TIS) or range-masked (IcePop) IS weights [bs, len], zero on padding, and their metrics.

    `bounds` is (upper, lower or None), as `parse_is_threshold` gives it.
    """
    upper, lower = bounds
    mask = response_mask.to(log_ratio.dtype)
    if level == "token":
        log_for_metrics = log_ratio
        raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    elif level == "sequence":
        log_for_metrics = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        raw = log_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}; valid: null, {', '.join(IS_LEVELS)}")
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, log_for_metrics, response_mask, level, upper, lower)
    if lower is not None:
        outside = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = masked_mean(outside.float(), response_mask).item()
    return weights.detach(), metrics


def _is_metrics(weights, raw, log_for_metrics, response_mask, level, upper, lower) -> dict[str, float]:
    """verl 0.9.1's rollout_is_* metrics (before batch normalization)."""
    lower_bound = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": masked_mean(weights, response_mask).item()}
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(log_for_metrics.max().item(), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(log_for_metrics.min().item())
        m["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(upper)).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_for_metrics < math.log(lower_bound)).float().mean().item()
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), response_mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower_bound).float(), response_mask).item()
        m["rollout_is_max"] = _masked_max(weights, response_mask).item()
        m["rollout_is_min"] = _masked_min(weights, response_mask).item()
    bounded = weights.clamp(min=0.0, max=upper)
    mean = masked_mean(bounded, response_mask)
    if response_mask.sum() > 1:
        var = masked_mean(bounded.square(), response_mask) - mean.square()
        m["rollout_is_std"] = var.clamp(min=0.0).sqrt().item()
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean((bounded / (mean + 1e-8)).square(), response_mask).item()
    seq_means = masked_mean(weights, response_mask, axis=-1)
    m["rollout_is_seq_mean"] = seq_means.mean().item()
    m["rollout_is_seq_std"] = seq_means.std().item() if seq_means.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_means.max().item()
    m["rollout_is_seq_min"] = seq_means.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_means - 1.0).abs().max().item()
    raw_seq_means = masked_mean(raw, response_mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = (raw_seq_means > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq_means < lower_bound).float().mean().item()
    return m


def normalizer_sums(
    weights: torch.Tensor, response_mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ weights, count) whose ratio is the batch-normalization mean; sums over any split add up.

    Token level: over valid tokens. Sequence level: each sequence's weight (its valid tokens' mean)
    over sequences with a valid token.
    """
    if level == "token":
        return masked_sum(weights, response_mask), response_mask.sum().to(weights.dtype)
    valid = (response_mask.sum(dim=-1) > 0).to(weights.dtype)
    return (masked_mean(weights, response_mask, axis=-1) * valid).sum(), valid.sum()


def normalize_weights(weights: torch.Tensor, total: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, float]:
    """weights / (total / count), and the factor; weights stay as they are when the mean is ≤ 1e-8."""
    mean = total / count.clamp(min=1e-8)
    if mean > 1e-8:
        return weights / mean, float(mean)
    return weights, 1.0


# ───────────────────────────── rejection ─────────────────────────────


def _divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": safe.exp() - 1.0 - safe}


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, bounds: dict[str, tuple[float | None, float]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with rejected tokens removed (every option must pass), and verl's rollout_rs_* metrics.

    `bounds` maps each option, in order, to its (lower or None, upper), as `parse_rs_thresholds` gives it.
    """
    divergence = _divergences(log_ratio)
    valid = response_mask.bool()
    seq_valid = valid.any(dim=-1)
    keep_all = torch.ones_like(log_ratio)
    metrics: dict[str, float] = {}
    for option, (lower, upper) in bounds.items():
        token_stat = divergence[option[-2:]]
        # k1 bounds a ratio: its statistic −log r is compared with the logs of the bounds
        low, high = (math.log(lower), math.log(upper)) if lower is not None else (None, upper)
        if option.startswith("token"):
            seq_stat, stat = None, token_stat
        else:
            aggregate = option.split("_")[1]
            if aggregate == "sum":
                seq_stat = masked_sum(token_stat, response_mask, axis=-1)
            elif aggregate == "mean":
                seq_stat = masked_mean(token_stat, response_mask, axis=-1)
            else:
                seq_stat = _seq_max(token_stat, response_mask)
            stat = seq_stat.unsqueeze(-1).expand_as(log_ratio)
        keep = stat <= high if low is None else (stat >= low) & (stat <= high)
        keep_f = keep.to(log_ratio.dtype)
        keep_all = keep_all * keep_f
        metrics.update(_rs_metrics(option, stat, seq_stat, response_mask, seq_valid, low, high))
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_f, response_mask).item()
        seq_kept = (keep | ~valid).all(dim=-1)
        seq_count = seq_valid.sum()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            ((~seq_kept) & seq_valid).sum().item() / seq_count.item() if seq_count > 0 else 0.0
        )
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep_all, response_mask).item()
    rejected_in_seq = (~((keep_all > 0.5) & valid) & valid).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = rejected_in_seq.float().mean().item()
    return (response_mask * keep_all).to(response_mask.dtype), metrics


def _rs_metrics(option, stat, seq_stat, response_mask, seq_valid, low, high) -> dict[str, float]:
    """verl 0.9.1's rollout_rs_<option>_* metrics of one rejection option."""
    p = f"rollout_rs_{option}"
    m = {f"{p}_mean": masked_mean(stat, response_mask).item()}
    seq_values = (masked_mean(stat, response_mask, axis=-1) if seq_stat is None else seq_stat)[seq_valid]
    low_bound = 0.0 if low is None else low
    if seq_stat is not None and seq_values.numel() > 0:
        m[f"{p}_max"], m[f"{p}_min"] = seq_values.max().item(), seq_values.min().item()
        m[f"{p}_fraction_high"] = (seq_values > high).float().mean().item()
        m[f"{p}_fraction_low"] = (seq_values < low_bound).float().mean().item() if low is not None else 0.0
    else:
        m[f"{p}_max"], m[f"{p}_min"] = _masked_max(stat, response_mask).item(), _masked_min(stat, response_mask).item()
        m[f"{p}_fraction_high"] = masked_mean((stat > high).float(), response_mask).item()
        m[f"{p}_fraction_low"] = (
            masked_mean((stat < low_bound).float(), response_mask).item() if low is not None else 0.0
        )
    if response_mask.sum() > 1:
        bounded = stat.clamp(min=low_bound, max=high)
        var = masked_mean(bounded.square(), response_mask) - masked_mean(bounded, response_mask).square()
        m[f"{p}_std"] = var.clamp(min=0.0).sqrt().item()
    else:
        m[f"{p}_std"] = 0.0
    if seq_values.numel() > 0:
        m[f"{p}_seq_mean"] = seq_values.mean().item()
        m[f"{p}_seq_std"] = seq_values.std().item() if seq_values.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = seq_values.max().item(), seq_values.min().item()
        m[f"{p}_seq_max_deviation"] = seq_values.abs().max().item()
        m[f"{p}_seq_fraction_high"] = (seq_values > high).float().mean().item()
        if low is not None:
            m[f"{p}_seq_fraction_low"] = (seq_values < low).float().mean().item()
    else:
        for name in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high"):
            m[f"{p}_{name}"] = 0.0
        m[f"{p}_seq_fraction_low"] = 0.0
    return m


# ───────────────────────────── diagnostics ─────────────────────────────


def offpolicy_metrics(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """KL(π_rollout‖π), its k3 estimate, both perplexities, their log difference and ratio, token and sequence χ²."""
    mean_lp = masked_mean(log_prob, response_mask, axis=-1)
    mean_rollout_lp = masked_mean(rollout_log_prob, response_mask, axis=-1)
    log_ratio = log_prob - rollout_log_prob
    log_ppl_diff = mean_rollout_lp - mean_lp
    rho = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": (-mean_lp).exp().mean().item(),
        "training_log_ppl": (-mean_lp).mean().item(),
        "kl": masked_mean(rollout_log_prob - log_prob, response_mask).item(),
        "k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1, response_mask).item(),
        "rollout_ppl": (-mean_rollout_lp).exp().mean().item(),
        "rollout_log_ppl": (-mean_rollout_lp).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": log_ppl_diff.max().item(),
        "log_ppl_diff_min": log_ppl_diff.min().item(),
        "ppl_ratio": log_ppl_diff.exp().mean().item(),
        "chi2_token": (masked_mean(rho.square(), response_mask) - 1.0).item(),
        "chi2_seq": ((2.0 * seq_log_ratio).exp().mean() - 1.0).item(),
    }


# ───────────────────────────── the whole correction ─────────────────────────────


def rollout_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    correction: RolloutCorrection,
    normalizer: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, response mask after rejection, `rollout_corr/*` metrics) for one batch.

    `log_prob` is the trainer's (π_old, or π_θ in bypass mode); `correction` is
    `algorithm.rollout_correction`, parsed. With batch normalization the weights are divided by the mean
    over this batch, or by `normalizer` = (Σ weights, count) of a larger batch this one is part of.
    """
    if not response_mask.any():
        raise ValueError("rollout correction needs at least one valid response token in the batch")
    log_ratio = log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if correction.rollout_is is not None:
        weights, is_metrics = is_weights(log_ratio, response_mask, correction.rollout_is, correction.is_bounds)
        metrics.update(is_metrics)
        if correction.rollout_is_batch_normalize:
            total, count = normalizer or normalizer_sums(weights, response_mask, correction.rollout_is)
            weights, metrics["rollout_is_batch_norm_factor"] = normalize_weights(weights, total, count)
    mask = response_mask
    if correction.rs_bounds:
        mask, rs_metrics = rejection_mask(log_ratio, response_mask, correction.rs_bounds)
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(log_prob, rollout_log_prob, response_mask))
    return weights, mask, {PREFIX + name: value for name, value in metrics.items()}


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    agg: Aggregation,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode's REINFORCE loss ℓ_t = −w_t·A_t·log π_θ(y_t) (w: constant IS weights, 1 without),
    aggregated by `agg`.

    Metric: ppo_kl = mean(log π_rollout − log π_θ) over the mask.
    """
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    ppo_kl = masked_mean(rollout_log_prob - log_prob, response_mask).detach()
    return agg(pg_losses, response_mask), {"ppo_kl": ppo_kl}


# metrics of the bypass-mode loss that are token means: a micro-batch's value weighted by its token share
# sums to the mini-batch's value (the others, maxima and sequence statistics, do not add up and are not reported)
BYPASS_TOKEN_MEAN_METRICS = ("kl", "k3_kl", "chi2_token", "rollout_is_mean", "rollout_rs_masked_fraction")


def bypass_policy_loss(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    correction: RolloutCorrection,
    args: PolicyLossArgs,
    normalizer: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode's actor loss (π_old = π_rollout): the correction of π_θ against π_rollout, then the loss.

    Rejection narrows the loss's mask; `loss_type=ppo_clip` is the vanilla loss under `args` on the
    ratio π_θ/π_rollout (the IS weights are not applied: the ratio is the correction), `reinforce` is
    `compute_policy_loss_reinforce` with the IS weights and `args.agg`, batch-normalized by `normalizer`
    = (Σ weights, count) of the whole mini-batch (`RolloutCorrection.needs_mini_batch_normalizer`). Returns (loss,
    metrics); the `rollout_corr/*` metrics are the token means among verl's (BYPASS_TOKEN_MEAN_METRICS).
    """
    if correction.needs_mini_batch_normalizer and normalizer is None:
        raise ValueError("bypass-mode batch normalization needs the mini-batch's normalizer")
    with torch.no_grad():
        weights, mask, metrics = rollout_correction(
            log_prob.detach(), rollout_log_prob, response_mask, correction, normalizer
        )
    if correction.loss_type == "reinforce":
        loss, _ = compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, mask, weights, args.agg)
    else:
        loss, _ = compute_policy_loss_vanilla(rollout_log_prob, log_prob, advantages, mask, args)
    # The loss's metrics over every response token, rejected ones included: the worker weights a
    # micro-batch's means by its share of the mini-batch's tokens before rejection, so only these add
    # up exactly (verl averages per-micro-batch means over the kept tokens).
    with torch.no_grad():
        if correction.loss_type == "reinforce":
            pg_metrics = {"ppo_kl": masked_mean(rollout_log_prob - log_prob, response_mask)}
        else:
            _, pg_metrics = compute_policy_loss_vanilla(rollout_log_prob, log_prob, advantages, response_mask, args)
    names = {PREFIX + name for name in BYPASS_TOKEN_MEAN_METRICS}
    kept = {name: torch.tensor(value) for name, value in metrics.items() if name in names}
    return loss, {**pg_metrics, **kept}


# verl 0.9.1's `actor.policy_loss.rollout_correction` when its trainer has not set it (the dataclass default of
# PolicyLossConfig; verl's trainer sets it to `algorithm.rollout_correction` only in bypass mode): sequence-level
# weights for the metrics, no rejection, PPO-clip
BYPASS_LOSS_DEFAULT = RolloutCorrection(rollout_is="sequence", is_bounds=(2.0, None))


def probs_diff_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl's `training/rollout_*` diagnostics: |p_old − p_rollout| over valid tokens, and their Pearson r."""
    prefix = "training/rollout_probs_diff_"
    valid = response_mask.bool()
    if not valid.any():
        nan = float("nan")
        out = {f"{prefix}{name}": nan for name in ("max", "mean", "std")}
        return {f"{prefix}valid": 0, **out, "training/rollout_actor_probs_pearson_corr": nan}
    old_p, rollout_p = old_log_prob.exp()[valid], rollout_log_prob.exp()[valid]
    diff = (old_p - rollout_p).abs()
    return {
        f"{prefix}valid": 1,
        f"{prefix}max": diff.max().item(),
        f"{prefix}mean": diff.mean().item(),
        f"{prefix}std": diff.std().item(),
        "training/rollout_actor_probs_pearson_corr": torch.corrcoef(torch.stack([old_p, rollout_p]))[0, 1].item(),
    }
