"""RolloutWorker in this process (a one-process world): versions stamped on the output, weights loaded by push."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.rollout import PROMPT_LEN, RESPONSE_LEN, make_prompts
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.trainer.main_ppo import check_config
from rlframe.workers.rollout_worker import VERSIONS_KEY, RolloutWorker


@pytest.fixture(scope="module")
def worker(tiny_model_path, tmp_path_factory):
    """A RolloutWorker joined to a one-process group through a rendezvous file, as its worker group sets it up."""
    import torch.distributed as dist

    from rlframe.single_controller.worker import RENDEZVOUS_FILE_ENV

    rendezvous = str(tmp_path_factory.mktemp("rendezvous") / "store")
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", RENDEZVOUS_FILE_ENV: rendezvous}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    _, cfg, _, plan = check_config(
        [
            *SMALL,
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            "trainer.device=cpu",
        ],
        check_files=False,
    )
    rollout_worker = RolloutWorker(OmegaConf.to_object(cfg), plan)
    rollout_worker.init_model(torch.get_rng_state())
    yield rollout_worker
    dist.destroy_process_group()
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def test_a_fresh_worker_stamps_version_zero_on_every_response_token(worker):
    out = worker.generate_sequences(make_prompts())
    mask = out.batch["response_mask"]
    assert mask.sum() > 0
    expected = torch.where(mask.bool(), 0, -1).to(torch.int32)
    assert torch.equal(out.batch[VERSIONS_KEY], expected)


def test_pushed_weights_replace_the_engines_and_their_version_is_stamped(worker):
    engine_weights = worker.rollout.model.state_dict()
    pushed = {name: tensor + 0.01 for name, tensor in engine_weights.items() if tensor.is_floating_point()}
    worker.load_weights(3, pushed)
    loaded = worker.rollout.model.state_dict()
    assert all(torch.equal(loaded[name], pushed[name]) for name in pushed)
    out = worker.generate_sequences(make_prompts())
    mask = out.batch["response_mask"].bool()
    assert (out.batch[VERSIONS_KEY][mask] == 3).all() and (out.batch[VERSIONS_KEY][~mask] == -1).all()
