"""model.enable_activation_offload: saved activations wait in host memory; gradients are bitwise unchanged.

On CPU the hooks still make every copy (a fresh host buffer, then a fresh tensor on unpack), so these
tests run the whole mechanism; the worker turns it on for CUDA only, where it moves memory (the gpu test).
"""

import pytest
import torch
from helpers.padding import load, make_rl_batch, run
from transformers import AutoConfig

from rlframe.config.schema import inactive_keys
from rlframe.distributed.attention import ATTN_IMPLEMENTATION
from rlframe.trainer.config import compose, typed
from rlframe.workers import activation_offload


@pytest.fixture(scope="module")
def rl_batch(tiny_model_path):
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    return make_rl_batch(prompt_lens=[6, 3, 1, 4], response_lens=[5, 2, 4, 1], vocab_size=vocab)


def _model(path, use_remove_padding, gradient_checkpointing):
    model = load(path, ATTN_IMPLEMENTATION if use_remove_padding else "sdpa")
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_gradients_are_bitwise_equal_with_offload(
    tiny_model_path, rl_batch, use_remove_padding, gradient_checkpointing
):
    model = _model(tiny_model_path, use_remove_padding, gradient_checkpointing)
    kwargs = dict(use_remove_padding=use_remove_padding, calculate_entropy=True)
    plain_out, plain_grads = run(model, rl_batch, **kwargs)
    offload = activation_offload.enable(model)
    out, grads = run(model, rl_batch, **kwargs)
    assert offload.offloaded_bytes > 0
    assert all(torch.equal(out[k], plain_out[k]) for k in plain_out)
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[k], plain_grads[k]) for k in plain_grads)


def test_checkpointing_leaves_only_layer_inputs_to_offload(tiny_model_path, rl_batch):
    """With gradient checkpointing the layers' own saves are recomputed: far fewer bytes go to the host."""
    sizes = {}
    for checkpointing in (False, True):
        model = _model(tiny_model_path, True, checkpointing)
        offload = activation_offload.enable(model)
        run(model, rl_batch, use_remove_padding=True)
        sizes[checkpointing] = offload.offloaded_bytes
    assert 0 < sizes[True] < sizes[False] / 4


def test_parameters_stay_and_activations_are_copied():
    offload = activation_offload.ActivationOffload(torch.device("cpu"))
    weight = torch.nn.Parameter(torch.randn(3, 3))
    assert offload.pack(weight) is weight
    assert offload.pack(weight.t()).data_ptr() == weight.data_ptr()  # a view of a parameter stays too
    activation = weight * 2
    device, host_copy = offload.pack(activation)
    assert host_copy.data_ptr() != activation.data_ptr() and torch.equal(host_copy, activation)
    restored = offload.unpack((device, host_copy))
    assert restored.data_ptr() != host_copy.data_ptr() and torch.equal(restored, activation)


def test_without_grad_nothing_is_offloaded(tiny_model_path, rl_batch):
    model = _model(tiny_model_path, True, False)
    offload = activation_offload.enable(model)
    with torch.no_grad():
        model(input_ids=rl_batch["input_ids"], use_cache=False)
    assert offload.offloaded_bytes == 0


def test_on_cpu_the_switch_is_reported_without_effect():
    for key in ("actor_rollout_ref.model.enable_activation_offload", "critic.model.enable_activation_offload"):
        root = typed(compose(["trainer.device=cpu", "algorithm.adv_estimator=gae", f"{key}=true"]))
        assert "activations already live in host memory" in inactive_keys(root)[key]


@pytest.mark.gpu
def test_offload_lowers_peak_gpu_memory_with_the_same_gradients(tiny_model_path, rl_batch):
    batch = {k: v.repeat(16, 1).cuda() for k, v in rl_batch.items()}
    peaks, grads = {}, {}
    for offload in (False, True):
        model = _model(tiny_model_path, True, False).cuda()
        if offload:
            activation_offload.enable(model)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _, grads[offload] = run(model, batch, use_remove_padding=True, calculate_entropy=True)
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated()
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[False])
    assert peaks[True] < peaks[False]
