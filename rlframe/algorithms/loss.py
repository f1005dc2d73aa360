"""Loss aggregation, policy losses and the value loss.

Policy losses share one signature and return (pg_loss, metrics). Metrics are detached 0-dim tensors
(no device sync per micro-batch; the worker calls .item() once), computed as masked means over this
call's tokens; the worker averages them over micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlframe.algorithms.masked import lookup, masked_mean, register

POLICY_LOSSES: dict[str, Callable] = {}
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def register_policy_loss(name: str) -> Callable:
    """Decorator: make a policy loss available as `actor.policy_loss.loss_mode=name`."""
    return register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered as `name`."""
    return lookup(POLICY_LOSSES, "policy loss", name)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, global_num_tokens=None, global_num_seqs=None, norm_factor=None):
    """Reduce a [bs, len] token loss to a scalar, normalized by mini-batch-wide counts.

    Modes (sums run over this call's rows; N_tok / N_seq are the counts of the whole mini-batch):
      token-mean               Σ masked token losses / N_tok
      seq-mean-token-sum       Σ_seq (Σ_tok loss) / N_seq
      seq-mean-token-mean      Σ_seq (Σ_tok loss / seq's own token count) / N_seq
      seq-mean-token-sum-norm  Σ masked token losses / (N_seq · norm_factor)   (Dr.GRPO)

    N_tok = `global_num_tokens`, the number of valid tokens, and N_seq = `global_num_seqs`, the
    number of sequences, both counted over every micro-batch on every DP rank of the mini-batch.
    The workers pass every row of the mini-batch as N_seq, empty responses included, as verl 0.9.1
    does (`global_batch_size = ppo_mini_batch_size × n`). With those, the sum of agg_loss over any
    split of a mini-batch equals agg_loss on the whole, so gradient accumulation is exact. When a
    count is None the local one is used (N_seq: the rows with a valid token, as verl's local path).

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


def _ratio_metrics(log_ratio, loss_unclipped, loss_clipped, response_mask):
    return {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    loss_agg_mode,
    global_num_tokens=None,
    global_num_seqs=None,
    norm_factor=None,
):
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
def compute_policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    loss_agg_mode,
    global_num_tokens=None,
    global_num_seqs=None,
    norm_factor=None,
):
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


def compute_value_loss(
    vpreds,
    returns,
    values,
    response_mask,
    cliprange_value,
    loss_agg_mode="token-mean",
    global_num_tokens=None,
    global_num_seqs=None,
    norm_factor=None,
):
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
