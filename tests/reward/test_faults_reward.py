"""A user's reward function that raises, returns NaN or hangs: counted, scored 0 or dropped, and the run goes on.

`custom_reward_function.timeout_s` bounds one batch's scoring: the scorer runs in a child process
that is killed at the limit; samples scored before it keep their scores, the rest score 0 and count
in `reward/num_scorer_timeouts` (and in `reward/num_scorer_errors`). The next batch gets a new process.

`custom_reward_function.on_scorer_error=drop` drops the failed samples instead: they carry no gradient,
their prompt's group statistics are over its kept samples, and the reward metrics leave them out.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from helpers.rewards import make_batch

from rlframe.algorithms.advantage import compute_advantage
from rlframe.config.loader import load_config
from rlframe.protocol import DataProto
from rlframe.reward import NaiveRewardManager, load_reward_manager
from rlframe.reward.manager import drop_failed_samples, group_index

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


def test_dropped_samples_have_no_score_and_are_counted(tmp_path, tokenizer):
    manager = manager_for(
        tmp_path, tokenizer, "custom_reward_function.timeout_s=null", "custom_reward_function.on_scorer_error=drop"
    )
    out = manager(batch(tokenizer, ["1", "raise", "nan", "2"]), return_dict=True)
    assert out["dropped"].tolist() == [False, True, True, False]
    assert out["reward_extra_info"]["score"][::3] == [1.0, 1.0]
    assert all(math.isnan(score) for score in out["reward_extra_info"]["score"][1:3])  # kept out of reward/score/mean
    assert out["reward_tensor"][1:3].abs().sum() == 0
    assert out["metrics"] == {
        "reward/num_scorer_errors": 2,
        "reward/num_scorer_timeouts": 0,
        "reward/num_dropped_samples": 2,
    }


def ppo_batch(tokenizer, responses: list[str], uids: list[str]) -> DataProto:
    """A rollout-shaped batch with what the actor update reads (log-probs from a fixed seed)."""
    data = batch(tokenizer, responses)
    prompts, mask = data.batch["prompts"], data.batch["attention_mask"]
    data.batch["input_ids"] = torch.cat([prompts, data.batch["responses"]], dim=1)
    data.batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(0)
    data.batch["old_log_probs"] = -5.0 + 0.3 * torch.randn(data.batch["responses"].shape, generator=gen)
    data.batch["ref_log_prob"] = -5.0 + 0.3 * torch.randn(data.batch["responses"].shape, generator=gen)
    data.non_tensor_batch["uid"] = np.array(uids, dtype=object)
    return data


def score_and_update(manager, data: DataProto, model_path: str) -> dict:
    """What a training step does with a scored batch: reward, drop, GRPO advantages, one actor update."""
    from helpers.fsdp_harness import Scenario, run_scenario

    result = manager(data, return_dict=True)
    data.batch["token_level_scores"] = data.batch["token_level_rewards"] = result["reward_tensor"]
    if result["dropped"].any():
        drop_failed_samples(data, result["dropped"])
    data.batch["advantages"], _ = compute_advantage(
        "grpo",
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=group_index(data),
        norm_adv_by_std_in_grpo=True,
    )
    return run_scenario(Scenario(strategy="none", micro_batch_size=2), model_path, data)["grads"]


def test_dropped_samples_carry_no_gradient_and_leave_their_group(tmp_path, tokenizer, tiny_model_path):
    """Dropping = never having generated them: the same gradient as the batch without the failed samples.

    token-mean normalizes by the mini-batch's response tokens, which the dropped samples no longer have;
    GRPO's group of prompt "a" is its 3 kept samples (mean and std over them), prompt "c" loses both.
    """
    scorer = tmp_path / "varied.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if 'raise' in solution_str:\n"
        "        raise ValueError('user scorer failed on purpose')\n"
        "    return float(len(solution_str.strip()))\n"
    )
    config = [f"custom_reward_function.path={scorer}", "custom_reward_function.on_scorer_error=drop"]
    manager = load_reward_manager(load_config(config), tokenizer)
    responses = ["1", "22", "raise", "4444", "1", "333", "raise", "raise"]
    uids = ["a", "a", "a", "a", "b", "b", "c", "c"]
    kept = [i for i, text in enumerate(responses) if text != "raise"]

    with_drops = ppo_batch(tokenizer, responses, uids)
    grads = score_and_update(manager, with_drops, tiny_model_path)
    assert with_drops.batch["advantages"][[2, 6, 7]].abs().sum() == 0
    assert with_drops.batch["response_mask"][[2, 6, 7]].sum() == 0

    without = ppo_batch(tokenizer, responses, uids)[kept]  # the same rows, log-probs included
    expected = score_and_update(manager, without, tiny_model_path)
    assert torch.equal(with_drops.batch["advantages"][kept], without.batch["advantages"])
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], rtol=1e-5, atol=1e-7), name


def test_drop_with_dynamic_sampling_is_refused_before_the_run():
    from rlframe.trainer.config import compose, typed

    with pytest.raises(ValueError, match="on_scorer_error=drop with algorithm.filter_groups.enable=true"):
        typed(compose(["custom_reward_function.on_scorer_error=drop", "algorithm.filter_groups.enable=true"]))


def scored_grpo(tokenizer, returned: list, on_scorer_error: str):
    """Score one prompt's group of samples with `returned` as the scorer's results; (manager output, advantages)."""

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return returned[extra_info["index"]]

    data = batch(tokenizer, ["1"] * len(returned))
    data.non_tensor_batch["uid"] = np.array(["a"] * len(returned), dtype=object)
    out = NaiveRewardManager(tokenizer, compute_score=compute_score, on_scorer_error=on_scorer_error)(
        data, return_dict=True
    )
    if out["dropped"].any():
        drop_failed_samples(data, out["dropped"])
    advantages, _ = compute_advantage(
        "grpo",
        token_level_rewards=out["reward_tensor"],
        response_mask=data.batch["response_mask"],
        index=group_index(data),
        norm_adv_by_std_in_grpo=True,
    )
    return out, advantages


@pytest.mark.parametrize("on_scorer_error", ["zero", "drop"])
@pytest.mark.parametrize(
    "returned, failed",
    [([1e20, 1.0, 0.0, 1.0], [0]), ([3e38, 3e38, 0.0, 1.0], [0, 1])],
    ids=["1e20", "two 3e38"],
)
def test_a_score_that_would_overflow_its_groups_statistics_is_a_scorer_error(
    tokenizer, caplog, returned, failed, on_scorer_error
):
    """Before: 1e20 made its group's std inf (every advantage 0) and two 3e38 made the mean inf (advantages NaN),
    with no error counted. Now such a score fails its sample like NaN; the others keep a finite GRPO signal."""
    with caplog.at_level(logging.WARNING, logger="rlframe.reward.manager"):
        out, advantages = scored_grpo(tokenizer, returned, on_scorer_error)
    assert out["metrics"]["reward/num_scorer_errors"] == len(failed)
    assert out["dropped"].tolist() == [on_scorer_error == "drop" and i in failed for i in range(4)]
    assert torch.isfinite(advantages).all()
    kept = [0.0 if i in failed else score for i, score in enumerate(returned)]
    if on_scorer_error == "drop":
        kept = [score for i, score in enumerate(returned) if i not in failed]
    _, expected = scored_grpo(tokenizer, kept, on_scorer_error)  # what a scorer giving 0 (or nothing) yields
    kept_rows = [i for i in range(4) if not (on_scorer_error == "drop" and i in failed)]
    assert torch.equal(advantages[kept_rows], expected)
    assert advantages.abs().sum() > 0
    assert "is beyond ±2.81e+14 (2**48)" in caplog.text


def test_a_large_but_safe_score_is_placed_unchanged(tokenizer):
    returned = [2.0**48, -(2.0**48), 1e14, 0.5]
    out, advantages = scored_grpo(tokenizer, returned, "zero")
    assert out["metrics"]["reward/num_scorer_errors"] == 0
    assert out["reward_tensor"].sum(-1).tolist() == [torch.tensor(s, dtype=torch.float32).item() for s in returned]
    assert out["reward_extra_info"]["score"] == returned
    assert torch.isfinite(advantages).all() and advantages.abs().sum() > 0


@pytest.mark.slow
def test_a_run_with_dropped_samples_trains_on_the_rest_and_counts_them(tmp_path, cache_dir):
    """The real trainer (Ray, 2 CPU workers): the scorer raises on every prompt with an odd answer."""
    from helpers.runs import COMMON, read_metrics, run_main

    scorer = tmp_path / "odd_fails.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if int(ground_truth) % 2:\n"
        "        raise ValueError('user scorer failed on purpose')\n"
        "    return 1.0 + 0.5 * (len(solution_str) % 2)\n"
    )
    run_dir = tmp_path / "run"
    overrides = [
        *COMMON,
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=3",
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"custom_reward_function.path={scorer}",
        "custom_reward_function.on_scorer_error=drop",
    ]
    out = run_main(overrides, cache_dir)
    assert out.returncode == 0, out.stderr[-4000:]
    steps = [m for m in read_metrics(run_dir) if "reward/num_dropped_samples" in m]
    assert len(steps) == 3
    assert sum(m["reward/num_dropped_samples"] for m in steps) > 0
    assert any(m["reward/num_dropped_samples"] < 16 for m in steps)  # the check below is not vacuous
    for m in steps:
        assert m["reward/num_dropped_samples"] == m["reward/num_scorer_errors"]
        if m["reward/num_dropped_samples"] < 16:  # some samples kept: their scores only, never a dropped 0
            assert m["critic/score/min"] >= 1.0 and m["reward/score/mean"] >= 1.0
    assert "failed on" in out.stderr and "(dropped)" in out.stderr
