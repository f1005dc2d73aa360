"""Rollout correction (rlframe.algorithms.rollout_correction) against verl 0.9.1's own functions and the formulas."""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch
from helpers.verl_reference import verl_core_algos

from rlframe.algorithms import rollout_correction as rc
from rlframe.algorithms.config import (
    IS_WEIGHTED_LOSSES,
    RolloutCorrection,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)
from rlframe.algorithms.loss import Aggregation, PolicyLossArgs


def verl_helper():
    """verl 0.9.1's rollout_corr_helper (skips when verl's source is absent)."""
    verl_core_algos()
    return importlib.import_module("verl.trainer.ppo.rollout_corr_helper")


def batch(seed: int, bs: int = 8, length: int = 12, scale: float = 0.3):
    """Trainer and rollout log-probs and a mask with a length-1 response, holes and an empty row."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(bs, length, generator=g) * 3
    rollout = old + torch.randn(bs, length, generator=g) * scale
    mask = (torch.rand(bs, length, generator=g) > 0.2).float()
    mask[0] = 0
    mask[0, 0] = 1  # a length-1 response
    mask[1, 5:] = 0
    mask[2, 3] = 0  # a hole
    mask[3] = 0  # an empty response
    return old, rollout, mask


def cfg(**fields):
    base = dict(
        rollout_is=None,
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=False,
        rollout_rs=None,
        rollout_rs_threshold=None,
        bypass_mode=False,
        loss_type="ppo_clip",
    )
    return SimpleNamespace(**{**base, **fields})


CASES = [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="token", rollout_is_threshold=1.2, rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0"),
    dict(rollout_is="token", rollout_is_threshold="0.8_1.25"),
    dict(rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6"),
    dict(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.6_1.6,2.5"),
    dict(rollout_rs="token_k2,token_k3,seq_sum_k1", rollout_rs_threshold=1.5),
    dict(
        rollout_rs="seq_sum_k2,seq_sum_k3,seq_mean_k1,seq_mean_k2,seq_mean_k3,seq_max_k3",
        rollout_rs_threshold="0.5,0.5,0.9_1.1,0.05,0.05,0.3",
    ),
    dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.02),
    dict(),  # metrics only
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "metrics")
def test_weights_mask_and_metrics_match_verl(case, seed):
    helper = verl_helper()
    old, rollout, mask = batch(seed)
    c = cfg(**case)
    weights, new_mask, metrics = rc.rollout_correction(old, rollout, mask, RolloutCorrection.parse(c))
    v_weights, v_mask, v_metrics = helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, c.rollout_is, c.rollout_is_threshold, c.rollout_is_batch_normalize, c.rollout_rs,
        c.rollout_rs_threshold,
    )  # fmt: skip
    torch.testing.assert_close(new_mask, v_mask, rtol=0, atol=0)
    if c.rollout_is is None:
        assert weights is None and v_weights is None
    else:
        torch.testing.assert_close(weights, v_weights.batch["rollout_is_weights"], rtol=1e-6, atol=1e-7)
    assert sorted(metrics) == sorted(v_metrics)
    for name, value in v_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_weights_from_the_formulas():
    old, rollout, mask = batch(3)
    log_r = old - rollout
    token, _ = rc.is_weights(log_r, mask, "token", parse_is_threshold(1.5))
    torch.testing.assert_close(token, torch.minimum(log_r.exp(), torch.tensor(1.5)) * mask)
    seq, _ = rc.is_weights(log_r, mask, "sequence", parse_is_threshold("0.5_2.0"))
    for i in range(len(old)):
        w = math.exp(sum(log_r[i, t].item() for t in range(old.shape[1]) if mask[i, t]))
        expected = w if 0.5 <= w <= 2.0 else 0.0
        torch.testing.assert_close(seq[i], torch.full_like(seq[i], expected) * mask[i])
    # batch normalization: token level over valid tokens, sequence level over non-empty sequences
    total, count = rc.normalizer_sums(token, mask, "token")
    assert total / count == pytest.approx((token * mask).sum().item() / mask.sum().item(), rel=1e-6)
    total, count = rc.normalizer_sums(seq, mask, "sequence")
    nonempty = [i for i in range(len(old)) if mask[i].any()]
    assert count.item() == len(nonempty)
    assert total.item() == pytest.approx(sum(seq[i][mask[i].bool()][0].item() for i in nonempty), rel=1e-6)


def test_rejection_from_the_formulas():
    old, rollout, mask = batch(4, scale=0.5)
    log_r = old - rollout
    options = parse_rs_options("token_k1,seq_mean_k3")
    out, _ = rc.rejection_mask(log_r, mask, parse_rs_thresholds(options, "0.7_1.4,0.1"))
    k3 = log_r.exp() - 1 - log_r
    for i in range(len(old)):
        valid = mask[i].bool()
        seq_ok = not valid.any() or (k3[i][valid].mean().item() <= 0.1)
        for t in range(old.shape[1]):
            ratio = math.exp(log_r[i, t].item())
            keep = bool(valid[t]) and 0.7 <= ratio <= 1.4 and seq_ok
            assert bool(out[i, t]) == keep, (i, t)


def test_batch_normalization_over_a_split_equals_the_whole_batch():
    """Micro-batches or DP ranks that sum their normalizer parts get the whole batch's weights."""
    old, rollout, mask = batch(5, bs=12)
    for level in ("token", "sequence"):
        c = RolloutCorrection.parse(cfg(rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True))
        whole, _, _ = rc.rollout_correction(old, rollout, mask, c)
        parts = [slice(0, 5), slice(5, 7), slice(7, 12)]
        raw = [rc.is_weights(old[p] - rollout[p], mask[p], level, (2.0, None))[0] for p in parts]
        sums = [rc.normalizer_sums(w, mask[p], level) for w, p in zip(raw, parts)]
        normalizer = (sum(s[0] for s in sums), sum(s[1] for s in sums))
        split = [rc.rollout_correction(old[p], rollout[p], mask[p], c, normalizer)[0] for p in parts]
        torch.testing.assert_close(torch.cat(split), whole, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_reinforce_loss_matches_verl(mode):
    core = verl_core_algos()
    from helpers.verl_reference import verl_actor_config

    old, rollout, mask = batch(6)
    g = torch.Generator().manual_seed(6)
    log_prob = rollout + 0.1 * torch.randn(old.shape, generator=g)
    advantages = torch.randn(old.shape, generator=g)
    weights, _ = rc.is_weights(log_prob - rollout, mask, "sequence", (2.0, None))
    loss, metrics = rc.compute_policy_loss_reinforce(rollout, log_prob, advantages, mask, weights, Aggregation(mode))
    config = verl_actor_config(loss_agg_mode=mode)
    v_loss, v_metrics = core.compute_policy_loss_reinforce(rollout, log_prob, advantages, mask, mode, config, weights)
    torch.testing.assert_close(loss, v_loss)
    assert metrics["ppo_kl"].item() == pytest.approx(v_metrics["actor/ppo_kl"], rel=1e-6)


def test_thresholds_are_checked_with_the_key_named():
    with pytest.raises(ValueError, match="rollout_is_threshold.*lower bound exceeds"):
        parse_is_threshold("3_2")
    with pytest.raises(ValueError, match="rollout_rs=.*unknown options \\['seq_max_k1'\\]"):
        parse_rs_options("token_k1,seq_max_k1")
    with pytest.raises(ValueError, match="rollout_rs_threshold.*one per rollout_rs option"):
        parse_rs_thresholds(["token_k1", "token_k2", "token_k3"], "1.5,2")
    with pytest.raises(ValueError, match="token_k2 takes one upper bound"):
        parse_rs_thresholds(["token_k2"], "0.5_2")
    assert parse_rs_thresholds(["token_k1"], 2.0) == {"token_k1": (0.5, 2.0)}


@pytest.mark.parametrize("loss_mode", IS_WEIGHTED_LOSSES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_weighted_advantage_equals_verls_weighted_token_loss(loss_mode, mode):
    """The actor applies IS weights as ℓ(w·A); verl multiplies the token losses: the same for these losses."""
    from rlframe.algorithms.loss import POLICY_LOSSES

    if loss_mode not in POLICY_LOSSES:
        pytest.skip(f"policy loss {loss_mode} not registered in this tree")
    core = verl_core_algos()
    from helpers.verl_reference import verl_actor_config

    for seed in range(3):
        old, rollout, mask = batch(10 + seed)
        g = torch.Generator().manual_seed(seed)
        log_prob = old + 0.2 * torch.randn(old.shape, generator=g)
        advantages = torch.randn(old.shape, generator=g)
        advantages[4] = 0.0  # a group with equal scores
        for threshold in (2.0, "0.8_1.25"):  # TIS, and IcePop with zero weights
            weights, _ = rc.is_weights(old - rollout, mask, "token", parse_is_threshold(threshold))
            args = PolicyLossArgs(0.2, 0.28, 3.0, Aggregation(mode))
            ours, _ = POLICY_LOSSES[loss_mode](old, log_prob, advantages * weights, mask, args)
            config = verl_actor_config(loss_mode, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
            verl_fn = core.get_policy_loss_fn(loss_mode)
            theirs, _ = verl_fn(old, log_prob, advantages, mask, mode, config, rollout_is_weights=weights)
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_probs_diff_metrics_match_verls_debug_metrics():
    verl_helper()
    from verl import DataProto as VerlDataProto

    debug = importlib.import_module("verl.utils.debug.metrics")
    for seed in range(3):
        old, rollout, mask = batch(20 + seed)
        data = VerlDataProto.from_dict(
            {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask, "responses": mask.long()}
        )
        theirs = debug.calculate_debug_metrics(data)
        ours = rc.probs_diff_metrics(old, rollout, mask)
        assert sorted(ours) == sorted(theirs)
        for name, value in theirs.items():
            assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_config_checks_and_keys_without_effect():
    from helpers.small_config import SMALL

    from rlframe.config.key_status import ignored_keys
    from rlframe.trainer.config import compose, typed

    bypass = [
        *SMALL,
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
    ]
    cfg = compose(bypass)
    typed(cfg)
    ignored = dict(ignored_keys(cfg, bypass))
    assert "loss_type=reinforce" in ignored["actor_rollout_ref.actor.policy_loss.loss_mode"]
    assert "no old-log-prob pass" in ignored["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"]
    with pytest.raises(ValueError, match="needs the rollout engine's log-probs.*calculate_log_probs=true"):
        typed(compose([*bypass, "actor_rollout_ref.rollout.calculate_log_probs=false"]))
    with pytest.raises(ValueError, match="rollout_is=token with .*loss_mode=geo_mean is not implemented"):
        typed(
            compose(
                [
                    *SMALL,
                    "algorithm.rollout_correction.rollout_is=token",
                    "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean",
                ]
            )
        )
    with pytest.raises(ValueError, match="rollout_rs_threshold must be set"):
        typed(compose([*SMALL, "algorithm.rollout_correction.rollout_rs=token_k2"]))
