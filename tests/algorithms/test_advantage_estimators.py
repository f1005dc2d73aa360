"""The newer advantage estimators and the straight-through KL types against references written from
the papers' formulas and against verl 0.9.1's own functions (tests/helpers/verl_reference.py).

Inputs: several seeds, groups of sizes 1–4 (grpo_passk: ≥ 2), a group whose samples all scored the
same, scores of 0 (GPG's α), length-1 responses, holes inside responses and an empty response.
"""

import numpy as np
import pytest
import torch
from helpers.verl_reference import verl_core_algos
from omegaconf import OmegaConf

from rlframe.algorithms import advantage
from rlframe.algorithms import kl as kl_math

SEEDS = [0, 1, 2, 3]


def random_batch(seed, singletons=True):
    """(token_level_rewards, mask, index): outcome rewards on the last valid token, plus a token reward."""
    gen = torch.Generator().manual_seed(seed)
    groups = ["a"] * 4 + ["b"] * 3 + ["c"] * 2 + ["d"] * 3 + (["e"] if singletons else [])
    bs, length = len(groups), 6
    lengths = torch.randint(1, length + 1, (bs,), generator=gen)
    lengths[0], lengths[4] = 1, 0  # a length-1 response and an empty one
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).double()
    mask[1, 0] = 0.0 if lengths[1] > 1 else 1.0  # a hole at the start
    scores = torch.randint(0, 3, (bs,), generator=gen).double()
    scores[9:12] = 1.0  # group d: all the same score
    rewards = torch.zeros(bs, length, dtype=torch.float64)
    for i in range(bs):
        valid = mask[i].nonzero().flatten()
        if len(valid):
            rewards[i, valid[-1]] = scores[i]
    return rewards, mask, np.array(groups, dtype=object)


def verl_estimator(name, **inputs):
    core = verl_core_algos()
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": inputs.pop("norm_adv_by_std_in_grpo", True)})
    return core.get_adv_estimator_fn(name)(**inputs, config=config)


def rows_of(index):
    out = {}
    for i, uid in enumerate(index):
        out.setdefault(uid, []).append(i)
    return out


# ───────────────────────────── references from the papers ─────────────────────────────


def reference_opo(scores, lengths, index):
    """OPO (arXiv 2505.23585): b = Σ_j |o_j| R_j / Σ_j |o_j| over the group (0 alone)."""
    adv = [0.0] * len(scores)
    for rows in rows_of(index).values():
        total = sum(lengths[j] for j in rows)
        base = sum(lengths[j] * scores[j] for j in rows) / total if len(rows) > 1 and total else 0.0
        for i in rows:
            adv[i] = scores[i] - base
    return adv


def reference_gpg(scores, index):
    """GPG (arXiv 2504.02546): α (R − mean_group R), α = B / #(R ≠ 0)."""
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    adv = [0.0] * len(scores)
    for rows in rows_of(index).values():
        mean = sum(scores[j] for j in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            adv[i] = alpha * (scores[i] - mean)
    return adv


def reference_passk(scores, index, norm):
    """Pass@k (arXiv 2503.19595, verl's form): only the best sample, r_max − r_second (/ std + ε)."""
    adv = [0.0] * len(scores)
    for rows in rows_of(index).values():
        group = sorted((scores[j] for j in rows), reverse=True)
        gap = group[0] - group[1]
        if norm:
            gap /= float(np.std(group, ddof=1)) + 1e-6
        best = max(rows, key=lambda j: scores[j])
        adv[best] = gap
    return adv


def reference_otb(rewards, mask, index, old_log_probs, sum_pi_squared, is_weights=None):
    """Optimal token baseline: B_t = Σ_i G_it W_it / Σ_i W_it over the group's valid tokens at t.

    With rollout IS weights ρ̄, each valid token adds ρ̄_j² (1 − 2π_j + Σπ²) to W.
    """
    bs, length = rewards.shape
    returns = [[sum(rewards[i, u] * mask[i, u] for u in range(t, length)) for t in range(length)] for i in range(bs)]
    w = [[0.0] * length for _ in range(bs)]
    for i in range(bs):
        running = 0.0
        for t in range(length):
            if mask[i, t]:
                rho_sq = 1.0 if is_weights is None else float(is_weights[i, t]) ** 2
                running += rho_sq * (1 - 2 * float(old_log_probs[i, t].exp()) + float(sum_pi_squared[i, t]))
            w[i][t] = running
    adv = torch.zeros(bs, length, dtype=torch.float64)
    for rows in rows_of(index).values():
        lengths = sorted(int(mask[j].sum()) for j in rows)
        for i in rows:
            for t in range(length):
                if not mask[i, t]:
                    continue
                base = 0.0
                if len(rows) > 1:
                    num = sum(returns[j][t] * w[j][t] for j in rows if mask[j, t])
                    den = sum(w[j][t] for j in rows if mask[j, t]) + 1e-8
                    base = num / den
                    unique_longest = lengths[-1] > lengths[-2] and int(mask[i].sum()) == lengths[-1]
                    if unique_longest and t >= lengths[-2]:
                        base = 0.0
                adv[i, t] = returns[i][t] - base
    return adv, torch.tensor(returns, dtype=torch.float64)


def broadcast(values, mask):
    return torch.tensor(values, dtype=torch.float64).unsqueeze(-1) * mask


@pytest.mark.parametrize("seed", SEEDS)
def test_opo_gpg_passk_match_their_papers_and_verl(seed):
    rewards, mask, index = random_batch(seed)
    scores = rewards.sum(-1).tolist()
    lengths = mask.sum(-1).tolist()
    inputs = {"token_level_rewards": rewards, "response_mask": mask, "index": index}
    cases = {
        "opo": reference_opo(scores, lengths, index),
        "gpg": reference_gpg(scores, index),
    }
    for name, ref in cases.items():
        adv, returns = advantage.compute_advantage(name, **inputs)
        torch.testing.assert_close(adv, broadcast(ref, mask), rtol=1e-12, atol=1e-12)
        verl_adv, _ = verl_estimator(name, **{k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        # verl's GPG α = B / #nonzero is an fp32 quotient of two integers (1e-7 relative); rlframe's is exact
        tol = 2e-7 if name == "gpg" else 1e-12
        torch.testing.assert_close(adv, verl_adv, rtol=tol, atol=tol)

    rewards, mask, index = random_batch(seed, singletons=False)
    inputs = {"token_level_rewards": rewards, "response_mask": mask, "index": index}
    for norm in (True, False):
        adv, _ = advantage.compute_advantage("grpo_passk", **inputs, norm_adv_by_std_in_grpo=norm)
        ref = reference_passk(rewards.sum(-1).tolist(), index, norm)
        torch.testing.assert_close(adv, broadcast(ref, mask), rtol=1e-12, atol=1e-12)
        verl_adv, _ = verl_estimator("grpo_passk", **inputs, norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(adv, verl_adv, rtol=1e-12, atol=1e-12)


def test_passk_refuses_a_group_of_one():
    rewards, mask, index = random_batch(0, singletons=True)
    with pytest.raises(ValueError, match="grpo_passk needs at least 2 samples"):
        advantage.compute_advantage("grpo_passk", token_level_rewards=rewards, response_mask=mask, index=index)


@pytest.mark.parametrize("seed", SEEDS)
def test_vectorized_names_match_verl(seed):
    rewards, mask, index = random_batch(seed)
    inputs = {"token_level_rewards": rewards, "response_mask": mask, "index": index}
    for name in ("grpo_vectorized", "rloo_vectorized"):
        adv, returns = advantage.compute_advantage(name, **inputs, norm_adv_by_std_in_grpo=False)
        verl_adv, verl_returns = verl_estimator(name, **inputs)
        # verl's vectorized GRPO takes mean and std in fp32, one pass (sqrt((Σx² − (Σx)²/n)/(n − 1)));
        # rlframe's are two-pass in the scores' dtype. RLOO is the same arithmetic.
        tol = 1e-6 if name == "grpo_vectorized" else 1e-12
        torch.testing.assert_close(adv, verl_adv.double(), rtol=tol, atol=tol)
    grpo, _ = advantage.compute_advantage("grpo", **inputs)
    torch.testing.assert_close(advantage.compute_advantage("grpo_vectorized", **inputs)[0], grpo)
    rloo, _ = advantage.compute_advantage("rloo", **inputs)
    rloo_vec, _ = advantage.compute_advantage("rloo_vectorized", **inputs)
    single = torch.tensor(index == "e")
    torch.testing.assert_close(rloo_vec[~single], rloo[~single])
    assert (rloo_vec[single] == 0).all()  # verl's vectorized RLOO: a group of one gets 0 ...
    torch.testing.assert_close(rloo[single], rewards[single].sum(-1, keepdim=True) * mask[single])  # rloo: its score


@pytest.mark.parametrize("seed", SEEDS)
def test_optimal_token_baseline_matches_its_definition_and_verl(seed):
    rewards, mask, index = random_batch(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    rewards = rewards + 0.1 * torch.randn(rewards.shape, generator=gen, dtype=torch.float64) * mask  # token rewards
    probs = torch.rand(rewards.shape, generator=gen, dtype=torch.float64).clamp(0.05, 0.95)
    sum_pi_squared = probs**2 + (1 - probs) ** 2 * torch.rand(rewards.shape, generator=gen, dtype=torch.float64)
    inputs = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": index,
        "old_log_probs": probs.log(),
        "sum_pi_squared": sum_pi_squared,
    }
    adv, returns = advantage.compute_advantage("optimal_token_baseline", **inputs)
    ref_adv, ref_returns = reference_otb(rewards, mask, index, probs.log(), sum_pi_squared)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns * mask, ref_returns * mask, rtol=1e-12, atol=1e-12)
    verl_adv, verl_returns = verl_core_algos().compute_optimal_token_baseline_advantage(**inputs)
    torch.testing.assert_close(adv, verl_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, verl_returns, rtol=1e-12, atol=1e-12)


def otb_batch(seed, dtype=torch.float32):
    """OTB inputs with rollout IS weights, on masks with holes (tool tokens) and masks that cut a prefix.

    Rows alternate: a plain response, one with holes inside, one whose first tokens are masked; IS
    weights span [0, 3] with some exact zeros (IcePop's rejected tokens) and random values at masked
    positions (which must not count).
    """
    rewards, _, index = random_batch(seed)
    gen = torch.Generator().manual_seed(200 + seed)
    bs, length = rewards.shape[0], 10
    lengths = torch.randint(2, length + 1, (bs,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).to(dtype)
    for i in range(bs):
        if i % 3 == 1:  # holes: tool-output tokens inside the response
            mask[i, torch.rand(length, generator=gen) < 0.3] = 0.0
        elif i % 3 == 2:  # a prefix cut off
            mask[i, : int(torch.randint(1, 4, (1,), generator=gen))] = 0.0
    mask[4] = 0.0  # an empty response
    rewards = torch.randn(bs, length, generator=gen).to(dtype) * (torch.rand(bs, length, generator=gen) < 0.3)
    probs = torch.rand(bs, length, generator=gen).clamp(0.05, 0.95).to(dtype)
    sum_pi_squared = probs**2 + (1 - probs) ** 2 * torch.rand(bs, length, generator=gen).to(dtype)
    weights = (3 * torch.rand(bs, length, generator=gen)).to(dtype)
    weights[torch.rand(bs, length, generator=gen) < 0.1] = 0.0
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": index,
        "old_log_probs": probs.log(),
        "sum_pi_squared": sum_pi_squared,
        "rollout_is_weights": weights,
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_optimal_token_baseline_with_rollout_is_weights_matches_verl(seed):
    """verl 0.9.1 scales each token's path variance by ρ̄² before the masked cumulative sum (issue 29)."""
    inputs = otb_batch(seed)
    verl_adv, verl_returns = verl_core_algos().compute_optimal_token_baseline_advantage(**inputs)
    direct = advantage.compute_optimal_token_baseline_advantage(**inputs)
    named = advantage.compute_advantage("optimal_token_baseline", **inputs, gamma=1.0, lam=1.0)
    for adv, returns in (direct, named):
        torch.testing.assert_close(adv, verl_adv)  # fp32 tolerance
        torch.testing.assert_close(returns, verl_returns)
    without, _ = advantage.compute_advantage("optimal_token_baseline", **{**inputs, "rollout_is_weights": None})
    assert not torch.allclose(without, verl_adv), "the weights must change the baseline"
    double = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    ref_adv, _ = reference_otb(*(double[k] for k in list(double)[:5]), is_weights=double["rollout_is_weights"])
    torch.testing.assert_close(direct[0].double(), ref_adv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_tir_optimal_token_baseline_matches_verl(seed, weighted):
    """verl 0.9.1's multi-turn OTB: each response's valid tokens packed together, the baseline per token count."""
    inputs = otb_batch(seed)
    if not weighted:
        inputs["rollout_is_weights"] = None
    fn = verl_core_algos().compute_multi_turn_optimal_token_baseline_advantage
    verl_adv, verl_returns = fn(**inputs)
    direct = advantage.compute_tir_optimal_token_baseline_advantage(**inputs)
    named = advantage.compute_advantage("tir_optimal_token_baseline", **inputs, gamma=1.0, lam=1.0)
    for adv, returns in (direct, named):
        torch.testing.assert_close(adv, verl_adv)  # fp32 tolerance
        torch.testing.assert_close(returns, verl_returns)
    double = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    adv64, _ = advantage.compute_tir_optimal_token_baseline_advantage(**double)
    torch.testing.assert_close(adv64, fn(**double)[0], rtol=1e-12, atol=1e-12)


def test_tir_optimal_token_baseline_is_the_otb_on_responses_without_holes():
    inputs = otb_batch(0, dtype=torch.float64)
    lengths = torch.arange(len(inputs["index"])) % 5 + 2
    inputs["response_mask"] = (torch.arange(10) < lengths.unsqueeze(-1)).double()  # no holes, none empty
    tir, _ = advantage.compute_advantage("tir_optimal_token_baseline", **inputs)
    otb, _ = advantage.compute_advantage("optimal_token_baseline", **inputs)
    torch.testing.assert_close(tir, otb, rtol=1e-12, atol=1e-12)
    holed = otb_batch(0, dtype=torch.float64)
    tir, _ = advantage.compute_advantage("tir_optimal_token_baseline", **holed)
    otb, _ = advantage.compute_advantage("optimal_token_baseline", **holed)
    assert not torch.allclose(tir, otb)


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_trainer_passes_the_decoupled_is_weights_to_the_optimal_token_baseline(seed, estimator):
    """The trainer's advantage step (decoupled rollout correction, token TIS) equals verl's compute_advantage:
    OTB on the batch's response_mask and its `rollout_is_weights`."""
    from types import SimpleNamespace

    from rlframe.algorithms.config import RolloutCorrection
    from rlframe.algorithms.update_mode import UpdateMode
    from rlframe.protocol import DataProto
    from rlframe.trainer.config import compose
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    inputs = otb_batch(seed)
    gen = torch.Generator().manual_seed(300 + seed)
    rollout_log_probs = inputs["old_log_probs"] + 0.5 * torch.randn(inputs["old_log_probs"].shape, generator=gen)
    config = compose(
        [
            f"algorithm.adv_estimator={estimator}",
            "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
            "algorithm.rollout_correction.rollout_is=token",
        ]
    )
    tensors = {k: inputs[k] for k in ("response_mask", "old_log_probs", "sum_pi_squared")}
    batch = DataProto.from_dict(
        {**tensors, "token_level_scores": inputs["token_level_rewards"], "rollout_log_probs": rollout_log_probs},
        non_tensors={"uid": inputs["index"]},
    )
    correction = RolloutCorrection.parse(config.algorithm.rollout_correction)
    trainer = SimpleNamespace(config=config, use_critic=False, update_mode=UpdateMode.DECOUPLED, correction=correction)
    trainer._rollout_correction = lambda b, m: RayPPOTrainer._rollout_correction(trainer, b, m)
    RayPPOTrainer._compute_advantage(trainer, batch, {})
    weights = batch.batch["rollout_is_weights"]
    assert not torch.all(weights == 1)
    verl_adv, verl_returns = verl_core_algos().get_adv_estimator_fn(estimator)(
        **{**inputs, "response_mask": batch.batch["response_mask"], "rollout_is_weights": weights}
    )
    torch.testing.assert_close(batch.batch["advantages"], verl_adv)
    torch.testing.assert_close(batch.batch["returns"], verl_returns)


def gdpo_batch(seed):
    """Three reward components per sample; masks with holes, a cut prefix, a masked last token, an empty row."""
    inputs = otb_batch(seed)
    gen = torch.Generator().manual_seed(400 + seed)
    bs, length = inputs["response_mask"].shape
    attention = (torch.arange(length) < torch.randint(1, length + 1, (bs,), generator=gen).unsqueeze(-1)).long()
    attention[4] = 0  # an empty response
    mask = inputs["response_mask"] * attention
    mask[3, attention[3].sum() - 1] = 0.0  # the last attended token is a tool token
    scores = torch.randint(0, 3, (bs, 3), generator=gen).float() + 0.5 * torch.rand(bs, 3, generator=gen)
    scores[9:12, 0] = 1.0  # a group whose samples all score alike in one component
    return mask, inputs["index"], scores, attention


@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
@pytest.mark.parametrize("seed", SEEDS)
def test_gdpo_matches_verl(seed, weights):
    mask, index, scores, attention = gdpo_batch(seed)
    keys = ["format_reward", "accuracy_reward", "length_reward"]
    config = OmegaConf.create({"gdpo_reward_keys": keys, "gdpo_reward_weights": weights})
    prompts = torch.zeros(len(index), 3, dtype=torch.long)
    verl_adv, verl_returns = verl_core_algos().compute_gdpo_outcome_advantage(
        token_level_rewards=torch.zeros_like(mask),
        response_mask=mask,
        index=index,
        config=config,
        non_tensor_batch={key: scores[:, k].numpy().astype(object) for k, key in enumerate(keys)},
        batch={"prompts": prompts, "attention_mask": torch.cat([torch.ones_like(prompts), attention], -1)},
    )
    inputs = {"response_mask": mask, "index": index, "gdpo_scores": scores}
    direct = advantage.compute_gdpo_outcome_advantage(**inputs, gdpo_reward_weights=weights)
    named = advantage.compute_advantage(
        "gdpo", **inputs, gdpo_reward_weights=weights, token_level_rewards=mask, gamma=1.0, lam=1.0
    )
    for adv, returns in (direct, named):
        torch.testing.assert_close(adv, verl_adv)  # fp32, as verl's
        torch.testing.assert_close(returns, verl_returns)
    assert not torch.allclose(direct[0], torch.zeros_like(mask))


# ───────────────────────────── straight-through KL ─────────────────────────────


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_straight_through_kl_has_the_value_of_its_base_and_the_gradient_of_k2(base):
    core = verl_core_algos()
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        ref = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 3
        logprob = (ref + torch.randn(4, 5, generator=gen, dtype=torch.float64)).requires_grad_()
        value = kl_math.kl_penalty(logprob, ref, base + "+")
        torch.testing.assert_close(value, kl_math.kl_penalty(logprob, ref, base))
        (grad,) = torch.autograd.grad(value.sum(), logprob)
        torch.testing.assert_close(grad, (logprob - ref).detach())  # ∇ ½(log π − log π_ref)²
        verl_value = core.kl_penalty(logprob, ref, base + "+")
        (verl_grad,) = torch.autograd.grad(verl_value.sum(), logprob)
        torch.testing.assert_close(value, verl_value, rtol=0, atol=0)
        torch.testing.assert_close(grad, verl_grad, rtol=0, atol=0)


def test_sum_pi_squared_from_logits_is_the_sum_of_squared_probabilities():
    from rlframe.workers.model_forward import sum_pi_squared_from_logits

    logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    expected = torch.softmax(logits, dim=-1).square().sum(-1)
    torch.testing.assert_close(sum_pi_squared_from_logits(logits), expected, rtol=1e-12, atol=1e-15)
    huge = torch.tensor([[1e4, 1e4, -1e4]])  # no overflow: two equally likely tokens
    torch.testing.assert_close(sum_pi_squared_from_logits(huge), torch.tensor([0.5]))


def test_trainer_gives_gdpo_the_scorers_components_and_logs_them():
    """The trainer's reward step keeps the components named by gdpo_reward_keys with the batch; its advantage
    step equals verl's gdpo on them and logs verl's gdpo/<key>/* metrics."""
    from types import SimpleNamespace

    from rlframe.protocol import DataProto
    from rlframe.trainer.config import compose
    from rlframe.trainer.ray_trainer import RayPPOTrainer
    from rlframe.trainer.rollout_stage import Scorer

    mask, index, scores, _ = gdpo_batch(0)
    keys = ["format_reward", "accuracy_reward"]
    config = compose(["algorithm.adv_estimator=gdpo", f"algorithm.gdpo_reward_keys=[{','.join(keys)}]"])
    batch = DataProto.from_dict({"response_mask": mask}, non_tensors={"uid": index})
    extra = {"score": [0.0] * len(index), **{key: scores[:, k].tolist() for k, key in enumerate(keys)}}
    result = {"reward_tensor": torch.zeros_like(mask), "dropped": torch.zeros(len(index), dtype=torch.bool)}
    trainer = SimpleNamespace(config=config, use_critic=False)
    Scorer(config, lambda b, return_dict: {**result, "reward_extra_info": extra}, None).score(batch, {})
    metrics = {}
    RayPPOTrainer._compute_advantage(trainer, batch, metrics)
    prompt = torch.zeros(len(index), 1, dtype=torch.long)
    verl_adv, _ = verl_core_algos().compute_gdpo_outcome_advantage(
        token_level_rewards=torch.zeros_like(mask),
        response_mask=mask,
        index=index,
        config=OmegaConf.create({"gdpo_reward_keys": keys}),
        non_tensor_batch={key: np.array(extra[key], dtype=object) for key in keys},
        batch={"prompts": prompt, "attention_mask": torch.cat([torch.ones_like(prompt), mask.long()], -1)},
    )
    torch.testing.assert_close(batch.batch["advantages"], verl_adv)
    assert metrics["gdpo/accuracy_reward/max"] == pytest.approx(float(scores[:, 1].max()))
    assert metrics["gdpo/format_reward/std"] == pytest.approx(float(np.std(scores[:, 0].numpy())))
    scorer = Scorer(config, lambda b, return_dict: {**result, "reward_extra_info": {"score": extra["score"]}}, None)
    with pytest.raises(ValueError, match="gdpo_reward_keys names 'format_reward', which the reward function did not"):
        scorer.score(batch, {})
