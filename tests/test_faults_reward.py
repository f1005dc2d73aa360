"""A user's reward function that raises, returns NaN or hangs: counted, scored 0, and the run goes on.

`custom_reward_function.timeout_s` bounds one batch's scoring: the scorer runs in a child process
that is killed at the limit; samples scored before it keep their scores, the rest score 0 and count
in `reward/num_scorer_timeouts` (and in `reward/num_scorer_errors`). The next batch gets a new process.
"""

from __future__ import annotations

import logging

import pytest
from test_rewards import make_batch

from rlframe.config.loader import load_config
from rlframe.reward import load_reward_manager

SCORER = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.strip() == "hang":
        time.sleep(3600)
    if solution_str.strip() == "raise":
        raise ValueError("user scorer failed on purpose")
    if solution_str.strip() == "nan":
        return float("nan")
    return 1.0

def compute_scores(data_sources, solution_strs, ground_truths, extra_infos):
    return [compute_score(s, r, g) for s, r, g in zip(data_sources, solution_strs, ground_truths)]
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def manager_for(tmp_path, tokenizer, *overrides):
    path = tmp_path / "scorer.py"
    path.write_text(SCORER)
    config = load_config([f"custom_reward_function.path={path}", "custom_reward_function.timeout_s=5", *overrides])
    return load_reward_manager(config, tokenizer)


def batch(tokenizer, responses):
    return make_batch(tokenizer, responses, ["countdown_add"] * len(responses), ["1"] * len(responses))


@pytest.mark.slow  # each test starts scoring processes (spawn)
def test_hanging_scorer_is_cut_off_per_batch_and_the_next_batch_scores(tmp_path, tokenizer):
    manager = manager_for(tmp_path, tokenizer)
    try:
        out = manager(batch(tokenizer, ["1", "2", "hang", "3", "4"]), return_dict=True)
        assert out["reward_extra_info"]["score"] == [1.0, 1.0, 0.0, 0.0, 0.0]  # scored before the hang: kept
        assert out["metrics"] == {"reward/num_scorer_errors": 3, "reward/num_scorer_timeouts": 3}
        out = manager(batch(tokenizer, ["1", "nan", "raise", "3"]), return_dict=True)  # a fresh process
        assert out["reward_extra_info"]["score"] == [1.0, 0.0, 0.0, 1.0]
        assert out["metrics"] == {"reward/num_scorer_errors": 2, "reward/num_scorer_timeouts": 0}
    finally:
        manager._isolated.close()


@pytest.mark.slow
def test_hanging_batch_scorer_fails_the_whole_batch_only(tmp_path, tokenizer):
    manager = manager_for(
        tmp_path, tokenizer, "reward_model.reward_manager=batch", "custom_reward_function.name=compute_scores"
    )
    try:
        out = manager(batch(tokenizer, ["1", "hang", "2"]), return_dict=True)
        assert out["reward_extra_info"]["score"] == [0.0, 0.0, 0.0]
        assert out["metrics"] == {"reward/num_scorer_errors": 3, "reward/num_scorer_timeouts": 3}
        out = manager(batch(tokenizer, ["1", "2"]), return_dict=True)
        assert out["reward_extra_info"]["score"] == [1.0, 1.0]
    finally:
        manager._isolated.close()


@pytest.mark.slow
def test_first_traceback_from_the_scoring_process_is_shown_once(tmp_path, tokenizer, caplog):
    manager = manager_for(tmp_path, tokenizer)
    try:
        with caplog.at_level(logging.WARNING, logger="rlframe.reward.manager"):
            manager(batch(tokenizer, ["raise", "1"]), return_dict=True)
        assert (
            "Traceback" in caplog.text and "in compute_score\nValueError: user scorer failed on purpose" in caplog.text
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlframe.reward.manager"):
            manager(batch(tokenizer, ["raise", "1"]), return_dict=True)
        assert "failed on 1 of 2" in caplog.text and "Traceback" not in caplog.text
    finally:
        manager._isolated.close()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        from rlframe.trainer.config import compose, typed

        typed(compose(["custom_reward_function.timeout_s=0"]))
