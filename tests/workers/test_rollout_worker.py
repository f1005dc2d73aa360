"""RolloutWorker in this process (a one-process world): versions stamped on the output, weights loaded by push."""

from __future__ import annotations

import pytest
import torch
from helpers.rollout import make_prompts, one_process_rollout_worker

from rlframe.workers.rollout.partial import VERSIONS_KEY


@pytest.fixture(scope="module")
def worker(tiny_model_path, tmp_path_factory):
    with one_process_rollout_worker(tiny_model_path, str(tmp_path_factory.mktemp("rendezvous") / "store")) as worker:
        yield worker


def test_a_fresh_worker_stamps_version_zero_on_every_response_token(worker):
    out = worker.generate_sequences(make_prompts())
    mask = out.batch["response_mask"]
    assert mask.sum() > 0
    expected = torch.where(mask.bool(), 0, -1).to(torch.int32)
    assert torch.equal(out.batch[VERSIONS_KEY], expected)


def test_pushed_weights_replace_the_engines_and_their_version_is_stamped(worker):
    engine_weights = worker.engine.model.state_dict()
    pushed = {name: tensor + 0.01 for name, tensor in engine_weights.items() if tensor.is_floating_point()}
    worker.load_weights(3, pushed)
    loaded = worker.engine.model.state_dict()
    assert all(torch.equal(loaded[name], pushed[name]) for name in pushed)
    out = worker.generate_sequences(make_prompts())
    mask = out.batch["response_mask"].bool()
    assert (out.batch[VERSIONS_KEY][mask] == 3).all() and (out.batch[VERSIONS_KEY][~mask] == -1).all()
