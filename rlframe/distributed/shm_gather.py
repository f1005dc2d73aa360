"""all_gather through shared memory for CPU process groups on one machine.

gloo moves every byte of an all_gather through a loopback socket, one peer at a time. When every rank of a
group runs on this machine, the ranks can instead map one buffer in `/dev/shm`: each writes its part into
its own slot, one barrier, and each reads every slot. The weight sync (`rlframe.workers.weight_sync`)
gathers the whole model this way on every step; for SmolLM2-135M on 2 CPU workers that is 270 MB out and
540 MB in per rank (docs/benchmarks.md §5).

The buffer has two halves used in turn, so one barrier per call is enough: a rank writes call k + 1 into
the other half while its peers may still read call k, and cannot come back to call k's half before every
peer has passed call k + 1's barrier, which each reaches only after it has read call k. The parts returned
are views into the buffer: valid until the next call but one on the same group. The file is unlinked as
soon as every rank has mapped it, so nothing is left in /dev/shm even if a process is killed.
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"


class _SharedBuffer:
    """One mapping of a /dev/shm file shared by every rank of `group`; `halves` x `world` slots of `slot_bytes`."""

    def __init__(self, group, slot_bytes: int):
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.slot_bytes, self.calls = slot_bytes, 0
        nbytes = 2 * self.world * slot_bytes
        path = [None]
        if self.rank == 0:
            fd, path[0] = tempfile.mkstemp(prefix="rlframe-gather-", dir=SHM_DIR)
            os.ftruncate(fd, nbytes)
            os.close(fd)
        dist.broadcast_object_list(path, group_src=0, group=group)
        with open(path[0], "r+b") as file:
            self.map = mmap.mmap(file.fileno(), nbytes)
        dist.barrier(group=group)
        if self.rank == 0:
            os.unlink(path[0])
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def all_gather(self, send: torch.Tensor) -> list[torch.Tensor]:
        nbytes = send.numel() * send.element_size()
        half = self.bytes.view(2, self.world, self.slot_bytes)[self.calls % 2]
        self.calls += 1
        half[self.rank, :nbytes].view(send.dtype).copy_(send.reshape(-1))
        dist.barrier(group=self.group)
        return [half[r, :nbytes].view(send.dtype).view(send.shape) for r in range(self.world)]


@dataclass
class _GroupMemory:
    """What a group agreed on at its first gather: whether its ranks share a machine, and its /dev/shm room."""

    one_machine: bool
    capacity: int  # the least free /dev/shm bytes any rank saw, the same number on every rank
    buffer: _SharedBuffer | None = None


_groups: dict = {}


def _group_memory(group) -> _GroupMemory:
    """Asked once per group (a collective on its first gather): host, boot and free /dev/shm of every rank."""
    if group not in _groups:
        free = 0
        if os.path.isdir(SHM_DIR):
            stat = os.statvfs(SHM_DIR)
            free = stat.f_bavail * stat.f_frsize
        here = (socket.gethostname(), _boot_id())
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (here, free), group=group)
        _groups[group] = _GroupMemory(all(host == here for host, _ in everyone), min(room for _, room in everyone))
    return _groups[group]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def all_gather_cpu(send: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `send` (the same shape and dtype on each), in rank order: `dist.all_gather`'s result.

    Through /dev/shm when the tensors are on the CPU, every rank runs on this machine and the buffer takes
    at most a quarter of the free /dev/shm; through the group's backend otherwise. Every rank decides alike
    (from numbers the ranks agreed on), so all of them take the same path. Parts from /dev/shm are views,
    valid until the next call but one on this group.
    """
    world = dist.get_world_size(group)
    nbytes = send.numel() * send.element_size()
    memory = _group_memory(group) if send.device.type == "cpu" and world > 1 else None
    slot = max(nbytes, 1 << 20)
    if memory is None or not memory.one_machine or 2 * world * slot > memory.capacity // 4:
        parts = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(parts, send, group=group)
        return parts
    if memory.buffer is None or memory.buffer.slot_bytes < nbytes:
        if memory.buffer is not None:  # every rank grows it at the same call; nobody still reads the old one
            dist.barrier(group=group)
        memory.buffer = _SharedBuffer(group, slot)
    return memory.buffer.all_gather(send)
