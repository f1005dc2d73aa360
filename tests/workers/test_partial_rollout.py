"""Partial rollout on a RolloutWorker in this process: rows cut mid-generation and continued (rollout/partial.py).

The cut is made by the engine's `interrupt` hook, as the rollout pool's VersionBoard makes it, but after a fixed
number of decoding steps, so that the tests are deterministic.
"""

from __future__ import annotations

import pytest
import torch
from helpers.rollout import RESPONSE_LEN, make_prompts, one_process_rollout_worker, teacher_forced_log_probs

from rlframe.protocol import DataProto
from rlframe.workers.rollout.partial import STOP_KEY, VERSIONS_KEY, continuation_prompts, interrupted


class CutAfter:
    """An `interrupt` that says True from its (calls + 1)-th question on. It is asked once when a micro-batch
    starts, then after each decoding step: rows are cut after `calls` tokens (0: before the first)."""

    def __init__(self, calls: int):
        self.calls, self.asked = calls, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked > self.calls


@pytest.fixture(scope="module")
def worker(tiny_model_path, tmp_path_factory):
    rendezvous = str(tmp_path_factory.mktemp("rendezvous") / "store")
    with one_process_rollout_worker(
        tiny_model_path, rendezvous, "actor_rollout_ref.rollout.calculate_log_probs=true"
    ) as worker:
        yield worker


def _generate_cut(worker, calls: int) -> tuple[DataProto, torch.Tensor]:
    worker.engine.interrupt = CutAfter(calls)
    try:
        out = worker.generate_sequences(make_prompts())
    finally:
        worker.engine.interrupt = None
    flags = interrupted(out)
    out.pop(batch_keys=[STOP_KEY])
    return out, flags


@pytest.mark.parametrize("cut_after", [0, 3], ids=["before-the-first-token", "after-three-tokens"])
def test_a_cut_row_continued_on_the_same_weights_is_the_uncut_row(worker, cut_after):
    state = torch.get_rng_state()
    whole = worker.generate_sequences(make_prompts())
    whole.pop(batch_keys=[STOP_KEY])
    torch.set_rng_state(state)
    cut, flags = _generate_cut(worker, cut_after)
    assert list(cut.non_tensor_batch["sample_seed"]) == list(whole.non_tensor_batch["sample_seed"])
    assert flags.any()
    prefix = cut.batch["response_mask"].sum(-1)
    assert (prefix[flags] == cut_after).all()
    rows = cut.select_idxs(flags)
    continued = worker.continue_sequences(rows)
    assert not interrupted(continued).any()
    expected = whole.select_idxs(flags)
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", VERSIONS_KEY):
        assert torch.equal(continued.batch[key], expected.batch[key]), key
    # the continuation's first token comes from a prefill of prompt + prefix, not from a decoding step: the same
    # value up to the rounding of a differently shaped computation
    torch.testing.assert_close(
        continued.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], rtol=0, atol=1e-5
    )
    uncut = ~flags
    assert torch.equal(cut.batch["responses"][uncut], whole.batch["responses"][uncut])


def test_a_row_cut_under_one_version_continues_under_the_next_with_each_tokens_version_and_log_prob(worker):
    version = worker.versioned.version
    before = {name: tensor.clone() for name, tensor in worker.engine.model.state_dict().items()}
    cut, flags = _generate_cut(worker, 3)
    rows = cut.select_idxs(flags)
    prefix = rows.batch["response_mask"].sum(-1)
    assert (prefix > 0).any()
    gen = torch.Generator().manual_seed(0)
    newer = {
        name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in before.items() if t.is_floating_point()
    }
    worker.load_weights(version + 1, newer)
    continued = worker.continue_sequences(rows)
    mask = continued.batch["response_mask"].bool()
    positions = torch.arange(RESPONSE_LEN)[None, :]
    from_prefix = positions < prefix[:, None]
    assert torch.equal(continued.batch["responses"][from_prefix], rows.batch["responses"][from_prefix])
    versions = continued.batch[VERSIONS_KEY]
    assert (versions[from_prefix] == version).all()
    assert (versions[mask & ~from_prefix] == version + 1).all() and (versions[~mask] == -1).all()
    assert (mask.sum(-1) > prefix).all()  # every cut row got new tokens
    # the behaviour log-probs: the prefix's under the weights that sampled it, the rest under the new ones
    recorded = continued.batch["rollout_log_probs"]
    under_new = teacher_forced_log_probs(worker.engine, continued)
    worker.load_weights(version, before)
    under_old = teacher_forced_log_probs(worker.engine, continued)
    torch.testing.assert_close(recorded[from_prefix], under_old[from_prefix], rtol=0, atol=1e-5)
    torch.testing.assert_close(recorded[~from_prefix], under_new[~from_prefix], rtol=0, atol=1e-5)
    worker.load_weights(version + 1, newer)  # the engine's weights are those of its version again


def test_continuation_prompts_put_prompt_and_prefix_against_the_right_edge():
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    prompt_mask = (prompts > 0).long()
    responses = torch.tensor([[11, 12, 0], [13, 0, 0]])
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rows = DataProto.from_dict(
        {
            "prompts": prompts,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "response_mask": response_mask,
        }
    )
    continuation, budgets = continuation_prompts(rows)
    assert continuation.batch["input_ids"].tolist() == [[0, 5, 6, 11, 12], [7, 8, 9, 4, 13]]
    assert continuation.batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert continuation.batch["position_ids"].tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert budgets.tolist() == [1, 2]
