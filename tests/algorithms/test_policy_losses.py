"""The policy losses and `token-sum` against references written from the papers' formulas and
against verl 0.9.1's own functions (tests/helpers/verl_reference.py), on random inputs.

Inputs: several seeds, fp64, masks with a length-1 response, holes inside responses and an empty
response, advantages constant per sequence or per token. Compared: the loss, its gradient with
respect to log π, and the metrics verl reports.
"""

import math

import pytest
import torch
from helpers.verl_reference import verl_actor_config, verl_core_algos

from rlframe.algorithms import loss as loss_math

SEEDS = [0, 1, 2, 3]
AGG_MODES = loss_math.LOSS_AGG_MODES
LOW, HIGH, C = 0.2, 0.28, 3.0
PARAMS = {  # each mode's own parameters: verl's keys, values that make the mode do something here
    "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.2, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.3},
    "dro": {"dro_beta": 0.3},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
}
NEW_MODES = ["cispo", "gpg", "dro", "sapo", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov"]


def random_inputs(seed, per_token_adv=False):
    """(old, log_prob, advantages, mask): 6 rows of 7 tokens; row 1 has 1 token, row 2 holes, row 5 none."""
    gen = torch.Generator().manual_seed(seed)
    bs, length = 6, 7
    mask = torch.ones(bs, length, dtype=torch.float64)
    mask[0, 5:] = 0
    mask[1, 1:] = 0
    mask[2, [1, 3]] = 0
    mask[3, 6:] = 0
    mask[5] = 0
    # probabilities spread over (0, 1) so the DPPO trust regions and binary KL see every case
    old = torch.rand(bs, length, generator=gen, dtype=torch.float64).clamp(0.02, 0.98).log()
    log_prob = (old + 0.4 * torch.randn(bs, length, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    if per_token_adv:
        adv = 2 * torch.randn(bs, length, generator=gen, dtype=torch.float64)
    else:
        adv = 2 * torch.randn(bs, 1, generator=gen, dtype=torch.float64).expand(bs, length).clone()
    adv[4] = 0.0  # a group whose samples all scored alike
    return old, log_prob.requires_grad_(), adv * mask, mask


def loss_args(agg_mode, mask):
    """The clip bounds, and `agg_mode` normalized by the counts of the whole batch `mask` (every row a sequence)."""
    return loss_math.PolicyLossArgs(
        LOW, HIGH, C, loss_math.Aggregation(agg_mode, mask.sum(), torch.tensor(float(mask.shape[0])))
    )


def ours(mode, old, log_prob, adv, mask, agg, generator=None):
    fn = loss_math.get_policy_loss_fn(mode)
    params = dict(PARAMS.get(mode, {}))
    if mode == "clip_cov":
        params["generator"] = generator
    kwargs = loss_math.policy_loss_kwargs(fn, params)
    loss, metrics = fn(old, log_prob, adv, mask, loss_args(agg, mask), **kwargs)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def verls(mode, old, log_prob, adv, mask, agg):
    core = verl_core_algos()
    config = verl_actor_config(mode, clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C, **PARAMS.get(mode, {}))
    config.global_batch_info.update(dp_size=1, batch_num_tokens=mask.sum(), global_batch_size=mask.shape[0])
    loss, metrics = core.get_policy_loss_fn(mode)(old, log_prob, adv, mask.bool(), agg, config)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, {k.removeprefix("actor/"): v for k, v in metrics.items()}


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", NEW_MODES + ["vanilla", "gspo"])
def test_policy_loss_matches_verl(mode, agg, per_token_adv):
    worst = 0.0
    for seed in SEEDS:
        old, log_prob, adv, mask = random_inputs(seed, per_token_adv)
        torch.manual_seed(seed)  # verl's clip_cov draws from the global generator
        ref_loss, ref_grad, ref_metrics = verls(mode, old, log_prob, adv, mask, agg)
        loss, grad, metrics = ours(mode, old, log_prob, adv, mask, agg, torch.Generator().manual_seed(seed))
        # verl divides by (count + 1e-8) where rlframe divides exactly, but its integer counts plus 1e-8
        # become fp32, where the 1e-8 vanishes: the same arithmetic, to fp64 rounding
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
        assert set(metrics) == set(ref_metrics) or mode in ("gpg",), (metrics.keys(), ref_metrics.keys())
        for name, ref_value in ref_metrics.items():
            # verl takes some metrics' means over `.float()` (fp32) indicators; rlframe keeps the input dtype
            torch.testing.assert_close(float(metrics[name]), float(ref_value), rtol=1e-7, atol=1e-9, msg=name)
        worst = max(worst, float((loss - ref_loss).abs()), float((grad - ref_grad).abs().max()))
    print(f"{mode} {agg} per_token={per_token_adv}: max |rlframe - verl| = {worst:.2e}")


# ───────────────────── independent references, from the papers' formulas ─────────────────────


def aggregate(token_losses, mask, agg):
    """agg_loss written out with loops over rows (N_seq = every row, N_tok = every valid token)."""
    rows = [[token_losses[i][t] for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    n_tok, n_seq = sum(len(r) for r in rows), len(rows)
    if agg == "token-mean":
        return sum(sum(r) for r in rows) / n_tok
    if agg == "token-sum":
        return sum(sum(r) for r in rows)
    if agg == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / n_seq
    if agg == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / n_seq
    return sum(sum(r) for r in rows) / (n_seq * mask.shape[1])  # seq-mean-token-sum-norm


def token_objective(mode, lp, old_lp, a, selected=False):
    """One token's loss as the paper writes it (lp is a 0-dim tensor with grad; old_lp, a floats)."""
    ratio = torch.exp(lp - old_lp)
    if mode == "cispo":  # MiniMax-M1: sg(clip(r)) · A · log π
        return -min(max(ratio.item(), 1 - LOW), 1 + HIGH) * a * lp
    if mode == "gpg":  # plain REINFORCE
        return -a * lp
    if mode == "dro":  # DRO: A log π − β/2 (log π/π_old)²
        return -(a * lp - 0.5 * PARAMS["dro"]["dro_beta"] * (lp - old_lp) ** 2)
    if mode == "sapo":  # SAPO gate f(r) = 4/τ σ(τ(r − 1))
        tau = PARAMS["sapo"]["tau_pos"] if a > 0 else PARAMS["sapo"]["tau_neg"]
        return -a * 4 / tau * torch.sigmoid(tau * (ratio - 1))
    if mode in ("dppo_tv", "dppo_kl"):  # keep the token unless π left the trust region in A's direction
        p, q = math.exp(lp.item()), math.exp(old_lp)
        if mode == "dppo_tv":
            outside = p - q > HIGH if a > 0 else p - q < -LOW
        else:
            bkl = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
            outside = (bkl > HIGH and p > q) if a > 0 else (bkl > LOW and p < q)
        return 0.0 * lp if outside else -a * min(ratio.item(), C) * lp
    if mode == "clip_cov":  # PPO clip, detached on the selected tokens
        loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - LOW, 1 + HIGH))
        return 0.0 * lp if selected else loss
    if mode == "kl_cov":  # unclipped surrogate, |log r| penalty on the selected tokens
        return -a * ratio + (PARAMS["kl_cov"]["ppo_kl_coef"] * (lp - old_lp).abs() if selected else 0.0)
    raise AssertionError(mode)


def covariance_terms(old, log_prob, adv, mask):
    """{(i, t): (A − mean A)(log π − mean log π)} over the valid tokens."""
    cells = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_a = sum(adv[c].item() for c in cells) / len(cells)
    mean_l = sum(log_prob[c].item() for c in cells) / len(cells)
    return {c: (adv[c].item() - mean_a) * (log_prob[c].item() - mean_l) for c in cells}


def reference_selection(mode, old, log_prob, adv, mask, chosen):
    """The selected cells by the paper's rule; for clip_cov (random) checks `chosen` is a valid draw."""
    cov = covariance_terms(old, log_prob, adv, mask)
    if mode == "kl_cov":
        k = max(1, int(len(cov) * PARAMS["kl_cov"]["kl_cov_ratio"]))
        return set(sorted(cov, key=cov.get, reverse=True)[:k])
    p = PARAMS["clip_cov"]
    candidates = set()
    for (i, t), value in cov.items():
        r, a = math.exp(log_prob[i, t].item() - old[i, t].item()), adv[i, t].item()
        ppo_clipped = -a * min(max(r, 1 - LOW), 1 + HIGH) > -a * r
        if not ppo_clipped and p["clip_cov_lb"] < value < p["clip_cov_ub"]:
            candidates.add((i, t))
    k = max(int(p["clip_cov_ratio"] * len(cov)), 1)
    assert chosen <= candidates and len(chosen) == min(k, len(candidates))
    return chosen


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", ["cispo", "gpg", "dro", "sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"])
def test_token_losses_match_the_papers_formulas(mode, agg):
    worst = 0.0
    for seed in SEEDS:
        for per_token_adv in (False, True):
            old, log_prob, adv, mask = random_inputs(seed, per_token_adv)
            selected = set()
            if mode in loss_math.TOKEN_SELECTORS:
                fn = loss_math.TOKEN_SELECTORS[mode]
                params = dict(PARAMS[mode], generator=torch.Generator().manual_seed(seed))
                if mode == "clip_cov":
                    params.update(clip_ratio_low=LOW, clip_ratio_high=HIGH)
                chosen = fn(old, log_prob, adv, mask, **loss_math.policy_loss_kwargs(fn, params))
                selected = {tuple(c) for c in chosen.nonzero().tolist()}
                assert selected == reference_selection(mode, old, log_prob, adv, mask, selected)
            token_losses = [
                [
                    token_objective(mode, log_prob[i, t], old[i, t].item(), adv[i, t].item(), (i, t) in selected)
                    if mask[i, t]
                    else None
                    for t in range(mask.shape[1])
                ]
                for i in range(mask.shape[0])
            ]
            ref = aggregate(token_losses, mask, "seq-mean-token-mean" if mode == "sapo" else agg)
            (ref_grad,) = torch.autograd.grad(ref, log_prob)
            loss, grad, _ = ours(mode, old, log_prob, adv, mask, agg, torch.Generator().manual_seed(seed))
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
            worst = max(worst, float((loss - ref.detach()).abs()), float((grad - ref_grad).abs().max()))
    print(f"{mode} {agg}: max |rlframe - reference| = {worst:.2e}")


def test_geo_mean_is_the_clipped_geometric_mean_of_token_ratios():
    """GMPO (arXiv 2507.20673): J = 1/G Σ_i Â_i·(Π_t min(r_t^{sgn Â}, clip(r_t)^{sgn Â})^{1/|o_i|})^{sgn Â},
    clip to [e^{−ε_low}, e^{ε_high}] (clipping in log space); empty responses count in G."""
    worst = 0.0
    for seed in SEEDS:
        old, log_prob, adv, mask = random_inputs(seed)
        total = 0.0
        for i in range(mask.shape[0]):
            cells = [t for t in range(mask.shape[1]) if mask[i, t]]
            if not cells:
                continue
            a = adv[i, cells[0]].item()
            sign = 1.0 if a > 0 else (-1.0 if a < 0 else 0.0)
            product = 1.0
            for t in cells:
                r = torch.exp(log_prob[i, t] - old[i, t])
                clipped = r.clamp(math.exp(-LOW), math.exp(HIGH))
                product = product * torch.minimum(r**sign, clipped**sign) ** (1.0 / len(cells))
            total = total - a * product**sign
        ref = total / mask.shape[0]
        (ref_grad,) = torch.autograd.grad(ref, log_prob)
        loss, grad, _ = ours("geo_mean", old, log_prob, adv, mask, "token-mean")
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        worst = max(worst, float((loss - ref.detach()).abs()), float((grad - ref_grad).abs().max()))
    print(f"geo_mean: max |rlframe - reference| = {worst:.2e}")


def test_token_sum_is_the_plain_sum_and_splits_exactly():
    old, log_prob, adv, mask = random_inputs(0, per_token_adv=True)
    whole = loss_math.agg_loss(adv, mask, "token-sum")
    torch.testing.assert_close(whole, (adv * mask).sum())
    parts = sum(loss_math.agg_loss(adv[rows], mask[rows], "token-sum") for rows in ([0, 1], [2, 3, 4], [5]))
    torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize("mode", NEW_MODES)
def test_every_loss_splits_exactly_over_micro_batches_given_global_counts(mode):
    """Σ over row splits of the loss (with global counts and the whole batch's token selection) = the whole."""
    for seed in SEEDS:
        old, log_prob, adv, mask = random_inputs(seed, per_token_adv=True)
        fn = loss_math.get_policy_loss_fn(mode)
        params = dict(PARAMS.get(mode, {}))
        if mode in loss_math.TOKEN_SELECTORS:
            selector = loss_math.TOKEN_SELECTORS[mode]
            sel_params = dict(params, clip_ratio_low=LOW, clip_ratio_high=HIGH)
            sel_params["generator"] = torch.Generator().manual_seed(seed)
            params["token_selection"] = selector(
                old, log_prob, adv, mask, **loss_math.policy_loss_kwargs(selector, sel_params)
            )
        for agg in AGG_MODES:
            args = loss_args(agg, mask)
            kwargs = loss_math.policy_loss_kwargs(fn, params)
            whole, _ = fn(old, log_prob, adv, mask, args, **kwargs)
            total = 0.0
            for rows in ([0, 3], [1], [2, 4, 5]):
                part = {k: (v[rows] if k == "token_selection" else v) for k, v in kwargs.items()}
                total = total + fn(old[rows], log_prob[rows], adv[rows], mask[rows], args, **part)[0]
            torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


def test_dro_needs_a_positive_beta():
    old, log_prob, adv, mask = random_inputs(0)
    with pytest.raises(ValueError, match="dro_beta"):
        loss_math.compute_policy_loss_dro(old, log_prob, adv, mask, loss_args("token-mean", mask))


def test_explain_shows_the_loss_estimator_and_kl_terms_with_their_formulas():
    from rlframe.explain.formatting import format_algorithm
    from rlframe.trainer.config import compose

    cfg = compose(
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
            "algorithm.adv_estimator=opo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_type=k3+",
            "actor_rollout_ref.actor.loss_agg_mode=token-sum",
        ]
    )
    text = format_algorithm(cfg)
    assert "advantage  opo: OPO" in text and "length-weighted" in text
    assert "policy     clip_cov: Clip-Cov" in text and "one extra forward" in text
    assert "loss_agg_mode token-sum" in text
    assert "k3+: the value of k3" in text and "the gradient of k2" in text
    assert "kl reward" not in text  # use_kl_in_reward=false


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_bypass_mode_loss_matches_verl(agg, per_token_adv):
    """loss_mode=bypass_mode: verl 0.9.1's loss at its default policy_loss.rollout_correction (sequence IS
    weights for the metrics, no rejection, ppo_clip); loss, gradient and the metrics rlframe reports."""
    for seed in SEEDS:
        old, log_prob, adv, mask = random_inputs(seed, per_token_adv)
        ref_loss, ref_grad, ref_metrics = verls("bypass_mode", old, log_prob, adv, mask, agg)
        loss, grad, metrics = ours("bypass_mode", old, log_prob, adv, mask, agg)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
        vanilla, _, _ = ours("vanilla", old, log_prob, adv, mask, agg)
        torch.testing.assert_close(loss, vanilla, rtol=0, atol=0)  # ppo_clip: the weights are only reported
        assert {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "rollout_corr/rollout_is_mean"} <= set(metrics)
        assert set(metrics) <= set(ref_metrics), set(metrics) - set(ref_metrics)
        for name, value in metrics.items():
            torch.testing.assert_close(float(value), float(ref_metrics[name]), rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.parametrize(
    "overrides,shown",
    [
        (
            ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", "algorithm.adv_estimator=gdpo"],
            ["policy bypass_mode: verl 0.9.1's `bypass_mode` loss", "advantage gdpo: GDPO"],
        ),
        (
            ["algorithm.adv_estimator=tir_optimal_token_baseline"],
            ["advantage tir_optimal_token_baseline: Optimal Token Baseline for tool-integrated"],
        ),
    ],
)
def test_explain_shows_the_verl_names_added_for_issue_29(overrides, shown):
    from rlframe.explain.formatting import format_algorithm
    from rlframe.trainer.config import compose

    text = format_algorithm(compose(overrides))
    for line in shown:
        assert line in " ".join(text.split()), text
