"""Where FSDP's offload puts things, decided so that a GPU run cannot mix devices (checked on CPU).

On a GPU, `param_offload` keeps FSDP2's shards on the CPU while the mesh and its nccl group are CUDA,
and `optimizer_offload` moves Adam's state between steps. The decisions are plain functions tested
here; the same code on CUDA runs in scripts/gpu_check.sh (tests/gpu/test_gpu.py).
"""

from __future__ import annotations

import types

import pytest
import torch

from rlframe.workers import fsdp_wrap, model_loading
from rlframe.workers.fsdp_wrap import FSDPSpec
from rlframe.workers.full_tensors import on_mesh_device
from rlframe.workers.optimizer import move_optimizer_state, optimizer_state_device


def test_optimizer_state_goes_where_its_parameter_steps():
    on_cpu = torch.nn.Parameter(torch.zeros(2))
    assert optimizer_state_device(on_cpu, "cpu") == torch.device("cpu")
    # param_offload: the parameter (and its grad) stay on the CPU, so must Adam's state
    assert optimizer_state_device(on_cpu, "cuda") == torch.device("cpu")
    assert optimizer_state_device(on_cpu, 0) == torch.device("cpu")
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert optimizer_state_device(on_gpu, 0) == torch.device("cuda", 0)
    assert optimizer_state_device(on_gpu, "cpu") == torch.device("cpu")


def test_loading_the_optimizer_keeps_offloaded_parameters_state_on_the_cpu():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    move_optimizer_state(optimizer, 0)  # what _load_optimizer asks on a GPU; the parameters are on the CPU
    for param, state in optimizer.state.items():
        for key, value in state.items():
            assert value.device.type == "cpu", key
            assert torch.equal(value, before[id(param)][key])
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # the second step runs with every tensor on one device


class _ShardOffMesh:
    """A DTensor's surface as FSDP2 leaves it under CPUOffloadPolicy: local shard on the CPU, CUDA mesh."""

    device = torch.device("cpu")
    device_mesh = types.SimpleNamespace(device_type="cuda")

    def __init__(self):
        self.moved_to = None

    def to(self, device):
        self.moved_to = device
        return self


def test_collectives_on_offloaded_shards_run_on_the_mesh_device():
    shard = _ShardOffMesh()
    assert on_mesh_device(shard).moved_to == "cuda"
    plain = torch.ones(2)
    assert on_mesh_device(plain) is plain
    on_mesh = types.SimpleNamespace(device=torch.device("cpu"), device_mesh=types.SimpleNamespace(device_type="cpu"))
    assert on_mesh_device(on_mesh) is on_mesh  # a CPU mesh (gloo) takes CPU shards as they are


def test_fsdp2_wrap_leaves_the_model_where_it_is_and_shards_layer_by_layer(monkeypatch, tiny_model_path):
    """fully_shard moves each module's states to the device itself; moving the whole model first costs its full size."""
    import torch.distributed.fsdp as fsdp

    model = model_loading.load_hf_model(
        model_loading.ModelSpec(path=tiny_model_path, role="actor", dtype=torch.float32, use_remove_padding=False)
    )
    calls = []

    def fake_fully_shard(module, **kwargs):
        calls.append((module, {p.device.type for p in module.parameters()}))
        return module

    monkeypatch.setattr(fsdp, "fully_shard", fake_fully_shard)
    spec = FSDPSpec("fsdp2", torch.bfloat16, torch.float32, param_offload=False, reshard_after_forward=True)
    fsdp_wrap._wrap_fsdp2(model, spec, mesh=None, device_type="cuda", shared_memory=None)
    layers = fsdp_wrap.decoder_layers(model)
    assert [module for module, _ in calls] == [*layers, model]
    assert all(devices == {"cpu"} for _, devices in calls)  # nothing was moved before sharding


# ---------------------------------------------------------------------------------------- 2 processes
def _offload_worker(rank: int, model_path: str, threads: int) -> dict | None:

    from rlframe.distributed.parallel_dims import build_fsdp_mesh
    from rlframe.workers.full_tensors import iter_full_params
    from rlframe.workers.model_loading import ModelSpec, load_hf_model
    from rlframe.workers.optimizer import clip_grad_norm

    torch.set_num_threads(threads)  # the reference's: the same kernels, the same sums (tiny gradients compared)
    torch.manual_seed(0)
    model = load_hf_model(ModelSpec(model_path, "actor", torch.float32, use_remove_padding=False))
    spec = FSDPSpec("fsdp2", torch.float32, torch.float32, param_offload=True, reshard_after_forward=True)
    model = fsdp_wrap.wrap_fsdp(model, spec, build_fsdp_mesh("cpu", 2, -1), "cpu")
    ids = torch.arange(12).reshape(2, 6) + 3
    model(input_ids=ids[rank : rank + 1]).logits.float().pow(2).mean().backward()
    norm = clip_grad_norm(model, max_norm=1e-3)  # far below the norm: clipping is active
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    params = dict(iter_full_params(model))
    return {"norm": norm, "grads": grads, "params": params} if rank == 0 else None


@pytest.mark.slow
def test_param_offload_grad_norm_clip_and_weight_stream_match_a_plain_model(tiny_model_path):
    from helpers.world import spawned_world

    got = spawned_world(2).run(_offload_worker, tiny_model_path, torch.get_num_threads())[0]

    torch.manual_seed(0)
    model = model_loading.load_hf_model(model_loading.ModelSpec(tiny_model_path, "actor", torch.float32, False))
    ids = torch.arange(12).reshape(2, 6) + 3
    # FSDP2 averages gradients over the 2 ranks: the reference is the mean of the two ranks' losses
    sum(model(input_ids=ids[r : r + 1]).logits.float().pow(2).mean() for r in range(2)).div(2).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    assert torch.allclose(got["norm"], norm, rtol=1e-5, atol=0)
    for name, param in model.named_parameters():
        assert torch.allclose(got["grads"][name], param.grad, rtol=1e-5, atol=1e-12), name
    state = model.state_dict()
    assert set(got["params"]) == set(state)
    for name, tensor in state.items():
        assert torch.equal(got["params"][name], tensor), name
