"""DAPO: the dapo reward manager against verl 0.9.1's and the paper's formula; dynamic sampling; its config."""

import importlib

import numpy as np
import pytest
import torch
from helpers.small_config import SMALL
from helpers.verl_reference import verl_core_algos

from rlframe.batch_plan import make_batch_plan
from rlframe.protocol import DataProto
from rlframe.reward.dapo import DAPORewardManager, overlong_penalty
from rlframe.trainer.config import compose, typed
from rlframe.trainer.dynamic_sampling import DynamicSampler, informative_rows

PROMPT, RESPONSE = 3, 10


class DigitTokenizer:
    """Token id t decodes to the character str(t % 10); id 0 is EOS."""

    eos_token = "E"

    def decode(self, ids, skip_special_tokens=True):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(str(int(t) % 10) for t in ids if not (skip_special_tokens and int(t) == 0))

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(r, skip_special_tokens) for r in rows]


def score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response starts with the ground truth, else a partial credit by length."""
    return 1.0 if solution_str.startswith(ground_truth) else len(solution_str) / 20


def make_batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs = len(lengths)
    responses = torch.randint(1, 10, (bs, RESPONSE), generator=g)
    response_mask = torch.zeros(bs, RESPONSE, dtype=torch.long)
    for i, n in enumerate(lengths):
        response_mask[i, :n] = 1
    tensors = {
        "prompts": torch.randint(1, 10, (bs, PROMPT), generator=g),
        "responses": responses,
        "attention_mask": torch.cat([torch.ones(bs, PROMPT, dtype=torch.long), response_mask], dim=1),
        "response_mask": response_mask,
    }
    non_tensors = {
        "data_source": np.array(["digits"] * bs, dtype=object),
        "reward_model": np.array([{"ground_truth": str(responses[i, 0].item())} for i in range(bs)], dtype=object),
    }
    non_tensors["reward_model"][1] = {"ground_truth": "x"}  # one miss: partial credit
    return tensors, non_tensors


def test_overlong_penalty_is_the_papers_formula():
    lengths = torch.tensor([0, 5, 6, 7, 9, 10])
    # L_max 10, buffer 4: no penalty up to 6 tokens, then −(|y| − 6)/4 · 0.5
    expected = [0.0, 0.0, 0.0, -0.125, -0.375, -0.5]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == pytest.approx(expected)


@pytest.mark.parametrize("log", [True, False])
def test_dapo_manager_matches_verl(log):
    verl_core_algos()  # puts verl 0.9.1's source on the path (skips without it)
    from omegaconf import OmegaConf
    from verl import DataProto as VerlDataProto

    verl_dapo = importlib.import_module("verl.workers.reward_manager.dapo")
    lengths = [1, 4, 6, 7, 9, 10]
    tensors, non_tensors = make_batch(lengths)
    buffer = {"enable": True, "len": 4, "penalty_factor": 0.7, "log": log}
    ours = DAPORewardManager(DigitTokenizer(), score, max_resp_len=10, overlong_buffer_cfg=buffer)(
        DataProto.from_dict(tensors=dict(tensors), non_tensors=dict(non_tensors)), return_dict=True
    )
    theirs = verl_dapo.DAPORewardManager(
        DigitTokenizer(), 0, score, max_resp_len=10, overlong_buffer_cfg=OmegaConf.create(buffer)
    )(VerlDataProto.from_dict(tensors=dict(tensors), non_tensors=dict(non_tensors)), return_dict=True)
    torch.testing.assert_close(ours["reward_tensor"], theirs["reward_tensor"])
    assert ours["reward_extra_info"]["acc"] == pytest.approx(theirs["reward_extra_info"]["acc"])
    for name in ("overlong_reward", "overlong"):
        assert (name in ours["reward_extra_info"]) == log == (name in theirs["reward_extra_info"])
        if log:
            mine = [float(v) for v in ours["reward_extra_info"][name]]
            assert mine == pytest.approx([float(v) for v in theirs["reward_extra_info"][name]])


def test_informative_rows_keep_groups_with_a_spread_and_single_samples():
    uids = np.array(["a", "a", "b", "b", "c", "d", "d"], dtype=object)
    values = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.5])
    rows, kept = informative_rows(uids, values)
    assert rows == [0, 1, 4] and kept == 2  # a varies, c is a group of one; b and d are constant


def test_a_sample_without_a_metric_value_does_not_hide_its_groups_spread():
    uids = np.array(["a", "a", "a", "b", "b", "c", "c"], dtype=object)
    values = np.array([1.0, 0.0, np.nan, 1.0, np.nan, np.nan, np.nan])
    rows, kept = informative_rows(uids, values)
    assert rows == [0, 1, 2] and kept == 1  # a varies among its scored samples; b has one, c none


def test_the_filter_metric_must_be_a_number_per_sample():
    from rlframe.trainer.dynamic_sampling import sample_metric

    extra = {"acc": [1, None, True, 0.5]}
    assert np.array_equal(sample_metric(None, "acc", extra), [1.0, np.nan, 1.0, 0.5], equal_nan=True)
    with pytest.raises(ValueError, match=r"metric='acc': sample 1 holds str 'x = 7'"):
        sample_metric(None, "acc", {"acc": [1.0, "x = 7"]})


def rounds(values_per_round, n=2):
    for r, values in enumerate(values_per_round):
        prompts = len(values) // n
        uids = np.repeat(np.array([f"r{r}p{i}" for i in range(prompts)], dtype=object), n)
        scores = torch.zeros(len(values), 4)
        scores[:, -1] = torch.tensor(values, dtype=torch.float32)
        yield DataProto.from_dict(tensors={"token_level_scores": scores}, non_tensors={"uid": uids})


def test_sampler_collects_rounds_then_trims_to_the_training_batch():
    sampler = DynamicSampler(train_batch_size=3, n=2, max_num_gen_batches=0, metric="seq_reward")
    gen = rounds([[1, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]])  # round 1 keeps 1 prompt, round 2 keeps 2
    assert not sampler.add(next(gen), {})
    assert sampler.add(next(gen), {})
    batch, metrics = sampler.take()
    assert len(batch) == 6
    assert list(batch.non_tensor_batch["uid"]) == ["r0p0", "r0p0", "r1p0", "r1p0", "r1p2", "r1p2"]
    assert metrics == {
        "train/num_gen_batches": 2,
        "train/filter_groups/generated_prompts": 6,
        "train/filter_groups/kept_prompts": 3,
        "train/filter_groups/dropped_prompts": 3,
        "train/filter_groups/kept_fraction": 0.5,
        "train/filter_groups/trimmed_prompts": 0,
    }
    assert sampler.num_gen_batches == 0 and not sampler.parts  # the next step starts afresh


def test_sampler_stops_after_max_num_gen_batches_naming_the_keys():
    sampler = DynamicSampler(train_batch_size=2, n=2, max_num_gen_batches=2, metric="acc")
    gen = rounds([[1, 1, 0, 0], [1, 1, 1, 1]])
    extra = {"acc": [1, 1, 0, 0]}
    assert not sampler.add(next(gen), extra)
    with pytest.raises(ValueError, match="data.train_batch_size=2.*max_num_gen_batches=2 is reached"):
        sampler.add(next(gen), {"acc": [1, 1, 1, 1]})


def test_unknown_metric_names_the_fields_present():
    sampler = DynamicSampler(train_batch_size=2, n=2, max_num_gen_batches=0, metric="accuracy")
    with pytest.raises(
        ValueError, match="metric='accuracy'.*fields present: reward, seq_reward, seq_final_reward, acc"
    ):
        sampler.add(next(rounds([[1, 0]])), {"acc": [1, 0]})


DAPO_KEYS = [
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    "data.gen_batch_size=12",
    "reward_model.reward_manager=dapo",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "reward.reward_kwargs.max_resp_len=16",  # verl 0.9.1's newer spelling
]


def test_verl_dapo_command_line_composes_and_plans_the_generation_rounds():
    cfg = compose([*SMALL, *DAPO_KEYS])
    typed(cfg)
    assert cfg.reward_model.reward_kwargs.max_resp_len == 16
    assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.len == 4
    plan = make_batch_plan(cfg)
    assert (plan.filter_groups, plan.gen_batch_size, plan.sequences_per_gen_batch) == (True, 12, 48)
    assert plan.train_batch_size == 8 and plan.sequences_per_step == 32
    assert plan.rollout.sequences_per_gpu * plan.world_size == 48  # the rollout generates whole rounds


def test_gen_batch_size_without_filter_groups_is_refused():
    cfg = compose([*SMALL, "data.gen_batch_size=12"])
    with pytest.raises(ValueError, match="data.gen_batch_size = 12 differs from data.train_batch_size = 8"):
        make_batch_plan(cfg)


def test_overlong_buffer_needs_max_resp_len():
    keys = [k for k in DAPO_KEYS if "max_resp_len" not in k]
    with pytest.raises(
        ValueError, match="overlong_buffer_cfg.enable=true needs reward_model.reward_kwargs.max_resp_len"
    ):
        typed(compose([*SMALL, *keys]))


def test_explain_shows_the_generation_round_next_to_the_training_batch():
    from rlframe.explain.formatting import format_plan

    text = format_plan(make_batch_plan(compose([*SMALL, *DAPO_KEYS, "trainer.n_gpus_per_node=2"])))
    assert (
        "sampling  DAPO dynamic sampling: rounds of gen_batch_size 12 prompts × n 4 = 48 sequences until "
        "train_batch_size 8 prompts have groups whose metric varies, then cut to 32 (max_num_gen_batches: no limit)"
    ) in text
    assert "48 sequences / 2 workers = 24 per worker" in text  # the rollout's dispatch is per round
    assert "32 sequences / 2 workers = 16 per worker" in text  # the actor's is the training batch
