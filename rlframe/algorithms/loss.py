"""Loss aggregation, policy losses and the value loss.

Policy losses share one signature, `fn(old_log_prob, log_prob, advantages, response_mask, args)`:
the four [bs, len] tensors and `args` (`PolicyLossArgs`: the clip bounds and the `Aggregation`, the
loss_agg_mode with the mini-batch's counts, whose call `args.agg(loss_mat, mask)` is the loss); they
return (pg_loss, metrics). A loss's own parameters (verl's `actor.policy_loss.*`, `actor.tau_pos`,
...) are keyword-only and passed by name (`policy_loss_kwargs`). Metrics are detached 0-dim tensors
(no device sync per micro-batch; the worker calls .item() once), computed as masked means over this
call's tokens; the worker averages them over micro-batches.

Two losses (`clip_cov`, `kl_cov`) choose a fraction of tokens by a covariance over the batch. Such a
choice is a statistic of the whole mini-batch, not of one micro-batch: the worker computes it once
per optimizer step with the loss's entry in `TOKEN_SELECTORS` over the mini-batch gathered from
every DP rank, and passes each micro-batch its part as `token_selection`. Called without it, the
loss selects over the tokens of its own call (verl 0.9.1's behaviour, which depends on the
micro-batch size).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rlframe.algorithms.masked import lookup, masked_mean, register

POLICY_LOSSES: dict[str, Callable] = {}
# loss name -> fn(old_log_prob, log_prob, advantages, response_mask, **params) -> bool [bs, len]
TOKEN_SELECTORS: dict[str, Callable] = {}
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class PolicyLossInfo:
    """What a registered policy loss reads from the actor's config besides its own keyword parameters.

    The config derives from it which actor keys have no effect for the chosen loss, the loss key's help,
    and which losses take rollout-correction IS weights; a loss's own parameters are its keyword-only
    parameters, read by the same names from `actor.policy_loss` (or the actor, for sapo's tau_pos/tau_neg).
    """

    clips_ratio: bool  # reads clip_ratio_low/high (clip_ratio where null); dppo_*: as trust-region thresholds
    dual_clip: bool  # reads clip_ratio_c: the dual-clip bound, or dppo_*'s truncated-IS bound
    advantage_homogeneous: bool  # ℓ(w·A) = w·ℓ(A) for w ≥ 0: IS weights apply by scaling the advantages
    summary: str  # a few words after the name in the key's help ("" = the name says it)


POLICY_LOSS_INFO: dict[str, PolicyLossInfo] = {}
# keyword parameters the actor passes at run time, never config keys
RUNTIME_PARAMETERS = ("token_selection", "generator")


def register_policy_loss(
    name: str, *, clips_ratio: bool, dual_clip: bool = False, advantage_homogeneous: bool = False, summary: str = ""
) -> Callable:
    """Decorator: make a policy loss available as `actor.policy_loss.loss_mode=name`, with what it reads."""

    def decorator(fn: Callable) -> Callable:
        register(POLICY_LOSSES, "policy loss", name)(fn)
        POLICY_LOSS_INFO[name] = PolicyLossInfo(clips_ratio, dual_clip, advantage_homogeneous, summary)
        return fn

    return decorator


def config_parameters(name: str) -> tuple[str, ...]:
    """The config keys (verl's names) policy loss `name` reads as its own keyword parameters."""
    return tuple(p for p in keyword_parameters(POLICY_LOSSES[name]) if p not in RUNTIME_PARAMETERS)


def policy_loss_help() -> str:
    """The loss_mode key's help: every registered loss, with its summary."""
    names = (f"{name} ({info.summary})" if info.summary else name for name, info in POLICY_LOSS_INFO.items())
    return " | ".join(names) + " (docs/algorithms.md)"


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered as `name`."""
    return lookup(POLICY_LOSSES, "policy loss", name)


def policy_loss_kwargs(fn: Callable, params: dict) -> dict:
    """The entries of `params` that policy loss `fn` takes as keyword-only parameters."""
    accepted = inspect.signature(fn).parameters
    return {name: value for name, value in params.items() if name in accepted}


def keyword_parameters(fn: Callable) -> list[str]:
    """A loss's own parameters: its keyword-only ones, which the actor reads by these names from its config."""
    kind = inspect.Parameter.KEYWORD_ONLY
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind == kind]


def agg_loss(loss_mat, loss_mask, loss_agg_mode, global_num_tokens=None, global_num_seqs=None, norm_factor=None):
    """Reduce a [bs, len] token loss to a scalar, normalized by mini-batch-wide counts.

    Modes (sums run over this call's rows; N_tok / N_seq are the counts of the whole mini-batch):
      token-mean               Σ masked token losses / N_tok
      token-sum                Σ masked token losses (no normalization)
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
    if loss_agg_mode == "token-sum":
        return token_losses.sum()
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


@dataclass(frozen=True)
class Aggregation:
    """How a [bs, len] token loss becomes the scalar loss: `agg_loss` with this mode and these counts.

    The counts are the whole mini-batch's (see `agg_loss`); None uses the local ones, so
    `Aggregation(mode)` on a whole batch is the one-call reference.
    """

    mode: str  # loss_agg_mode, one of LOSS_AGG_MODES
    global_num_tokens: torch.Tensor | int | None = None
    global_num_seqs: torch.Tensor | int | None = None
    norm_factor: int | None = None

    def __call__(self, loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The scalar loss of `loss_mat` over `loss_mask`."""
        return agg_loss(loss_mat, loss_mask, self.mode, self.global_num_tokens, self.global_num_seqs, self.norm_factor)


@dataclass(frozen=True)
class PolicyLossArgs:
    """What every policy loss takes besides the four tensors and its own parameters: the actor's clip
    bounds (which loss reads which: `PolicyLossInfo`) and the aggregation of its token losses."""

    clip_ratio_low: float  # the ratio's range starts at 1 − low; dppo_*: the threshold where π fell
    clip_ratio_high: float  # ... and ends at 1 + high; dppo_*: the threshold where π rose
    clip_ratio_c: float  # the dual-clip bound for negative advantages (> 1); dppo_*: the IS truncation
    agg: Aggregation  # loss_agg_mode with the mini-batch's counts


def _ratio_metrics(log_ratio, loss_unclipped, loss_clipped, response_mask):
    return {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }


@register_policy_loss(
    "vanilla", clips_ratio=True, dual_clip=True, advantage_homogeneous=True, summary="PPO clip, dual-clip"
)
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """PPO clipped surrogate with ratio range [1 − clip_ratio_low, 1 + clip_ratio_high]; for
    negative advantages the loss is further capped at −A·clip_ratio_c (dual clip, Ye et al. 2020).
    """
    if args.clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {args.clip_ratio_c}")
    # Clamp before exp: a stale or diverged token must not turn the loss into inf/NaN.
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - args.clip_ratio_low, 1 + args.clip_ratio_high)
    clip_loss = torch.maximum(loss_unclipped, loss_clipped)
    dual_cap = -advantages * args.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)

    metrics = _ratio_metrics(log_ratio, loss_unclipped, loss_clipped, response_mask)
    lower_clipped = (negative & (clip_loss > dual_cap)).float()
    metrics["pg_clipfrac_lower"] = masked_mean(lower_clipped, response_mask).detach()
    return args.agg(pg_losses, response_mask), metrics


@register_policy_loss("gspo", clips_ratio=True, advantage_homogeneous=True)
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """GSPO (Zheng et al. 2025), token form: every token's ratio has the value of the sequence ratio
    exp(mean log π/π_old) and the gradient of its own log π (stop-grad trick). `clip_ratio_c` is
    unused; clip ranges are tiny (e.g. 3e-4/4e-4) and `seq-mean-token-mean` is the paper's mode.
    """
    token_log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, axis=-1).unsqueeze(-1)
    log_ratio = seq_log_ratio.detach() + log_prob - log_prob.detach()
    ratio = log_ratio.clamp(max=10.0).exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - args.clip_ratio_low, 1 + args.clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)

    metrics = _ratio_metrics(token_log_ratio, loss_unclipped, loss_clipped, response_mask)
    metrics["pg_clipfrac_lower"] = torch.zeros((), device=log_prob.device)
    return args.agg(pg_losses, response_mask), metrics


def _log_ratio_and_ratio(old_log_prob, log_prob, clamp: bool = True):
    """log(π/π_old), clamped to ±20 before exp where the loss does (verl's stability clamp), and its exp."""
    log_ratio = log_prob - old_log_prob
    if clamp:
        log_ratio = log_ratio.clamp(-20.0, 20.0)
    return log_ratio, log_ratio.exp()


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


@register_policy_loss("cispo", clips_ratio=True, advantage_homogeneous=True)
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """CISPO (MiniMax-M1, arXiv 2506.13585): ℓ = −sg[clip(ρ, 1 − ε_low, 1 + ε_high)]·A·log π.

    The clipped ratio is a stop-gradient weight, so every token keeps a gradient (REINFORCE-style);
    `clip_ratio_c` is unused.
    """
    log_ratio, ratio = _log_ratio_and_ratio(old_log_prob, log_prob)
    clipped = ratio.clamp(1 - args.clip_ratio_low, 1 + args.clip_ratio_high)
    pg_losses = -clipped.detach() * advantages * log_prob
    metrics = {
        "pg_clipfrac": masked_mean((ratio != clipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": _zero(log_prob),
    }
    return args.agg(pg_losses, response_mask), metrics


@register_policy_loss("gpg", clips_ratio=False, advantage_homogeneous=True)
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """GPG (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient ℓ = −A·log π, no ratio, no clip."""
    pg_losses = -advantages * log_prob
    return args.agg(pg_losses, response_mask), {}


@register_policy_loss("dro", clips_ratio=False)
def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs, *, dro_beta=None):
    """Direct Reward Optimization (Richemond et al. 2024, arXiv 2405.19107), verl's token form:
    ℓ = −(A·log π − β/2·(log π − log π_old)²) with β = `policy_loss.dro_beta` > 0.
    """
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta={dro_beta} must be > 0 for loss_mode=dro")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    metrics = {"ppo_kl": masked_mean(-log_ratio, response_mask).detach()}
    return args.agg(pg_losses, response_mask), metrics


@register_policy_loss("sapo", clips_ratio=False)
def compute_policy_loss_sapo(
    old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs, *, tau_pos=1.0, tau_neg=1.05
):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): the hard clip replaced by a soft gate,
    ℓ = −f_τ(ρ)·A with f_τ(ρ) = σ(τ(ρ − 1))·4/τ, τ = `tau_pos` where A > 0 else `tau_neg`.

    As in verl 0.9.1 the loss is always aggregated with seq-mean-token-mean (the paper's sequence
    average), with the counts of `args.agg`; `loss_agg_mode` still applies to the entropy and KL
    terms. Clip ratios are unused.
    """
    log_ratio, ratio = _log_ratio_and_ratio(old_log_prob, log_prob)
    # the temperatures in the advantages' dtype (torch.where on two Python floats would make fp32)
    pos, neg = (torch.as_tensor(tau, dtype=advantages.dtype, device=advantages.device) for tau in (tau_pos, tau_neg))
    taus = torch.where(advantages > 0, pos, neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    metrics = {
        "pg_clipfrac": _zero(log_prob),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": _zero(log_prob),
    }
    return replace(args.agg, mode="seq-mean-token-mean")(pg_losses, response_mask), metrics


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, valid, args: PolicyLossArgs):
    """Shared tail of the DPPO losses: ℓ = −A·sg[min(ρ, c)]·log π on the tokens `valid` keeps."""
    log_ratio, ratio = _log_ratio_and_ratio(old_log_prob, log_prob)
    valid = valid.detach().to(log_prob.dtype)
    truncated = ratio.clamp(max=args.clip_ratio_c).detach()
    pg_losses = -advantages * truncated * log_prob * valid
    metrics = {
        "pg_clipfrac": masked_mean(1.0 - valid, response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": masked_mean((ratio > args.clip_ratio_c).to(valid.dtype) * valid, response_mask).detach(),
    }
    return args.agg(pg_losses, response_mask), metrics


@register_policy_loss("dppo_tv", clips_ratio=True, dual_clip=True)
def compute_policy_loss_dppo_tv(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """DPPO-Binary-TV (arXiv 2602.04879): a token keeps its gradient unless the sampled token's
    probability moved past the trust region in the advantage's direction: π − π_old > ε_high for
    A > 0, π − π_old < −ε_low otherwise (the clip ratios are TV thresholds here). The kept tokens
    get the truncated-IS gradient −A·sg[min(ρ, clip_ratio_c)]·∇log π.
    """
    delta = log_prob.exp() - old_log_prob.exp()
    valid = torch.where(advantages > 0, delta <= args.clip_ratio_high, delta >= -args.clip_ratio_low)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, valid, args)


@register_policy_loss("dppo_kl", clips_ratio=True, dual_clip=True)
def compute_policy_loss_dppo_kl(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """DPPO-Binary-KL (arXiv 2602.04879): as dppo_tv, with the trust region measured by the KL of the
    Bernoulli "this token or not", KL(p_old ‖ p) = p_old log(p_old/p) + (1 − p_old) log((1 − p_old)/(1 − p)),
    against ε_high (when π rose, A > 0) or ε_low (when π fell, A ≤ 0).
    """
    prob, old_prob = log_prob.exp(), old_log_prob.exp()
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    valid = torch.where(
        advantages > 0,
        (binary_kl <= args.clip_ratio_high) | (prob <= old_prob),
        (binary_kl <= args.clip_ratio_low) | (prob >= old_prob),
    )
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, valid, args)


@register_policy_loss("geo_mean", clips_ratio=True, summary="GMPO")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, args: PolicyLossArgs):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the geometric mean of the token ratios, clipped per
    token in log space toward the pessimistic side: per sequence
    ℓ_i = −Ā_i·exp(mean_t sgn(A)·min(sgn(A)·log ρ_t, sgn(A)·clip(log ρ_t, −ε_low, ε_high))),
    Ā_i the sequence's mean advantage; the loss is Σ_i ℓ_i / N_seq over the mini-batch's sequences.

    `loss_agg_mode` does not apply to this term (verl 0.9.1 takes the plain mean over sequences);
    an empty response has ℓ_i = 0 but counts in N_seq, as in verl's `torch.mean`.
    """
    log_ratio = log_prob - old_log_prob
    mask = response_mask.to(log_prob.dtype)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-args.clip_ratio_low, args.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_ratio = ((pessimistic * mask).sum(dim=-1) / lengths).exp()
    seq_advantage = (advantages * mask).sum(dim=-1) / lengths
    seq_losses = -seq_advantage * seq_ratio
    num_seqs = seq_losses.shape[0] if args.agg.global_num_seqs is None else args.agg.global_num_seqs
    pg_loss = seq_losses.sum() / _at_least_one(num_seqs)
    clipped = (log_ratio != clamped).to(log_prob.dtype)
    metrics = {
        "pg_clipfrac": masked_mean(clipped * (advantages > 0), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), response_mask).detach(),
    }
    return pg_loss, metrics


def _ppo_clip_losses(old_log_prob, log_prob, advantages, clip_ratio_low, clip_ratio_high):
    """(ratio, −Aρ, −A·clip(ρ)) without the stability clamp (verl's clip_cov and kl_cov have none)."""
    ratio = (log_prob - old_log_prob).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return ratio, unclipped, clipped


def _centered_product(advantages, log_prob, mask):
    """(A − mean A)·(log π − mean log π), means over the tokens of `mask` (the batch covariance terms)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


def select_clip_cov_tokens(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low,
    clip_ratio_high,
    clip_cov_ratio=0.0002,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    generator=None,
):
    """Clip-Cov's detached tokens: among the tokens PPO's clip leaves alone whose covariance term
    lies in (clip_cov_lb, clip_cov_ub), max(⌊clip_cov_ratio·N_tok⌋, 1) chosen uniformly at random
    (a permutation drawn from `generator` over the candidates in row-major order). Bool [bs, len].
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.clip_cov_ratio={clip_cov_ratio} must be > 0")
    mask = response_mask.bool()
    _, unclipped, clipped = _ppo_clip_losses(
        old_log_prob, log_prob.detach(), advantages, clip_ratio_low, clip_ratio_high
    )
    cov = _centered_product(advantages, log_prob, mask)
    candidates = mask & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    selected = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    candidate_idx = candidates.flatten().nonzero().squeeze(-1)
    if len(candidate_idx) > 0:
        count = max(int(clip_cov_ratio * int(mask.sum())), 1)
        order = torch.randperm(len(candidate_idx), generator=generator).to(candidate_idx.device)
        selected[candidate_idx[order[:count]]] = True
    return selected.view_as(mask)


def select_kl_cov_tokens(old_log_prob, log_prob, advantages, response_mask, *, kl_cov_ratio=0.0002):
    """KL-Cov's penalized tokens: the max(⌊kl_cov_ratio·N_tok⌋, 1) valid tokens with the largest
    covariance term (A − mean A)(log π − mean log π). Bool [bs, len].
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio={kl_cov_ratio} must be > 0")
    mask = response_mask.bool()
    valid_idx = mask.flatten().nonzero().squeeze(-1)
    selected = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if len(valid_idx) > 0:
        # the valid tokens alone, on the CPU: the same top-k (ties included) whatever the device
        adv = advantages[mask].detach().cpu()
        logp = log_prob[mask].detach().cpu()
        cov = (adv - adv.mean()) * (logp - logp.mean())
        count = max(1, int(len(cov) * kl_cov_ratio))
        selected[valid_idx[torch.topk(cov, count).indices.to(valid_idx.device)]] = True
    return selected.view_as(mask)


@register_policy_loss("clip_cov", clips_ratio=True)
def compute_policy_loss_clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    args: PolicyLossArgs,
    *,
    clip_cov_ratio=0.0002,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    token_selection=None,
    generator=None,
):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617):
    PPO's clipped surrogate max(−Aρ, −A·clip(ρ)) (no dual clip) with the gradient detached — the
    loss zeroed — on a small random set of high-covariance tokens (`select_clip_cov_tokens`), to
    keep the policy's entropy from collapsing.

    `token_selection` is that set when the caller chose it over the whole mini-batch; None chooses
    over this call's tokens.
    """
    if token_selection is None:
        token_selection = select_clip_cov_tokens(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            clip_ratio_low=args.clip_ratio_low,
            clip_ratio_high=args.clip_ratio_high,
            clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb,
            clip_cov_ub=clip_cov_ub,
            generator=generator,
        )
    ratio, unclipped, clipped = _ppo_clip_losses(
        old_log_prob, log_prob, advantages, args.clip_ratio_low, args.clip_ratio_high
    )
    pg_losses = torch.where(token_selection, 0.0, torch.maximum(unclipped, clipped))
    metrics = {
        "pg_clipfrac": masked_mean(token_selection.to(log_prob.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
    }
    return args.agg(pg_losses, response_mask), metrics


@register_policy_loss("kl_cov", clips_ratio=False)
def compute_policy_loss_kl_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    args: PolicyLossArgs,
    *,
    kl_cov_ratio=0.0002,
    ppo_kl_coef=0.1,
    token_selection=None,
):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped surrogate −Aρ, plus
    ppo_kl_coef·|log ρ| on the tokens with the largest covariance term (`select_kl_cov_tokens`).
    Clip ratios are unused.

    `token_selection` is that set when the caller chose it over the whole mini-batch; None chooses
    over this call's tokens.
    """
    if token_selection is None:
        token_selection = select_kl_cov_tokens(
            old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio=kl_cov_ratio
        )
    log_ratio = log_prob - old_log_prob
    pg_losses = -advantages * log_ratio.exp() + torch.where(token_selection, ppo_kl_coef * log_ratio.abs(), 0.0)
    metrics = {"ppo_kl": masked_mean(log_ratio.abs(), response_mask).detach()}
    return args.agg(pg_losses, response_mask), metrics


TOKEN_SELECTORS.update(clip_cov=select_clip_cov_tokens, kl_cov=select_kl_cov_tokens)


def compute_value_loss(
    vpreds,
    returns,
    values,
    response_mask,
    cliprange_value,
    agg: Aggregation,
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
    vf_loss = agg(vf_losses, response_mask)
    vf_clipfrac = masked_mean((losses_clipped > losses_unclipped).float(), response_mask).detach()
    return vf_loss, vf_clipfrac
