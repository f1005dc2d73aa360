"""Hostile reward functions, fuzzed: any value a scorer returns, any ground truth, any response tokens.

A score is a number within ±2**48 (past it a group's float32 statistics overflow), or a dict with such a
"score". Anything else (text, None, a list, NaN, inf, 1e20, 1e300, 10**400, a dict without "score", a batch
result that is not one
result per sample) fails that sample: it is counted in `reward/num_scorer_errors` and scores 0
(`on_scorer_error=zero`) or is dropped (`drop`); the reward tensor never holds a NaN or an inf, and the
call never raises. Hypothesis runs derandomized with few examples so CI is fast and reproducible.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from helpers.rewards import make_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlframe.reward import BatchRewardManager, NaiveRewardManager, default_compute_score
from rlframe.reward.dapo import DAPORewardManager
from rlframe.reward.manager import extra_info_metrics
from rlframe.reward.scorers import KNOWN_DATA_SOURCES

FUZZ = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# docs/data_and_rewards.md: N values within ±M keep a float32 sum of squared deviations finite while
# N·M² <= float32 max (~2**128); 2**48 covers N up to 2**31
SAFE_SCORE = 2.0**48

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.sampled_from([1e300, -1e300, 10**400, -(10**400), 3.4e38, 3.5e38, 1e20, 2.0**48, -(2**48) - 1, True, False]),
)
not_numbers = st.one_of(st.none(), st.text(max_size=5), st.lists(st.floats(), max_size=2), st.binary(max_size=3))
extras = st.dictionaries(st.sampled_from(["acc", "pred", "format"]), numbers | not_numbers, max_size=2)
results = st.one_of(
    numbers,
    not_numbers,
    st.builds(lambda score, extra: {**extra, "score": score}, numbers | not_numbers, extras),
    extras,  # no "score"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def expected_score(result) -> float | None:
    """The score a result stands for, or None when it must fail (written apart from normalize_score)."""
    if isinstance(result, dict):
        if "score" not in result:
            return None
        result = result["score"]
    if not isinstance(result, (int, float)):
        return None
    try:
        value = float(result)
    except OverflowError:
        return None
    return value if math.isfinite(value) and abs(value) <= SAFE_SCORE else None


def batch_of(tokenizer, size: int, truths=None):
    truths = truths if truths is not None else ["1"] * size
    return make_batch(tokenizer, ["1"] * size, ["countdown_add"] * size, truths)


def check_scored(out, data, expected: list, on_scorer_error: str) -> None:
    """Every sample scored as `expected` (None: failed), failures counted, nothing non-finite anywhere it counts."""
    rewards = out["reward_tensor"]
    assert torch.isfinite(rewards).all()
    failed = [value is None for value in expected]
    assert out["metrics"]["reward/num_scorer_errors"] == sum(failed)
    last = data.batch["response_mask"].sum(-1) - 1
    for i, value in enumerate(expected):
        stored = torch.tensor(0.0 if value is None else value, dtype=torch.float32)
        assert rewards[i, last[i]] == stored and rewards[i].sum() == stored
        score = out["reward_extra_info"]["score"][i]
        if value is None and on_scorer_error == "drop":
            assert math.isnan(score)
        else:
            assert score == (0.0 if value is None else value)
    assert out["dropped"].tolist() == [on_scorer_error == "drop" and gone for gone in failed]
    metrics = extra_info_metrics(out["reward_extra_info"])  # what the trainer logs: never raises
    assert all(isinstance(value, float) and not math.isnan(value) for value in metrics.values())


@FUZZ
@given(returned=st.lists(results, min_size=1, max_size=6), on_scorer_error=st.sampled_from(["zero", "drop"]))
def test_any_value_a_scorer_returns_is_scored_or_counted(tokenizer, returned, on_scorer_error):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return returned[extra_info["index"]]

    data = batch_of(tokenizer, len(returned))
    manager = NaiveRewardManager(tokenizer, compute_score=compute_score, on_scorer_error=on_scorer_error)
    out = manager(data, return_dict=True)
    check_scored(out, data, [expected_score(result) for result in returned], on_scorer_error)


@FUZZ
@given(
    returned=st.lists(results, min_size=1, max_size=6)
    | not_numbers
    | numbers
    | extras
    | st.sampled_from([np.float64(1.0), np.array(1.0), np.ones((2, 2)), np.ones(3)]),
    size=st.integers(1, 5),
)
def test_any_value_a_batch_scorer_returns_is_scored_or_counted(tokenizer, returned, size):
    """One result per sample is scored as the naive manager scores it; anything else fails the whole batch."""

    def compute_scores(data_sources, solution_strs, ground_truths, extra_infos):
        return returned

    data = batch_of(tokenizer, size)
    out = BatchRewardManager(tokenizer, compute_score=compute_scores)(data, return_dict=True)
    one_dimensional = isinstance(returned, list) or (isinstance(returned, np.ndarray) and returned.ndim == 1)
    if one_dimensional and len(returned) == size:
        check_scored(out, data, [expected_score(result) for result in returned], "zero")
    else:
        check_scored(out, data, [None] * size, "zero")


def test_a_batch_scorer_returning_none_fails_its_batch_with_a_clear_message(tokenizer, caplog):
    def compute_scores(data_sources, solution_strs, ground_truths, extra_infos):
        scores = [1.0 for _ in data_sources]  # noqa: F841 - the forgotten return
        return None

    data = batch_of(tokenizer, 3)
    with caplog.at_level(logging.WARNING, logger="rlframe.reward.manager"):
        out = BatchRewardManager(tokenizer, compute_score=compute_scores)(data, return_dict=True)
    assert out["metrics"]["reward/num_scorer_errors"] == 3 and out["reward_tensor"].abs().sum() == 0
    assert "the batch reward function returned NoneType None; expected a list of 3 results" in caplog.text
    out = BatchRewardManager(tokenizer, compute_score=lambda **columns: np.array(1.0))(data, return_dict=True)
    assert out["metrics"]["reward/num_scorer_errors"] == 3  # a 0-d array has no len(): it used to stop the step


@pytest.mark.parametrize(
    "score, shown",
    [
        (1e300, "score float 1e+300 is beyond ±2.81e+14 (2**48)"),
        (1e20, "score float 1e+20 is beyond ±2.81e+14 (2**48)"),
        (10**400, f"score int {'1' + '0' * 59}... is not a finite number"),
        (float("nan"), "score float nan is not a finite number"),
        ("0.5", "a score must be a number or a dict with a 'score' key, got str '0.5'"),
        ({"acc": 1.0}, "a dict score needs a 'score' key, got a dict with keys ['acc']"),
    ],
    ids=["1e300", "1e20", "10**400", "nan", "text", "no score key"],
)
def test_a_bad_score_is_logged_with_its_value_and_the_samples_index(tokenizer, caplog, score, shown):
    """1e300 used to stop the step (torch refuses it in the float32 reward tensor); now it is one more failure."""

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return score if extra_info["index"] == 1 else 1.0

    data = batch_of(tokenizer, 3)
    data.non_tensor_batch["index"] = np.array([10, 11, 12], dtype=object)  # the dataset's index of each prompt
    with caplog.at_level(logging.WARNING, logger="rlframe.reward.manager"):
        out = NaiveRewardManager(tokenizer, compute_score=compute_score)(data, return_dict=True)
    assert out["reward_extra_info"]["score"] == [1.0, 0.0, 1.0]
    assert "sample 1 of the batch, data_source='countdown_add', index=11" in caplog.text
    assert shown in caplog.text


ground_truths = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), max_size=2),
)


@FUZZ
@given(truths=st.lists(ground_truths, min_size=1, max_size=4))
def test_a_custom_scorer_receives_ground_truths_of_any_type_unchanged(tokenizer, truths):
    received = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        received.append(ground_truth)
        return 1.0

    out = NaiveRewardManager(tokenizer, compute_score=compute_score)(batch_of(tokenizer, len(truths), truths), True)
    assert received == truths and out["metrics"]["reward/num_scorer_errors"] == 0


@FUZZ
@given(
    solution=st.text(max_size=60) | st.sampled_from(["\\boxed{", "#### ", "\\boxed 5", "\\fbox{}}", "####" * 30]),
    truth=st.text(min_size=1, max_size=8) | st.integers(),
    source=st.sampled_from(KNOWN_DATA_SOURCES),
)
def test_built_in_scorers_score_any_response_between_zero_and_one(solution, truth, source):
    result = default_compute_score(source, solution, truth)
    score = result["score"] if isinstance(result, dict) else result
    assert 0.0 <= score <= 1.0


@FUZZ
@given(data=st.data())
def test_responses_of_any_token_ids_are_decoded_and_scored(tokenizer, data):
    """Random ids (special tokens, half a UTF-8 character) decode to some text the built-in scorer reads."""
    batch = batch_of(tokenizer, 3)
    shape = batch.batch["responses"].shape
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=shape.numel(), max_size=shape.numel()))
    batch.batch["responses"] = torch.tensor(ids).reshape(shape)
    out = NaiveRewardManager(tokenizer)(batch, return_dict=True)
    assert out["metrics"]["reward/num_scorer_errors"] == 0 and torch.isfinite(out["reward_tensor"]).all()


def test_extra_info_that_is_not_a_number_is_kept_but_not_averaged():
    """A scorer's {"score", "pred": "7"} used to stop the training step (the mean of text)."""
    extra_info = {
        "score": [1.0, 0.0],
        "pred": ["7", "8"],
        "acc": [1.0, math.nan],  # NaN: a sample without "acc"
        "format": [None, True],
        "huge": [10**400, 1],
    }
    assert extra_info_metrics(extra_info) == {
        "reward/score/mean": 0.5,
        "reward/acc/mean": 1.0,
        "reward/format/mean": 1.0,
        "reward/huge/mean": math.inf,
    }


@pytest.mark.parametrize("acc", ["yes", None, [1.0], 10**400], ids=["text", "None", "list", "10**400"])
def test_dapo_reads_an_acc_that_is_not_a_number_as_missing(tokenizer, acc):
    """DAPO's acc falls back to the score where a sample has none; a non-number "acc" used to stop the step."""

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "acc": acc}

    out = DAPORewardManager(tokenizer, compute_score=compute_score)(batch_of(tokenizer, 2), return_dict=True)
    expected = acc if acc == 10**400 else 0.5
    assert out["reward_extra_info"]["acc"] == [expected, expected]


def trainer_reward_step(reward_fn, *overrides):
    """The rollout stage's reward step (`Scorer.score`) on a batch of 4 responses, without workers."""
    from rlframe.trainer.config import compose
    from rlframe.trainer.rollout_stage import Scorer

    batch, metrics = batch_of(reward_fn.tokenizer, 4), {}
    Scorer(compose(list(overrides)), reward_fn, None).score(batch, metrics)
    return batch, metrics


def test_the_trainer_logs_a_scorers_text_extras_without_stopping(tokenizer):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "pred": "x = 7", "acc": 1.0}  # "x = 7" used to stop the step (its float)

    _, metrics = trainer_reward_step(NaiveRewardManager(tokenizer, compute_score=compute_score))
    assert metrics["reward/score/mean"] == 1.0 and metrics["reward/acc/mean"] == 1.0
    assert "reward/pred/mean" not in metrics


def test_a_failed_sample_gives_gdpo_a_zero_component_not_a_nan_batch(tokenizer, caplog):
    """A failed sample has no components (NaN in the extra info); a NaN would spread to every advantage."""
    from rlframe.algorithms.advantage import compute_gdpo_outcome_advantage

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info["index"] == 1:
            raise RuntimeError("scorer bug")
        return {"score": 1.0, "acc": float(extra_info["index"] % 2 == 0), "format": 0.5}

    manager = NaiveRewardManager(tokenizer, compute_score=compute_score)
    with caplog.at_level(logging.WARNING):
        batch, _ = trainer_reward_step(
            manager, "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,format]"
        )
    assert batch.batch["gdpo_scores"][1].tolist() == [0.0, 0.0]
    assert "1 of 4 samples have no usable 'acc'" in caplog.text
    index = np.array(["a", "a", "b", "b"], dtype=object)
    advantages, _ = compute_gdpo_outcome_advantage(batch.batch["response_mask"], index, batch.batch["gdpo_scores"])
    assert torch.isfinite(advantages).all()


def test_a_text_gdpo_component_is_named():
    from rlframe.algorithms.advantage import gdpo_component_scores

    with pytest.raises(ValueError, match=r"'acc' of sample 1 is str 'yes'; a reward component must be a number"):
        gdpo_component_scores({"acc": [1.0, "yes"]}, ["acc"], 2)


@pytest.mark.slow  # starts a scoring process (spawn)
def test_with_a_time_limit_a_batch_scorer_returning_none_fails_its_batch_too(tmp_path, tokenizer):
    """`custom_reward_function.timeout_s` scores in a child process; a malformed batch result is counted there
    as in the driver, so the two paths agree."""
    from rlframe.config.loader import load_config
    from rlframe.reward import load_reward_manager

    path = tmp_path / "scorer.py"
    path.write_text("def compute_scores(data_sources, solution_strs, ground_truths, extra_infos):\n    return None\n")
    config = load_config(
        [
            f"custom_reward_function.path={path}",
            "custom_reward_function.name=compute_scores",
            "custom_reward_function.timeout_s=60",
            "reward_model.reward_manager=batch",
        ]
    )
    manager = load_reward_manager(config, tokenizer)
    try:
        out = manager(batch_of(tokenizer, 3), return_dict=True)
    finally:
        manager._isolated.close()
    assert out["metrics"]["reward/num_scorer_errors"] == 3 and out["metrics"]["reward/num_scorer_timeouts"] == 0
