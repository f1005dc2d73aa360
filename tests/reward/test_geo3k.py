"""hiyouga/geometry3k (verl's geo3k preprocessing): rlframe's scorer gives verl 0.9.1's scores."""

from __future__ import annotations

import importlib

import pytest
from helpers.verl_reference import verl_core_algos

from rlframe.reward.scorers import default_compute_score

CASES = [
    ("<think>the angle is half</think> so \\boxed{30}", "30", 1.0),
    ("<think>x</think> \\boxed{3\\sqrt{2}}", "3 \\sqrt 2", 1.0),  # equal by mathruler's normalization
    ("\\boxed{30}", "30", 0.9),  # right, without the think block
    ("<think>x</think> \\boxed{31}", "30", 0.1),  # formatted, wrong
    ("the answer is 30", "30", 0.0),  # no boxed answer
    ("<think>a</think><think>b</think> \\boxed{\\frac{1}{2}}", "0.5", None),  # whatever verl says
]


@pytest.mark.parametrize("response,truth,score", CASES)
def test_geo3k_scores_equal_verls(response, truth, score):
    verl_core_algos()  # puts verl 0.9.1's source on the path (or skips)
    verl_geo3k = importlib.import_module("verl.utils.reward_score.geo3k")
    ours = default_compute_score("hiyouga/geometry3k", response, truth)
    assert ours == verl_geo3k.compute_score(response, truth)
    if score is not None:
        assert ours == pytest.approx(score)
