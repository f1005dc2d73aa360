"""Hand-checked numbers for advantages, KL penalties, loss aggregation and policy/value losses."""

import math

import numpy as np
import pytest
import torch

from rlframe.algorithms import advantage, masked
from rlframe.algorithms import kl as kl_math
from rlframe.algorithms import loss as loss_math
from rlframe.workers import model_forward

T = torch.tensor


def close(a, b, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=1e-5
    )


# ───────────────────────────── masked helpers ─────────────────────────────


def test_masked_mean_sum_var_ignore_masked_entries_even_nan():
    values = T([[1.0, 3.0, float("nan")], [5.0, float("inf"), 7.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    close(masked.masked_sum(values, mask), 9.0)
    close(masked.masked_mean(values, mask), 3.0)
    close(masked.masked_mean(values, mask, axis=-1), [2.0, 5.0])
    close(masked.masked_var(values, mask), 4.0)  # deviations -2, 0, 2 → 8 / (3 - 1)
    close(masked.masked_var(values, mask, unbiased=False), 8 / 3)


def test_masked_helpers_with_empty_mask_give_zero_not_nan():
    values, mask = torch.randn(2, 3), torch.zeros(2, 3)
    assert masked.masked_mean(values, mask) == 0
    assert torch.equal(masked.masked_mean(values, mask, axis=-1), torch.zeros(2))
    assert masked.masked_var(values, mask) == 0
    assert not masked.masked_whiten(values, mask).isnan().any()


def test_masked_whiten_zero_mean_unit_var_and_shift_mean_option():
    values = T([[1.0, 2.0, 3.0, 100.0]])
    mask = T([[1, 1, 1, 0]])
    whitened = masked.masked_whiten(values, mask)
    close(whitened[0, :3], [-1.0, 0.0, 1.0])  # mean 2, unbiased var 1
    close(masked.masked_whiten(values, mask, shift_mean=False)[0, :3], [1.0, 2.0, 3.0])


# ───────────────────────────── advantage estimators ─────────────────────────────


def test_registry_lists_valid_names_on_unknown():
    with pytest.raises(
        ValueError, match="gae, gdpo, gpg, grpo, grpo_passk, grpo_vectorized, opo, optimal_token_baseline, "
    ):
        advantage.get_adv_estimator_fn("ppo")
    with pytest.raises(
        ValueError, match="cispo, clip_cov, dppo_kl, dppo_tv, dro, geo_mean, gpg, gspo, kl_cov, sapo, vanilla"
    ):
        loss_math.get_policy_loss_fn("clip")
    with pytest.raises(
        ValueError, match=r"abs, abs\+, k1, k1\+, k2, k2\+, k3, k3\+, kl, kl\+, low_var_kl, low_var_kl\+, mse, mse\+"
    ):
        kl_math.kl_penalty(torch.zeros(1), torch.zeros(1), "full")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        loss_math.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")


def outcome_batch(scores, resp_len=3, lengths=None):
    """Token rewards with each sequence's score on its last valid token."""
    bs = len(scores)
    lengths = lengths or [resp_len] * bs
    mask = torch.zeros(bs, resp_len)
    rewards = torch.zeros(bs, resp_len)
    for i, (score, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = score
    return rewards, mask


def test_grpo_two_groups_std_normalized():
    rewards, mask = outcome_batch([1, 0, 1, 1, 0], lengths=[3, 2, 1, 3, 2])
    index = np.array(["a", "a", "b", "b", "b"], dtype=object)
    adv, ret = advantage.get_adv_estimator_fn("grpo")(rewards, mask, index=index)
    # group a: mean 0.5, std sqrt(0.5); group b: mean 2/3, std sqrt(1/3)
    s_a, s_b = math.sqrt(0.5), math.sqrt(1 / 3)
    expected = [
        0.5 / (s_a + 1e-6),
        -0.5 / (s_a + 1e-6),
        (1 / 3) / (s_b + 1e-6),
        (1 / 3) / (s_b + 1e-6),
        (-2 / 3) / (s_b + 1e-6),
    ]
    close(adv, T(expected).unsqueeze(-1) * mask)
    close(ret, adv)


def test_grpo_dr_grpo_does_not_divide_by_std():
    rewards, mask = outcome_batch([1, 0, 1, 1, 0])
    index = np.array([7, 7, 9, 9, 9])
    adv, _ = advantage.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    close(adv[:, 0], [0.5, -0.5, 1 / 3, 1 / 3, -2 / 3])


def test_grpo_singleton_group_keeps_raw_score_and_equal_scores_give_zero():
    rewards, mask = outcome_batch([2.0, 1.0, 1.0])
    adv, _ = advantage.compute_grpo_outcome_advantage(rewards, mask, np.array(["x", "y", "y"]))
    close(adv[:, 0], [2.0 / (1 + 1e-6), 0.0, 0.0])


def test_rloo_leave_one_out_baseline():
    rewards, mask = outcome_batch([1, 0, 1, 4, 3])
    adv, ret = advantage.compute_rloo_outcome_advantage(rewards, mask, np.array(["a", "a", "b", "b", "b"]))
    close(adv[:, 0], [1 - 0, 0 - 1, 1 - 3.5, 4 - 2, 3 - 2.5])
    close(ret, adv)
    adv_single, _ = advantage.compute_rloo_outcome_advantage(rewards[:1], mask[:1], np.array(["z"]))
    close(adv_single, 1.0 * mask[:1])


def test_gae_three_tokens_by_hand_and_padding_is_ignored():
    values = T([[0.5, 0.2, 0.1, 9.0]])
    rewards = T([[0.0, 0.0, 1.0, 5.0]])
    mask = T([[1, 1, 1, 0]])
    adv, ret = advantage.compute_gae_advantage_return(rewards, mask, values, gamma=0.9, lam=0.8)
    # δ2 = 1 − 0.1 = 0.9;  δ1 = 0.9·0.1 − 0.2 = −0.11;  δ0 = 0.9·0.2 − 0.5 = −0.32
    # A2 = 0.9;  A1 = −0.11 + 0.72·0.9 = 0.538;  A0 = −0.32 + 0.72·0.538 = 0.06736
    raw = T([[0.06736, 0.538, 0.9, 0.0]])
    close(ret, (raw + values) * mask)
    close(adv, masked.masked_whiten(raw, mask) * mask)


def test_gae_masked_hole_is_transparent():
    values, rewards = T([[0.5, 0.2, 0.1]]), T([[0.0, 0.0, 1.0]])
    _, ret = advantage.compute_gae_advantage_return(rewards, T([[1, 1, 1]]), values, gamma=0.9, lam=0.8)
    holed_values, holed_rewards = T([[0.5, 0.2, 7.0, 0.1]]), T([[0.0, 0.0, 0.0, 1.0]])
    _, holed_ret = advantage.compute_gae_advantage_return(holed_rewards, T([[1, 1, 0, 1]]), holed_values, 0.9, 0.8)
    close(holed_ret[:, [0, 1, 3]], ret)
    assert holed_ret[0, 2] == 0


def test_reinforce_plus_plus_discounted_returns_then_batch_whitening():
    rewards, mask = outcome_batch([1.0, 2.0], resp_len=3, lengths=[3, 2])
    adv, ret = advantage.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    valid = T([0.25, 0.5, 1.0, 1.0, 2.0])
    expected = (valid - valid.mean()) / valid.std()
    close(adv[mask.bool()], expected, atol=1e-4)
    assert adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    rewards, mask = outcome_batch([1.0, 0.0, 3.0], resp_len=2, lengths=[2, 1, 2])
    adv, _ = advantage.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, np.array(["a", "a", "b"]))
    centered = T([[0.5, 0.5], [-0.5, 0.0], [3.0, 3.0]])  # singleton group b keeps its score
    close(adv, masked.masked_whiten(centered, mask) * mask)


def test_remax_reward_to_go_minus_greedy_baseline():
    rewards, mask = T([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]), T([[1, 1, 1], [1, 0, 0]])
    adv, ret = advantage.compute_remax_outcome_advantage(rewards, mask, reward_baselines=T([1.0, 0.5]))
    close(ret, [[3.0, 3.0, 2.0], [3.0, 0.0, 0.0]])
    close(adv, [[2.0, 2.0, 1.0], [2.5, 0.0, 0.0]])


def test_compute_advantage_passes_only_the_inputs_each_estimator_needs():
    rewards, mask = outcome_batch([1, 0])
    inputs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        values=torch.zeros(2, 3),
        index=np.array([0, 0]),
        gamma=1.0,
        lam=1.0,
        reward_baselines=torch.zeros(2),
        norm_adv_by_std_in_grpo=True,
        old_log_probs=torch.full((2, 3), -1.0),
        sum_pi_squared=torch.full((2, 3), 0.5),
        gdpo_scores=torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
    )
    for name in advantage.ADV_ESTIMATORS:
        adv, ret = advantage.compute_advantage(name, **inputs)
        assert adv.shape == ret.shape == (2, 3), name


# ───────────────────────────── KL ─────────────────────────────


@pytest.mark.parametrize(
    "names,expected",
    [
        (("kl", "k1"), [1.0, -1.0]),
        (("abs",), [1.0, 1.0]),
        (("mse", "k2"), [0.5, 0.5]),
        (("low_var_kl", "k3"), [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1]),
    ],
)
def test_kl_penalty_known_values(names, expected):
    logprob, ref = T([0.0, -1.0]), T([-1.0, 0.0])
    for name in names:
        close(kl_math.kl_penalty(logprob, ref, name), expected)


def test_low_var_kl_is_clamped_and_finite():
    kl = kl_math.kl_penalty(T([0.0, -100.0]), T([-100.0, 0.0]), "low_var_kl")
    close(kl, [10.0, 10.0])
    assert torch.isfinite(kl).all()


def test_adaptive_kl_controller_moves_coefficient_toward_target():
    ctrl = kl_math.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=1.1, n_steps=10)  # error 0.1 → × 1.01
    close(ctrl.value, 0.101)
    ctrl.update(current_kl=100.0, n_steps=10)  # error clipped to 0.2 → × 1.02
    close(ctrl.value, 0.101 * 1.02)
    fixed = kl_math.make_kl_controller("fixed", 0.3)
    fixed.update(5.0, 10)
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match="adaptive, fixed"):
        kl_math.make_kl_controller("pid", 0.3)


def test_apply_kl_penalty_rewards_and_metrics():
    scores = T([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    old, ref = T([[0.5, 0.5, 9.0], [1.0, 9.0, 9.0]]), T([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    ctrl = kl_math.FixedKLController(0.1)
    rewards, metrics = kl_math.apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    close(rewards, [[-0.05, 0.95, 0.0], [1.9, 0.0, 0.0]])
    close(metrics["actor/reward_kl_penalty"], (0.5 + 1.0) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


# ───────────────────────────── loss aggregation ─────────────────────────────


def random_batch(seed, bs=9, length=7):
    gen = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(bs, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (bs,), generator=gen)
    lengths[0] = 0  # always one empty sequence
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).double()
    loss_mat[mask == 0] = float("nan")  # garbage under the mask must not leak
    return loss_mat, mask, gen


def test_agg_loss_local_reference_values():
    loss_mat = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 7.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(loss_math.agg_loss(loss_mat, mask, "token-mean"), 10 / 4)
    close(loss_math.agg_loss(loss_mat, mask, "seq-mean-token-sum"), (6 + 4) / 2)
    close(loss_math.agg_loss(loss_mat, mask, "seq-mean-token-mean"), (2 + 4) / 2)
    close(loss_math.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm"), 10 / (2 * 3))
    close(loss_math.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_factor=5), 10 / (2 * 5))


@pytest.mark.parametrize("mode", loss_math.LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(5))
def test_agg_loss_exact_under_random_micro_batch_splits(mode, seed):
    loss_mat, mask, gen = random_batch(seed)
    whole = loss_math.agg_loss(loss_mat, mask, mode)
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    perm = torch.randperm(len(mask), generator=gen)
    cuts = sorted(torch.randint(1, len(mask), (3,), generator=gen).tolist())
    total = sum(
        loss_math.agg_loss(loss_mat[idx], mask[idx], mode, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
        for idx in torch.tensor_split(perm, cuts)
        if len(idx)
    )
    close(total, whole, atol=1e-12)
    assert not torch.isnan(whole)


@pytest.mark.parametrize("mode", loss_math.LOSS_AGG_MODES)
def test_agg_loss_gradient_exact_under_dp_sharding_with_dp_size_factor(mode):
    loss_param, mask, _ = random_batch(11, bs=8)
    loss_param = torch.nan_to_num(loss_param).requires_grad_()
    loss_math.agg_loss(loss_param, mask, mode).backward()
    reference = loss_param.grad.clone()

    dp_size, num_tokens, num_seqs = 2, int(mask.sum()), int((mask.sum(-1) > 0).sum())
    grads = []
    for rank_rows in torch.arange(8).chunk(dp_size):
        loss_param.grad = None
        for micro_rows in rank_rows.chunk(2):  # gradient accumulation
            loss = loss_math.agg_loss(loss_param[micro_rows], mask[micro_rows], mode, num_tokens, num_seqs)
            (loss * dp_size).backward()
        grads.append(loss_param.grad.clone())
    close(sum(grads) / dp_size, reference, atol=1e-12)  # FSDP averages over ranks


@pytest.mark.parametrize("mode", loss_math.LOSS_AGG_MODES)
def test_agg_loss_all_empty_masks_give_zero_loss_and_finite_grad(mode):
    loss_mat = torch.randn(3, 4, requires_grad=True)
    loss = loss_math.agg_loss(loss_mat, torch.zeros(3, 4), mode, global_num_tokens=0, global_num_seqs=0)
    loss.backward()
    assert loss == 0 and torch.isfinite(loss_mat.grad).all()


# ───────────────────────────── policy losses ─────────────────────────────


def vanilla(ratio, adv, low=0.2, high=0.2, c=3.0):
    log_prob = T([math.log(ratio)], dtype=torch.float64).requires_grad_()
    loss, metrics = loss_math.compute_policy_loss_vanilla(
        torch.zeros(1, 1, dtype=torch.float64),
        log_prob.view(1, 1),
        T([[adv]], dtype=torch.float64),
        torch.ones(1, 1),
        loss_math.PolicyLossArgs(low, high, c, loss_math.Aggregation("token-mean")),
    )
    loss.backward()
    return loss.item(), log_prob.grad.item(), metrics


@pytest.mark.parametrize(
    "ratio,adv,loss,grad,clipfrac,lower",
    [
        (1.5, 1.0, -1.2, 0.0, 1.0, 0.0),  # above 1+ε with A>0: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5, 0.0, 0.0),  # below 1−ε with A>0: unclipped (pessimistic bound)
        (0.5, -1.0, 0.8, 0.0, 1.0, 0.0),  # below 1−ε with A<0: clipped
        (1.5, -1.0, 1.5, 1.5, 0.0, 0.0),  # above 1+ε with A<0, under c: unclipped
        (5.0, -1.0, 3.0, 0.0, 0.0, 1.0),  # A<0 and ratio > c: dual clip caps the loss at −A·c
        (5.0, 1.0, -1.2, 0.0, 1.0, 0.0),  # dual clip never touches A>0
    ],
)
def test_vanilla_clipping_edge_cases(ratio, adv, loss, grad, clipfrac, lower):
    got_loss, got_grad, metrics = vanilla(ratio, adv)
    close(got_loss, loss)
    close(got_grad, grad)
    close(metrics["pg_clipfrac"], clipfrac)
    close(metrics["pg_clipfrac_lower"], lower)
    close(metrics["ppo_kl"], -math.log(ratio))
    assert all(not value.requires_grad for value in metrics.values())


def test_vanilla_asymmetric_clip_range():
    close(vanilla(1.25, 1.0, low=0.1, high=0.3)[0], -1.25)
    close(vanilla(1.35, 1.0, low=0.1, high=0.3)[0], -1.3)
    close(vanilla(0.85, -1.0, low=0.1, high=0.3)[0], 0.9)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        vanilla(1.0, 1.0, c=1.0)


SEQ_MEAN_TOKEN_MEAN = loss_math.Aggregation("seq-mean-token-mean")


def gspo_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    mask = T([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    adv = T([1.0, -1.0, 0.5], dtype=torch.float64).unsqueeze(-1).expand(3, 5) * mask
    return old, mask, adv, gen


def test_gspo_equals_vanilla_when_tokens_of_a_sequence_share_one_ratio():
    old, mask, adv, _ = gspo_inputs()
    seq_log_ratio = T([[math.log(1.0002)], [math.log(0.9)], [math.log(1.01)]], dtype=torch.float64)
    log_prob = old + seq_log_ratio
    args = (old, log_prob, adv, mask, loss_math.PolicyLossArgs(3e-4, 4e-4, 3.0, SEQ_MEAN_TOKEN_MEAN))
    gspo_loss, gspo_metrics = loss_math.compute_policy_loss_gspo(*args)
    vanilla_loss, vanilla_metrics = loss_math.compute_policy_loss_vanilla(*args)
    close(gspo_loss, vanilla_loss)
    close(gspo_metrics["pg_clipfrac"], vanilla_metrics["pg_clipfrac"])


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective():
    old, mask, adv, gen = gspo_inputs(1)
    low, high = 0.05, 0.08
    log_prob = (old + 0.05 * torch.randn(3, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    args = loss_math.PolicyLossArgs(low, high, 3.0, SEQ_MEAN_TOKEN_MEAN)
    loss, _ = loss_math.compute_policy_loss_gspo(old, log_prob, adv, mask, args)
    (token_grad,) = torch.autograd.grad(loss, log_prob)

    # Direct sequence-level objective: s_i = exp(mean_t log π/π_old), clipped per sequence.
    ratio = masked.masked_mean(log_prob - old, mask, axis=-1).exp()
    seq_adv = adv[:, 0]
    seq_loss = torch.maximum(-seq_adv * ratio, -seq_adv * ratio.clamp(1 - low, 1 + high)).mean()
    (seq_grad,) = torch.autograd.grad(seq_loss, log_prob)
    close(loss, seq_loss, atol=1e-12)
    close(token_grad, seq_grad, atol=1e-12)


# ───────────────────────────── value loss and logits ─────────────────────────────


def test_value_loss_clipping_by_hand():
    vpreds, returns, values = T([[1.0, 0.5]]), T([[0.0, 0.0]]), T([[0.5, 0.4]])
    mask = T([[1, 1]])
    # token 0: unclipped 1.0, clipped to 0.7 → 0.49; max 1.0.  token 1: 0.25 vs 0.25 → 0.25
    token_mean = loss_math.Aggregation("token-mean")
    vf_loss, clipfrac = loss_math.compute_value_loss(vpreds, returns, values, mask, 0.2, token_mean)
    close(vf_loss, 0.5 * (1.0 + 0.25) / 2)
    close(clipfrac, 0.0)
    # returns above: clipping holds v back → clipped loss is larger and taken
    vf_loss, clipfrac = loss_math.compute_value_loss(T([[1.0]]), T([[2.0]]), T([[0.5]]), T([[1]]), 0.2, token_mean)
    close(vf_loss, 0.5 * 1.3**2)
    close(clipfrac, 1.0)


def test_logprobs_and_entropy_match_naive_and_are_stable_for_huge_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 3), generator=gen)
    log_probs = torch.log_softmax(logits, -1)
    close(model_forward.logprobs_from_logits(logits, labels), log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    close(model_forward.entropy_from_logits(logits), -(log_probs.exp() * log_probs).sum(-1))

    huge = T([[1e4, 1e4, -1e4]])  # fp32: naive lse − Σ p·logit would lose ~1e-3 to cancellation
    close(model_forward.entropy_from_logits(huge), [math.log(2)], atol=1e-6)
    close(model_forward.logprobs_from_logits(huge.double(), T([0])), [math.log(0.5)])
    assert torch.isfinite(model_forward.logprobs_from_logits(huge, T([2]))).all()


def test_worker_counts_every_row_of_a_mini_batch_as_verl_does():
    # verl 0.9.1 divides the seq-mean modes by ppo_mini_batch_size × n: an empty response still counts
    from tensordict import TensorDict

    from rlframe.workers.batching import global_counts

    mask = T([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    mini_batch = TensorDict({"response_mask": mask, "responses": torch.zeros(3, 3, dtype=torch.long)}, batch_size=3)
    counts = global_counts(mini_batch)
    assert (float(counts.num_tokens), float(counts.num_seqs)) == (3.0, 3.0)
    loss_mat = T([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [6.0, 0.0, 0.0]])
    close(counts.aggregation("seq-mean-token-sum")(loss_mat, mask), (3 + 6) / 3)
    # on the batch's device (the first GPU run stacked a CPU count with a CUDA mask); meta stands in for CUDA here
    on_meta = global_counts(mini_batch.to("meta"))
    assert on_meta.num_tokens.device.type == on_meta.num_seqs.device.type == "meta"
