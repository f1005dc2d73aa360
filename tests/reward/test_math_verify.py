"""The math-verify scorer (custom_reward_function.path=builtin://math_verify): its verdicts, verl 0.9.1's
verdicts on the same cases, and that a config reaches it through the reward managers."""

import importlib

import pytest
from helpers.rewards import make_batch
from helpers.verl_reference import verl_core_algos

from rlframe.config.loader import load_config
from rlframe.reward import BatchRewardManager, NaiveRewardManager, load_custom_reward_function, load_reward_manager
from rlframe.reward.math_verify import compute_score, math_verify_score

CASES = [  # (response, ground truth, verdict)
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("so the answer is $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),  # a decimal equals the fraction
    ("x = $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),  # unreduced
    ("answer: 1/2", "0.5", 1.0),  # a plain expression
    ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}", 1.0),  # symbolic simplification
    ("$\\boxed{x^2 + 2x + 1}$", "(x+1)^2", 1.0),
    ("$\\boxed{\\{1, 2\\}}$", "\\{2, 1\\}", 1.0),  # sets are unordered
    ("$\\boxed{3}$", "\\frac{1}{2}", 0.0),  # wrong
    ("no answer here", "5", 0.0),  # nothing to parse
    ("", "5", 0.0),
]


@pytest.mark.parametrize("response,truth,verdict", CASES)
def test_math_verify_verdicts(response, truth, verdict):
    assert math_verify_score(response, truth) == verdict
    assert compute_score("any/source", response, truth) == verdict


def test_same_verdicts_as_verl():
    verl_core_algos()  # puts verl 0.9.1's source on the path (or skips)
    verl_math_verify = importlib.import_module("verl.utils.reward_score.math_verify")
    for response, truth, _ in CASES:
        # verl's check itself, run here directly (verl runs it in a process pool for its 30 s timeout)
        assert math_verify_score(response, truth) == verl_math_verify._verify_in_subprocess(
            f"\\boxed{{{truth}}}", response
        )


def test_string_rules_stay_the_default_and_differ_where_math_verify_helps():
    from rlframe.reward.scorers import default_compute_score

    assert default_compute_score("lighteval/MATH", "$\\boxed{0.5}$", "\\frac{1}{2}") == 0.0
    assert compute_score("lighteval/MATH", "$\\boxed{0.5}$", "\\frac{1}{2}") == 1.0


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("manager", ["naive", "batch"])
def test_config_reaches_math_verify_through_the_reward_manager(tokenizer, manager):
    responses = ["1/2", "0.5", "3", "x"]  # text the tiny tokenizer round-trips
    for text in responses:
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    data = make_batch(tokenizer, responses, ["lighteval/MATH"] * 4, ["\\frac{1}{2}"] * 4)
    config = load_config(
        ["custom_reward_function.path=builtin://math_verify", f"reward_model.reward_manager={manager}"]
    )
    reward = load_reward_manager(config, tokenizer)
    assert isinstance(reward, {"naive": NaiveRewardManager, "batch": BatchRewardManager}[manager])
    assert reward(data, return_dict=True)["reward_extra_info"]["score"] == [1.0, 1.0, 0.0, 0.0]


def test_builtin_math_verify_offers_compute_score_only():
    assert load_custom_reward_function("builtin://math_verify") is compute_score
    with pytest.raises(ValueError, match="builtin://math_verify provides compute_score only"):
        load_custom_reward_function("builtin://math_verify", "score")
