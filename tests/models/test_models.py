"""Options of the model passes verl users set: model.use_shm, use_torch_compile, the scoring temperature."""

import os

import torch

from rlframe.models.builtin import copy_to_shm
from rlframe.workers.model_forward import _compiled_kernels, entropy_from_logits, logprobs_from_logits


def test_use_shm_copies_the_model_folder_once_and_loads_from_the_copy(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    copy = copy_to_shm(tiny_model_path, shm_root=str(tmp_path))
    assert copy.startswith(str(tmp_path)) and sorted(os.listdir(copy)) == sorted(os.listdir(tiny_model_path))
    assert copy_to_shm(tiny_model_path, shm_root=str(tmp_path)) == copy  # the second worker reuses it
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(copy).state_dict()
    assert all(torch.equal(original[name], loaded[name]) for name in original)


def test_torch_compiled_kernels_match_the_eager_ones():
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0)) * 4
    labels = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    logprobs, entropy = _compiled_kernels()
    torch.testing.assert_close(logprobs(logits, labels), logprobs_from_logits(logits, labels), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy(logits), entropy_from_logits(logits), rtol=1e-5, atol=1e-5)


def test_actor_and_ref_score_at_the_rollout_temperature():
    # verl 0.9.1: old, ref and update log-probs are of logits / rollout.temperature
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from rlframe.protocol import DataProto
    from rlframe.workers.fsdp_workers import ActorRolloutRefWorker

    worker = SimpleNamespace(config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"temperature": 0.7}}}))
    data = DataProto.from_dict({"responses": torch.zeros(2, 3, dtype=torch.long)})
    assert ActorRolloutRefWorker._with_rollout_temperature(worker, data).meta_info["temperature"] == 0.7
