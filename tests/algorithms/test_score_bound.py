"""The largest score the advantage math takes (`MAX_ABS_SCORE` = 2**48): every estimator stays finite there.

A sum of squared deviations over N values of magnitude <= M is <= N·M²; float32 holds ~2**128, so M = 2**48
keeps a group's std and the batch whitening finite for up to 2**31 values. Past ~sqrt(float32 max) a group of
two already overflows: the reward managers count such a score as a scorer error (tests/reward).
"""

import logging

import numpy as np
import torch

from rlframe.algorithms.advantage import ADV_ESTIMATORS, MAX_ABS_SCORE, compute_advantage, gdpo_component_scores


def outcome_batch(scores: torch.Tensor, group_size: int, length: int) -> dict:
    """Every input any estimator takes, float32 as in training: each score on its response's last token."""
    bs = len(scores)
    mask = torch.ones(bs, length)
    mask[1::2, length // 2 :] = 0  # half the responses are half as long
    rewards = torch.zeros(bs, length)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(bs), last] = scores
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": np.array([f"prompt{i // group_size}" for i in range(bs)], dtype=object),
        "values": torch.zeros(bs, length),
        "gamma": 1.0,
        "lam": 1.0,
        "norm_adv_by_std_in_grpo": True,
        "reward_baselines": torch.zeros(bs),
        "old_log_probs": torch.full((bs, length), -2.0),
        "sum_pi_squared": torch.full((bs, length), 0.1),
        "gdpo_scores": scores.unsqueeze(-1),
    }


def test_every_estimator_is_finite_with_scores_at_the_bound():
    """512 samples in groups of 8, 131,072 response tokens, scores ±2**48 and in between."""
    gen = torch.Generator().manual_seed(0)
    scores = MAX_ABS_SCORE * torch.empty(512).uniform_(-1, 1, generator=gen)
    scores[::8] = MAX_ABS_SCORE  # every group holds the bound itself
    scores[1::16] = -MAX_ABS_SCORE
    inputs = outcome_batch(scores, group_size=8, length=256)
    for name in ADV_ESTIMATORS:
        advantages, returns = compute_advantage(name, **inputs)
        assert torch.isfinite(advantages).all() and torch.isfinite(returns).all(), name
        assert advantages.abs().sum() > 0, name  # the scores still carry a signal


def test_past_the_square_root_of_float32_max_a_group_of_two_loses_its_signal():
    """Why the bound exists: scores of ±2**65 make the group's squared deviations inf, so GRPO divides by inf."""
    inputs = outcome_batch(torch.tensor([2.0**65, -(2.0**65)]), group_size=2, length=4)
    advantages, _ = compute_advantage("grpo", **inputs)
    assert not (torch.isfinite(advantages) & (advantages != 0)).any()  # all 0 (std inf) or NaN: no signal


def test_a_gdpo_component_past_the_bound_counts_as_zero_with_a_warning(caplog):
    extra_info = {"acc": [1e20, 1.0, -3e38, MAX_ABS_SCORE]}
    with caplog.at_level(logging.WARNING, logger="rlframe.algorithms.advantage"):
        components = gdpo_component_scores(extra_info, ["acc"], 4)
    assert components[:, 0].tolist() == [0.0, 1.0, 0.0, MAX_ABS_SCORE]  # the bound itself is kept
    assert "2 of 4 samples have no usable 'acc'" in caplog.text and "beyond ±2.81e+14 = 2**48" in caplog.text
