"""The CPU ranks' shared buffer in /dev/shm (rlframe.distributed.shm_gather): what a rank writes before the
barrier, every rank reads after it, and it stays intact until that rank's next call but one. And FSDP2's
all-gathers and reduce-scatters through it.

On 2 and 3 gloo ranks of one machine: each rank writes its own stretch of calls of several sizes (the buffer
grows once) and reads every rank's; the call before last is still intact (the two halves); nothing is left in
/dev/shm; a group whose /dev/shm is too small gets None (the caller then gathers through gloo). `wrap_fsdp`
installs the shared-memory collectives, and a forward/backward gives gloo's logits bitwise and its gradients
bitwise on 2 ranks (within fp32 rounding on 3, summed in another order).
"""

from __future__ import annotations

import glob

import pytest
import torch
import torch.distributed as dist
from helpers.world import spawned_world

from rlframe.distributed.shm_gather import SharedMemoryGroups

SIZES = [12, 1 << 20, 3 << 20, 40]  # floats per rank; the second outgrows the first buffer


def _worker(rank: int) -> dict:
    world = dist.get_world_size()
    group, result = dist.group.WORLD, {"calls": []}
    memory = SharedMemoryGroups()
    shared_half = memory.shared_half
    for call, size in enumerate(SIZES):
        half = shared_half(group, world * size * 4).view(torch.float32).view(world, size)
        half[rank] = 1000.0 * call + rank
        dist.barrier(group=group)
        result["calls"].append(half[:, [0, -1]].clone())
        if call == len(SIZES) - 1:  # one more call: the last call's half is still intact
            other = shared_half(group, 4 * world).view(torch.float32)
            other[rank] = -1.0
            dist.barrier(group=group)
            result["kept"] = half[:, [0, -1]].clone()
    result["buffer_halves"] = memory.memory(group).buffer.half_bytes
    memory.memory(group).capacity = 0  # no room
    result["no_room"] = shared_half(group, 16) is None
    return result


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
@pytest.mark.parametrize("world", [2, 3])
def test_what_each_rank_writes_every_rank_reads_after_the_barrier(world):
    before = set(glob.glob("/dev/shm/rlframe-gather-*"))
    results = spawned_world(world).run(_worker)
    assert set(glob.glob("/dev/shm/rlframe-gather-*")) == before  # unlinked once every rank had mapped it
    for rank, result in enumerate(results):
        for call, seen in enumerate(result["calls"]):
            expected = torch.tensor([[1000.0 * call + r] * 2 for r in range(world)])
            assert torch.equal(seen, expected), (rank, call)
        assert torch.equal(result["kept"], result["calls"][-1])
        assert result["buffer_halves"] == world * max(SIZES) * 4  # grown to the largest call
        assert result["no_room"]


def _fsdp_worker(rank: int, model_path: str) -> dict:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from rlframe.distributed.parallel_dims import build_fsdp_mesh
    from rlframe.distributed.shm_gather import SharedMemoryAllGather, SharedMemoryReduceScatter
    from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
    from rlframe.workers.model_loading import ModelSpec, load_hf_model

    world, result = dist.get_world_size(), {}
    for comms in ("shared", "gloo"):
        spec = ModelSpec(path=model_path, role="actor", dtype=torch.float32, use_remove_padding=False)
        model = wrap_fsdp(
            load_hf_model(spec),
            FSDPSpec("fsdp2", torch.float32, torch.float32, False, True),
            build_fsdp_mesh("cpu", world, -1),
            "cpu",
        )
        layers = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")]
        groups = [g for m in layers for g in m._get_fsdp_state()._fsdp_param_groups]
        result[f"{comms}_installed"] = all(
            isinstance(g._all_gather_comm, SharedMemoryAllGather)
            and isinstance(g._reduce_scatter_comm, SharedMemoryReduceScatter)
            for g in groups
        )
        if comms == "gloo":
            for m in layers:
                m.set_custom_all_gather(DefaultAllGather())
                m.set_custom_reduce_scatter(DefaultReduceScatter())
        ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(rank))  # each rank its data
        logits = model(input_ids=ids, use_cache=False).logits
        logits.float().square().mean().backward()
        result[comms] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        result[f"{comms}_logits"] = logits.detach()
    return result


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_gathers_and_reduces_through_shared_memory_as_through_gloo(tiny_model_path, world):
    for result in spawned_world(world).run(_fsdp_worker, tiny_model_path):
        assert result["shared_installed"]  # wrap_fsdp put them in (the gloo run then takes them out)
        assert torch.equal(result["shared_logits"], result["gloo_logits"])  # all-gathers: the same bytes
        for name, grad in result["gloo"].items():
            if world == 2:  # a + b, averaged: one rounding either way
                assert torch.equal(result["shared"][name], grad), name
            else:  # three ranks summed in another order: fp32 rounding
                scale = grad.abs().max().clamp_min(1e-12)
                assert (result["shared"][name] - grad).abs().max() <= 1e-6 * scale, name
