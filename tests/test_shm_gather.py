"""all_gather through /dev/shm (rlframe.distributed.shm_gather): gloo's result, bitwise, without its sockets.

On 2 and 3 gloo ranks of one machine: a run of gathers of several sizes and dtypes (the buffer grows once)
equals `dist.all_gather`'s parts; a call's parts are still intact after the next call (the buffer's two
halves); nothing is left in /dev/shm; and a group whose /dev/shm is too small takes gloo's path, with the
same result.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist
from fsdp_harness import free_port

from rlframe.distributed import shm_gather
from rlframe.distributed.shm_gather import all_gather_cpu

SHAPES = [((5, 3), torch.float32), ((0,), torch.float32), ((300_000,), torch.float32), ((7,), torch.int64)]


def _sends(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [
        torch.randn(shape, generator=gen).to(dtype) * 100
        if dtype.is_floating_point
        else torch.randint(9, shape, generator=gen)
        for shape, dtype in SHAPES
    ]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        result = {"shared": [], "gloo": []}
        for send in _sends(rank):
            expected = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(expected, send)
            parts = all_gather_cpu(send, group)
            result["shared"].append([p.clone() for p in parts])
            result["gloo"].append(expected)
        first = all_gather_cpu(torch.full((4,), float(rank)), group)
        all_gather_cpu(torch.full((4,), -1.0), group)  # the other half of the buffer
        result["previous_call"] = [p.clone() for p in first]
        result["buffer"] = shm_gather._groups[group].buffer is not None
        shm_gather._groups[group].capacity = 0  # no room: gloo's path
        shm_gather._groups[group].buffer = None
        result["no_room"] = [p.clone() for p in all_gather_cpu(_sends(rank)[2], group)]
        result["no_room_buffer"] = shm_gather._groups[group].buffer is not None
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_all_gather_equals_gloos(tmp_path, world):
    before = set(glob.glob("/dev/shm/rlframe-gather-*"))
    out = str(tmp_path / "out")
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), out), nprocs=world, join=True)
    assert set(glob.glob("/dev/shm/rlframe-gather-*")) == before  # unlinked once every rank had mapped it
    sends = [_sends(rank) for rank in range(world)]
    for rank in range(world):
        result = torch.load(f"{out}.{rank}", weights_only=True)
        assert result["buffer"] and not result["no_room_buffer"]
        for call, (shared, gloo) in enumerate(zip(result["shared"], result["gloo"])):
            for r in range(world):
                assert shared[r].dtype == gloo[r].dtype and torch.equal(shared[r], gloo[r]), (call, r)
                assert torch.equal(shared[r], sends[r][call])
        assert [p.tolist() for p in result["previous_call"]] == [[float(r)] * 4 for r in range(world)]
        for r in range(world):
            assert torch.equal(result["no_room"][r], sends[r][2])
