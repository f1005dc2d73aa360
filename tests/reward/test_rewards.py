"""Rewards: rule-based scorers, the naive and batch managers, scorer failures, custom functions."""

import logging
import math

import numpy as np
import pytest
import torch
from helpers.rewards import make_batch

from rlframe.config.loader import load_config
from rlframe.reward import (
    BatchRewardManager,
    NaiveRewardManager,
    default_compute_score,
    get_reward_manager_cls,
    load_custom_reward_function,
    load_reward_manager,
)
from rlframe.reward.scorers import countdown_add_score, gsm8k_score, last_boxed, math_score


# --------------------------------------------------------------------------------------- scorers
@pytest.mark.parametrize(
    "solution, method, expected",
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "strict", 1.0),
        ("#### 1,234", "strict", 1.0),
        ("so the answer is #### $72.", "strict", 1.0),
        ("#### 70 ... on reflection #### 72", "strict", 1.0),  # the last marked answer counts
        ("The answer is 72.", "strict", 0.0),  # strict needs the #### marker
        ("The answer is 72.", "flexible", 1.0),
        ("First 10, then 72, finally 73", "flexible", 0.0),  # flexible takes the last number
        ("#### 71", "strict", 0.0),
        ("#### 72.0", "strict", 1.0),
    ],
)
def test_gsm8k_strict_and_flexible(solution, method, expected):
    truth = "1234" if "1,234" in solution else "72"
    assert gsm8k_score(solution, truth, method=method) == expected


def test_gsm8k_format_score_and_full_solution_ground_truth():
    assert gsm8k_score("#### 5", "72", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k_score("#### 72", "48 + 24 = 72\n#### 72") == 1.0


@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
        ("\\boxed{ x = 4 }", "4", 1.0),
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("\\boxed 5.", "5", 1.0),
        ("\\boxed{5}", "\\boxed{5}", 1.0),
        ("\\boxed{6}", "5", 0.0),
        ("the answer is 5", "5", 0.0),
        ("\\boxed{5", "5", 0.0),  # cut off
    ],
)
def test_math_last_boxed_answer(solution, truth, expected):
    assert math_score(solution, truth) == expected


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{a}{b}} tail") == "\\frac{a}{b}"
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "response, expected",
    [
        ("7", 1.0),
        (" 7 ", 1.0),  # exactly the answer (the model stopped right after it)
        ("7 because 3 + 4", 0.5),
        ("72", 0.5),  # starts with the answer, goes on
        ("5", 0.2),
        ("8 is it", 0.2),  # starts with a wrong digit
        ("the sum is 7", 0.1),
        ("x9", 0.1),  # a digit somewhere
        ("seven", 0.0),
        ("", 0.0),
        ("²", 0.0),  # no ASCII digit
    ],
)
def test_countdown_add_reward_ladder(response, expected):
    result = countdown_add_score(response, "7")
    assert result["score"] == expected
    assert result["acc"] == (1.0 if expected == 1.0 else 0.0)


def test_default_compute_score_dispatches_and_lists_known_sources():
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "3") == 1.0
    assert default_compute_score("countdown_add", "3", "3")["score"] == 1.0
    with pytest.raises(ValueError) as info:
        default_compute_score("my/data", "3", "3")
    assert "my/data" in str(info.value) and "openai/gsm8k" in str(info.value) and "countdown_add" in str(info.value)


# -------------------------------------------------------------------------------------- managers
@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


CASES = (
    ["3", "3 and more", "#### 12", "\\boxed{5}", "nothing"],
    ["countdown_add", "countdown_add", "openai/gsm8k", "lighteval/MATH", "countdown_add"],
    ["3", "3", "12", "5", "4"],
)


@pytest.mark.parametrize("use_response_mask", [True, False])
def test_naive_manager_places_score_on_last_response_token(tokenizer, use_response_mask):
    data = make_batch(tokenizer, *CASES, use_response_mask=use_response_mask)
    out = NaiveRewardManager(tokenizer)(data, return_dict=True)
    rewards = out["reward_tensor"]
    assert rewards.shape == data.batch["responses"].shape and rewards.dtype == torch.float32
    lengths = data.batch["attention_mask"][:, 4:].sum(1)
    expected = [1.0, 0.5, 1.0, 1.0, 0.0]
    for i, score in enumerate(expected):
        assert rewards[i, lengths[i] - 1] == score
        assert rewards[i].sum() == score  # nothing anywhere else
    assert out["reward_extra_info"]["score"] == expected
    acc = out["reward_extra_info"]["acc"]  # only countdown_add returns acc; others are NaN
    assert acc[0] == 1.0 and acc[1] == 0.0 and acc[4] == 0.0 and math.isnan(acc[2]) and math.isnan(acc[3])
    assert out["metrics"] == {"reward/num_scorer_errors": 0, "reward/num_scorer_timeouts": 0}
    assert torch.equal(NaiveRewardManager(tokenizer)(data), rewards)  # return_dict=False: the tensor


def test_naive_and_batch_managers_agree(tokenizer):
    data = make_batch(tokenizer, *CASES)
    naive = NaiveRewardManager(tokenizer)(data, return_dict=True)
    batch = BatchRewardManager(tokenizer)(data, return_dict=True)
    assert torch.equal(naive["reward_tensor"], batch["reward_tensor"])
    assert naive["reward_extra_info"]["score"] == batch["reward_extra_info"]["score"]


def flaky_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 1:
        raise RuntimeError("scorer bug on sample 1")
    if extra_info["index"] == 2:
        return float("nan")
    return {"score": 1.0, "note": f"ok{extra_info['index']}"}


def test_failing_scorer_scores_zero_counts_and_logs_once(tokenizer, caplog):
    data = make_batch(tokenizer, *CASES)
    manager = NaiveRewardManager(tokenizer, compute_score=flaky_score)
    with caplog.at_level(logging.WARNING, logger="rlframe.reward.manager"):
        out = manager(data, return_dict=True)
    assert out["reward_extra_info"]["score"] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert out["metrics"]["reward/num_scorer_errors"] == 2
    assert out["reward_extra_info"]["note"][0] == "ok0" and math.isnan(out["reward_extra_info"]["note"][1])
    assert "scorer bug on sample 1" in caplog.text and "Traceback" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlframe.reward.manager"):
        manager(data, return_dict=True)  # later failures: one line, no traceback
    assert "failed on 2 of 5" in caplog.text and "Traceback" not in caplog.text


def test_batch_manager_isolates_failures(tokenizer):
    data = make_batch(tokenizer, *CASES)

    def per_sample_failure(data_sources, solution_strs, ground_truths, extra_infos):
        return [ValueError("bad") if i == 0 else 0.5 for i in range(len(data_sources))]

    def whole_batch_failure(data_sources, solution_strs, ground_truths, extra_infos):
        raise RuntimeError("judge unreachable")

    out = BatchRewardManager(tokenizer, compute_score=per_sample_failure)(data, return_dict=True)
    assert out["reward_extra_info"]["score"] == [0.0, 0.5, 0.5, 0.5, 0.5]
    assert out["metrics"]["reward/num_scorer_errors"] == 1
    out = BatchRewardManager(tokenizer, compute_score=whole_batch_failure)(data, return_dict=True)
    assert out["reward_tensor"].abs().sum() == 0 and out["metrics"]["reward/num_scorer_errors"] == 5

    def wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    # not one result per sample: the batch fails as if the call had raised (tests/reward/test_fuzz_reward.py)
    out = BatchRewardManager(tokenizer, compute_score=wrong_length)(data, return_dict=True)
    assert out["reward_tensor"].abs().sum() == 0 and out["metrics"]["reward/num_scorer_errors"] == 5


def test_manager_needs_ground_truth_fields(tokenizer):
    data = make_batch(tokenizer, *CASES)
    data.non_tensor_batch.pop("reward_model")
    with pytest.raises(ValueError, match="'reward_model'"):
        NaiveRewardManager(tokenizer)(data)


def test_unknown_reward_manager_lists_valid_names():
    assert get_reward_manager_cls("batch") is BatchRewardManager
    with pytest.raises(ValueError, match="naive, batch"):
        get_reward_manager_cls("prime")


# ------------------------------------------------------------------------------ custom functions
CUSTOM = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}

def helper():
    pass

NOT_A_FUNCTION = 3
"""


def test_custom_reward_function_is_loaded_from_config(tmp_path, tokenizer, monkeypatch):
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    monkeypatch.chdir(tmp_path)  # relative paths resolve from the working directory
    config = load_config(["custom_reward_function.path=my_reward.py", "reward_model.reward_manager=naive"])
    manager = load_reward_manager(config, tokenizer)
    assert isinstance(manager, NaiveRewardManager)
    out = manager(make_batch(tokenizer, *CASES), return_dict=True)
    assert out["reward_extra_info"]["score"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert out["reward_extra_info"]["length"][0] == 1
    assert load_reward_manager(load_config(), tokenizer).compute_score is None  # default scorer


def test_custom_reward_function_errors(tmp_path):
    assert load_custom_reward_function(None) is None
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path='missing.py'"):
        load_custom_reward_function("missing.py")
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    with pytest.raises(ValueError) as info:
        load_custom_reward_function(str(path), "score_fn")
    assert "score_fn" in str(info.value) and "['compute_score', 'helper']" in str(info.value)
    with pytest.raises(ValueError, match="NOT_A_FUNCTION"):
        load_custom_reward_function(str(path), "NOT_A_FUNCTION")
    fn = load_custom_reward_function(str(path))
    assert fn("x", "4", "4") == {"score": 1.0, "length": 1}


def test_scores_accept_numpy_and_bool(tokenizer):
    data = make_batch(tokenizer, *CASES)
    out = NaiveRewardManager(tokenizer, compute_score=lambda **kw: np.float32(0.25))(data, return_dict=True)
    assert out["reward_extra_info"]["score"] == [0.25] * 5
    out = NaiveRewardManager(tokenizer, compute_score=lambda **kw: True)(data, return_dict=True)
    assert out["reward_extra_info"]["score"] == [1.0] * 5
