"""Length metrics: verl's clip_ratio (at the limit, EOS or not) and rlframe's truncated_ratio (no EOS)."""

import pytest
import torch

from rlframe.protocol import DataProto
from rlframe.trainer.metrics import compute_data_metrics
from rlframe.workers.rollout.base import response_metrics

EOS = 9


def batch_with(response_mask: list[list[int]], responses: list[list[int]], prompt_mask: list[list[int]]) -> DataProto:
    response_mask, responses, prompt_mask = map(torch.tensor, (response_mask, responses, prompt_mask))
    bs, width = response_mask.shape
    zeros = torch.zeros(bs, width)
    return DataProto.from_dict(
        {
            "responses": responses,
            "response_mask": response_mask,
            "attention_mask": torch.cat([prompt_mask, response_mask], -1),
            "token_level_scores": zeros,
            "token_level_rewards": zeros,
            "advantages": zeros,
            "returns": zeros,
        }
    )


def test_clip_ratio_counts_full_length_responses_even_when_they_end_with_eos():
    # row 0: full length ending in EOS; row 1: full length, no EOS; row 2: stopped early by EOS
    batch = batch_with(
        response_mask=[[1, 1, 1], [1, 1, 1], [1, 1, 0]],
        responses=[[5, 6, EOS], [5, 6, 7], [5, EOS, 0]],
        prompt_mask=[[1, 1], [0, 1], [0, 1]],
    )
    metrics = compute_data_metrics(batch, use_critic=False)
    assert metrics["response_length/clip_ratio"] == pytest.approx(2 / 3)
    assert metrics["response_length/mean"] == pytest.approx(8 / 3) and metrics["response_length/min"] == 2
    assert metrics["prompt_length/clip_ratio"] == pytest.approx(1 / 3)
    truncated = response_metrics(batch.batch["response_mask"], batch.batch["responses"], eos_ids=[EOS])
    assert truncated == {"response_length/truncated_ratio": pytest.approx(1 / 3)}


def test_staleness_counts_versions_behind_the_weights_the_step_starts_from():
    from rlframe.trainer.metrics import compute_staleness_metrics

    # step 3 starts from version 2; rows sampled by versions 2, 1, (no token) admitted at 1, and a row a partial
    # rollout cut: its first two tokens from version 0, the rest from version 2
    versions = torch.tensor([[2, 2, -1], [1, -1, -1], [-1, -1, -1], [0, 0, 2]], dtype=torch.int32)
    metrics = compute_staleness_metrics(versions, torch.tensor([1, 1, 1, 0]), step=3)
    assert metrics == {
        "training/off_policy/trajectory_staleness/mean": pytest.approx(2 / 4),
        "training/off_policy/trajectory_staleness/max": 1.0,
        "training/off_policy/trajectory_staleness/min": 0.0,
        "training/off_policy/trajectory_staleness_worst/mean": pytest.approx((0 + 1 + 1 + 2) / 4),
        "training/off_policy/trajectory_staleness_worst/max": 2.0,
        "training/off_policy/trajectory_staleness_worst/min": 0.0,
        "training/off_policy/trajectory_spans/mean": pytest.approx((1 + 1 + 1 + 3) / 4),
        "training/off_policy/trajectory_spans/max": 3.0,
        "training/off_policy/trajectory_spans/min": 1.0,
    }
