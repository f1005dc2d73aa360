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


def test_actor_and_ref_score_at_the_rollout_temperature(tiny_model_path):
    # verl 0.9.1: old, ref and update log-probs are of logits / rollout.temperature; the worker builds the
    # actor and the reference with it (ActorUpdate.from_config), no batch carries it
    from helpers.fsdp_harness import PROMPT_LEN, Scenario, make_batch, role_for
    from transformers import AutoConfig

    from rlframe.algorithms.update_mode import ActorUpdate
    from rlframe.workers.actor import PPOActor
    from rlframe.workers.model_loading import ModelSpec, load_hf_model
    from rlframe.workers.updater import RoleModel

    config, plan, options = role_for(Scenario(strategy="none", use_remove_padding=False), 4)
    model = load_hf_model(ModelSpec(path=tiny_model_path, role="actor", dtype=torch.float32, use_remove_padding=False))
    data = make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, 4)
    actor = PPOActor(RoleModel(model, options), config, plan, update=ActorUpdate(temperature=0.7))
    log_probs, _ = actor.compute_log_prob(data)
    batch = data.batch
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    expected = logprobs_from_logits(logits.logits[:, PROMPT_LEN - 1 : -1] / 0.7, batch["responses"])
    mask = batch["attention_mask"][:, PROMPT_LEN:].bool()
    torch.testing.assert_close(log_probs[mask], expected[mask], rtol=1e-5, atol=1e-5)
