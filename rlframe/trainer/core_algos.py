"""The math of RL for language models: advantages, KL penalties, loss aggregation, policy and
value losses.

Everything here is a pure torch function on padded [batch, response_len] tensors with a
0/1 `response_mask`; nothing here knows about ranks or micro-batches. Exactness under gradient
accumulation and data parallelism comes from `agg_loss` taking the *global* token/sequence counts
of the mini-batch from its caller (see its docstring). Formulas are in docs/algorithms.md.

Estimators, policy losses and KL penalties are looked up by name (`get_adv_estimator_fn`,
`get_policy_loss_fn`, `get_kl_penalty_fn`); an unknown name raises ValueError listing the valid ones.
"""

from __future__ import annotations

import inspect
from typing import Callable

import numpy as np
import torch

# ───────────────────────────── masked helpers ─────────────────────────────


def _sum(x: torch.Tensor, axis: int | None) -> torch.Tensor:
    return x.sum() if axis is None else x.sum(dim=axis)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set (masked entries may hold NaN/inf; they are ignored)."""
    return _sum(torch.where(mask.bool(), values, 0.0), axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is set; 0 (not NaN) where nothing is set."""
    count = _sum(mask.bool(), axis).clamp(min=1)
    return masked_sum(values, mask, axis) / count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries; Bessel-corrected when `unbiased` and there are ≥ 2 of them."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.bool().sum()
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Scale `values` to unit variance over the masked entries; also center them if `shift_mean`."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


# ───────────────────────────── registries ─────────────────────────────


def _register(registry: dict, kind: str, name: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        if name in registry and registry[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered")
        registry[name] = fn
        return fn

    return decorator


def _lookup(registry: dict, kind: str, name: str) -> Callable:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(registry))}")
    return registry[name]


ADV_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}
KL_PENALTIES: dict[str, Callable] = {}
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def register_adv_estimator(name: str) -> Callable:
    """Decorator: make an advantage estimator available as `algorithm.adv_estimator=name`."""
    return _register(ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator_fn(name: str) -> Callable:
    """The advantage estimator registered as `name`."""
    return _lookup(ADV_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable:
    """Decorator: make a policy loss available by `name`."""
    return _register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered as `name`."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


def get_kl_penalty_fn(name: str) -> Callable:
    """The per-token KL estimator `fn(logprob, ref_logprob)` registered as `name`."""
    return _lookup(KL_PENALTIES, "kl penalty", name)


# ───────────────────────────── advantage estimators ─────────────────────────────
# Each returns (advantages, returns), both [bs, resp_len] and zero outside response_mask.
# Masked positions inside a response (e.g. tool output in multi-turn) are transparent to the
# backward recursions: they neither add a time step nor reset the running sums.


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
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
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


# ───────────────────────────── KL penalties ─────────────────────────────
# Per-token estimators of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL divergence").


def _register_kl(*names: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        for name in names:
            _register(KL_PENALTIES, "kl penalty", name)(fn)
        return fn

    return decorator


@_register_kl("kl", "k1")
def _kl_k1(logprob, ref_logprob):
    return logprob - ref_logprob


@_register_kl("abs")
def _kl_abs(logprob, ref_logprob):
    return (logprob - ref_logprob).abs()


@_register_kl("mse", "k2")
def _kl_k2(logprob, ref_logprob):
    return 0.5 * (logprob - ref_logprob).square()


@_register_kl("low_var_kl", "k3")
def _kl_k3(logprob, ref_logprob):
    # k3 = r - log r - 1 with r = π_ref/π: unbiased, non-negative, low variance. Clamping the
    # log-ratio keeps exp finite; clamping the result bounds the rare huge outliers.
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate of type `kl_penalty` (kl/k1, abs, mse/k2, low_var_kl/k3)."""
    return get_kl_penalty_fn(kl_penalty)(logprob, ref_logprob)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """KL coefficient steered toward `target_kl` (Ziegler et al. 2019, proportional control)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by 1 + clip(kl/target - 1, ±0.2) · n_steps / horizon."""
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


def make_kl_controller(kl_ctrl_type: str, kl_coef: float, target_kl: float | None = None,
                       horizon: int | None = None):
    """A `fixed` or `adaptive` KL controller (algorithm.kl_ctrl.type)."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None or horizon <= 0:
            raise ValueError(f"adaptive KL control needs target_kl and horizon > 0, got {target_kl=}, {horizon=}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl controller {kl_ctrl_type!r}; valid names: adaptive, fixed")


def apply_kl_penalty(token_level_scores, old_log_prob, ref_log_prob, response_mask, kl_ctrl,
                     kl_penalty="kl"):
    """Rewards = scores − β·KL per token; then updates `kl_ctrl` with this batch's KL.

    Returns (token_level_rewards, metrics); metrics hold the batch KL (mean over sequences of the
    per-sequence token mean) and the β that was applied (before the update), as floats.
    """
    kld = get_kl_penalty_fn(kl_penalty)(old_log_prob, ref_log_prob)
    kld = torch.where(response_mask.bool(), kld, 0.0)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


# ───────────────────────────── loss aggregation ─────────────────────────────


def agg_loss(loss_mat, loss_mask, loss_agg_mode, global_num_tokens=None, global_num_seqs=None,
             norm_factor=None):
    """Reduce a [bs, len] token loss to a scalar, normalized by mini-batch-wide counts.

    Modes (sums run over this call's rows; N_tok / N_seq are the counts of the whole mini-batch):
      token-mean               Σ masked token losses / N_tok
      seq-mean-token-sum       Σ_seq (Σ_tok loss) / N_seq
      seq-mean-token-mean      Σ_seq (Σ_tok loss / seq's own token count) / N_seq
      seq-mean-token-sum-norm  Σ masked token losses / (N_seq · norm_factor)   (Dr.GRPO)

    N_tok = `global_num_tokens`, the number of valid tokens, and N_seq = `global_num_seqs`, the
    number of sequences with at least one valid token, both counted over every micro-batch on
    every DP rank of the mini-batch. With those, the sum of agg_loss over any split of a
    mini-batch equals agg_loss on the whole, so gradient accumulation is exact. When a count is
    None the local one is used, which makes a single call on the whole batch the reference.

    DP: FSDP *averages* gradients over ranks, so each rank must multiply this loss by dp_size
    (the caller's job) for the all-reduced gradient to equal the whole mini-batch's gradient.

    `norm_factor` defaults to loss_mat.shape[-1]; pass the configured max response length when
    micro-batches can be padded to different widths (dynamic batching), or the split is inexact.
    Rows or batches with no valid token contribute 0, never NaN.
    """
    mask = loss_mask.bool()
    token_losses = torch.where(mask, loss_mat, 0.0)
    if loss_agg_mode == "token-mean":
        num_tokens = mask.sum() if global_num_tokens is None else global_num_tokens
        return token_losses.sum() / _at_least_one(num_tokens)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid names: {', '.join(LOSS_AGG_MODES)}")
    num_seqs = mask.any(dim=-1).sum() if global_num_seqs is None else global_num_seqs
    seq_sums = token_losses.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        total = seq_sums.sum()
    elif loss_agg_mode == "seq-mean-token-mean":
        total = (seq_sums / mask.sum(dim=-1).clamp(min=1)).sum()
    else:  # seq-mean-token-sum-norm
        total = seq_sums.sum() / (loss_mat.shape[-1] if norm_factor is None else norm_factor)
    return total / _at_least_one(num_seqs)


def _at_least_one(count):
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


# ───────────────────────────── policy and value losses ─────────────────────────────
# Policy losses share one signature and return (pg_loss, metrics). Metrics are detached 0-dim
# tensors (no device sync per micro-batch; the worker calls .item() once), computed as masked
# means over this call's tokens; the worker averages them over micro-batches.


def _ratio_metrics(log_ratio, loss_unclipped, loss_clipped, response_mask):
    return {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low,
                                clip_ratio_high, clip_ratio_c, loss_agg_mode, global_num_tokens=None,
                                global_num_seqs=None, norm_factor=None):
    """PPO clipped surrogate with ratio range [1 − clip_ratio_low, 1 + clip_ratio_high]; for
    negative advantages the loss is further capped at −A·clip_ratio_c (dual clip, Ye et al. 2020).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
    # Clamp before exp: a stale or diverged token must not turn the loss into inf/NaN.
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(loss_unclipped, loss_clipped)
    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)

    metrics = _ratio_metrics(log_ratio, loss_unclipped, loss_clipped, response_mask)
    lower_clipped = (negative & (clip_loss > dual_cap)).float()
    metrics["pg_clipfrac_lower"] = masked_mean(lower_clipped, response_mask).detach()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_num_tokens, global_num_seqs, norm_factor)
    return pg_loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low,
                             clip_ratio_high, clip_ratio_c, loss_agg_mode, global_num_tokens=None,
                             global_num_seqs=None, norm_factor=None):
    """GSPO (Zheng et al. 2025), token form: every token's ratio has the value of the sequence ratio
    exp(mean log π/π_old) and the gradient of its own log π (stop-grad trick). `clip_ratio_c` is
    unused; clip ranges are tiny (e.g. 3e-4/4e-4) and `seq-mean-token-mean` is the paper's mode.
    """
    token_log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, axis=-1).unsqueeze(-1)
    log_ratio = seq_log_ratio.detach() + log_prob - log_prob.detach()
    ratio = log_ratio.clamp(max=10.0).exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)

    metrics = _ratio_metrics(token_log_ratio, loss_unclipped, loss_clipped, response_mask)
    metrics["pg_clipfrac_lower"] = torch.zeros((), device=log_prob.device)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_num_tokens, global_num_seqs, norm_factor)
    return pg_loss, metrics


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean",
                       global_num_tokens=None, global_num_seqs=None, norm_factor=None):
    """Clipped value loss 0.5·max((v − R)², (clip(v, v_old ± c) − R)²); returns (vf_loss, vf_clipfrac).

    `cliprange_value=None` disables clipping; vf_clipfrac is a detached local masked mean.
    """
    losses_unclipped = (vpreds - returns).square()
    if cliprange_value is None:
        losses_clipped = losses_unclipped
    else:
        vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        losses_clipped = (vpreds_clipped - returns).square()
    vf_losses = 0.5 * torch.maximum(losses_unclipped, losses_clipped)
    vf_loss = agg_loss(vf_losses, response_mask, loss_agg_mode, global_num_tokens, global_num_seqs, norm_factor)
    vf_clipfrac = masked_mean((losses_clipped > losses_unclipped).float(), response_mask).detach()
    return vf_loss, vf_clipfrac


# ───────────────────────────── logits ─────────────────────────────


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] as gathered logit − logsumexp, never materializing log_softmax.

    Pass fp32 logits for exact numbers; the result has the logits' dtype and shape[:-1].
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp − Σ p·logit (stable for any scale)."""
    # Both terms are shift-invariant; shifting by the max first keeps them O(1), so their
    # difference does not cancel catastrophically when logits are large.
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)


def compute_entropy_loss(logits, response_mask, loss_agg_mode="token-mean", global_num_tokens=None,
                         global_num_seqs=None, norm_factor=None):
    """Aggregated token entropy (positive); the actor subtracts entropy_coeff times it from its loss."""
    entropy = entropy_from_logits(logits)
    return agg_loss(entropy, response_mask, loss_agg_mode, global_num_tokens, global_num_seqs, norm_factor)
