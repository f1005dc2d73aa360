"""A buffer in /dev/shm shared by the CPU ranks of one machine: gathers without sockets.

gloo moves every byte of an all_gather through a loopback socket, one peer at a time. When every rank of a
group runs on this machine, the ranks can instead map one buffer in `/dev/shm`: each writes its part where
the whole belongs, one barrier, and every rank reads the whole in place. The weight sync
(`rlframe.workers.weight_sync`) gathers the whole model this way on every step: for SmolLM2-135M on 2 CPU
workers each rank writes its 270 MB of shards and the full tensors are read where they lie, instead of
gloo sending 270 MB each way and copying 540 MB out (docs/benchmarks.md §5).

The protocol of `SharedMemoryGroups.shared_half(group, nbytes)`: every rank of the group calls it with the
same `nbytes`, writes its own bytes of the half it returns, calls `dist.barrier(group)`, and may then read any
byte of it. The buffer has two halves used in turn, so that one barrier per call is enough: a rank writes call
k + 1 into the other half while its peers may still read call k, and cannot come back to call k's half before
every peer has passed call k + 1's barrier, which each reaches only after it has read call k. So what a rank
reads stays intact until its next call but one.

Two things must not end a run. A file in /dev/shm whose pages the tmpfs cannot supply kills the process that
touches them with SIGBUS, and /dev/shm may fill after the group measured it (another process, a model
copy): so rank 0 reserves every page when it creates the buffer, or grows it (`os.posix_fallocate`, which on
tmpfs allocates them or fails with ENOSPC), and when it cannot, every rank of the group gathers through its
backend from then on (one warning says so). And a rank killed while the group sets the buffer up must not
leave the file: rank 0 unlinks it as soon as it has created it, and the others open it through rank 0's open
descriptor (`/proc/<pid>/fd/<fd>`, all ranks run on this machine), so the file never has a name for a
killed process to leave behind. The folder is `rlframe.utils.shm.shm_dir()` ($RLFRAME_SHM_DIR, else /dev/shm).
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlframe.utils.shm import shm_dir


class _SharedBuffer:
    """One mapping of a shared-memory file by every rank of `group`: two halves of `half_bytes`."""

    def __init__(self, map: mmap.mmap, half_bytes: int):
        self.map, self.half_bytes, self.calls = map, half_bytes, 0
        self.halves = torch.frombuffer(map, dtype=torch.uint8).view(2, half_bytes)

    def next_half(self, nbytes: int) -> torch.Tensor:
        half = self.halves[self.calls % 2, :nbytes]
        self.calls += 1
        return half


def _map_for_group(group, nbytes: int) -> mmap.mmap | None:
    """`nbytes` of shared memory mapped by every rank of `group`, every page reserved; None on every rank
    when rank 0 could not reserve them or a rank could not map them. A collective (see the module)."""
    rank, fd, offer = dist.get_rank(group), None, [None]
    if rank == 0:
        fd, offer[0] = _reserve(nbytes)
    try:
        dist.broadcast_object_list(offer, group_src=0, group=group)
        mapped, problem = None, offer[0] if isinstance(offer[0], str) else None
        if problem is None:
            pid, their_fd = offer[0]
            try:
                if rank == 0:
                    mapped = mmap.mmap(fd, nbytes)
                else:
                    with open(f"/proc/{pid}/fd/{their_fd}", "r+b") as file:
                        mapped = mmap.mmap(file.fileno(), nbytes)
            except OSError as error:
                problem = f"rank {dist.get_rank()} could not map it: {error}"
        problems = [None] * dist.get_world_size(group)  # also the barrier: every rank has mapped it
        dist.all_gather_object(problems, problem, group=group)
    finally:
        if fd is not None:
            os.close(fd)  # the mappings keep the pages; the file had no name left
    problem = next((p for p in problems if p is not None), None)
    if problem is None:
        return mapped
    if mapped is not None:
        mapped.close()
    warnings.warn(
        f"a shared-memory buffer of {nbytes} bytes in {shm_dir()}: {problem}; this process group gathers "
        "through its backend from now on (slower, the same results)",
        stacklevel=3,
    )
    return None


def _reserve(nbytes: int) -> tuple[int | None, tuple[int, int] | str]:
    """Rank 0: an open, already unlinked file of `nbytes` whose pages are all allocated, and (pid, fd) for
    the others to open it by; or (None, why not)."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"rlframe-gather-{os.getpid()}-", dir=shm_dir())
    except OSError as error:
        return None, f"cannot create a file there: {error}"
    os.unlink(path)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # tmpfs allocates the pages now, or says ENOSPC: never a SIGBUS later
    except OSError as error:
        os.close(fd)
        return None, f"cannot reserve its pages: {error}"
    return fd, (os.getpid(), fd)


@dataclass
class _GroupMemory:
    """What a group agreed on when first asked: whether its ranks share a machine, and its /dev/shm room."""

    one_machine: bool
    capacity: int  # the least free /dev/shm bytes any rank saw, the same number on every rank
    buffer: _SharedBuffer | None = None
    failed: bool = False  # a buffer could not be reserved or mapped: the backend gathers from then on


class SharedMemoryGroups:
    """What each process group agreed on, and its shared buffer: owned by the worker process that uses them.

    A worker creates one (`rlframe.single_controller.Worker.shared_memory`, shared by the roles of its
    process, so FSDP's collectives and the weight sync of a group use one buffer) and passes it where
    groups gather; its buffers are unmapped when it is closed or collected with the worker.
    """

    def __init__(self):
        self._groups: dict = {}

    def memory(self, group) -> _GroupMemory:
        """Asked once per group (a collective the first time): host, boot and free /dev/shm of every rank."""
        if group not in self._groups:
            free = 0
            if os.path.isdir(shm_dir()):
                stat = os.statvfs(shm_dir())
                free = stat.f_bavail * stat.f_frsize
            here = (socket.gethostname(), _boot_id())
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, (here, free), group=group)
            one_machine = all(host == here for host, _ in everyone)
            self._groups[group] = _GroupMemory(one_machine, min(room for _, room in everyone))
        return self._groups[group]

    def ranks_share_a_machine(self, group) -> bool:
        """Every rank of `group` runs on this machine (a collective the first time a group is asked)."""
        return self.memory(group).one_machine

    def shared_half(self, group, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of the group's shared buffer (uint8, see the module for the protocol), or None.

        None when the ranks are not all on this machine, the buffer (two halves) would take more than a
        quarter of the free /dev/shm they reported, or it could not be reserved (see the module): then gather
        through the group's backend. Every rank decides alike, from numbers the ranks agreed on, the `nbytes`
        they all pass and what rank 0 tells them.
        """
        if dist.get_world_size(group) == 1:
            return None
        memory = self.memory(group)
        half = max(nbytes, 1 << 20)
        if not memory.one_machine or memory.failed or 2 * half > memory.capacity // 4:
            return None
        if memory.buffer is None or memory.buffer.half_bytes < nbytes:
            if memory.buffer is not None:  # every rank grows it at the same call; nobody still reads the old one
                dist.barrier(group=group)
                memory.buffer = None  # its pages go back once no tensor views them
            mapped = _map_for_group(group, 2 * half)
            if mapped is None:
                memory.failed = True
                return None
            memory.buffer = _SharedBuffer(mapped, half)
        return memory.buffer.next_half(nbytes)

    def close(self) -> None:
        """Forget every group and drop the buffers (their mappings close once no tensor views them)."""
        self._groups.clear()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# ------------------------------------------------------------------ FSDP2's collectives through the buffer
try:  # FSDP2's pluggable collectives (torch >= 2.8; the interface lives in a private module)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP keeps its process group's collectives
    AllGather = ReduceScatter = None


def _empty(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


if AllGather is not None:

    class SharedMemoryAllGather(AllGather):
        """FSDP2's parameter all-gather through the shared buffer: write my shard, barrier, read the others'.

        FSDP has already copied this rank's shard into its place in `output_tensor` (`input_tensor` is a
        view of it), so only the other ranks' shards are copied in.
        """

        allocate = staticmethod(_empty)

        def __init__(self, memory: SharedMemoryGroups):
            self.memory = memory

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            nbytes = input_tensor.numel() * input_tensor.element_size()
            half = self.memory.shared_half(group, world * nbytes)
            if half is None:
                return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            slots = half.view(input_tensor.dtype).view(world, input_tensor.numel())
            slots[rank].copy_(input_tensor.reshape(-1))
            dist.barrier(group=group)
            parts = output_tensor.view(world, input_tensor.numel())
            for other in range(world):
                if other != rank:
                    parts[other].copy_(slots[other])
            return None

    class SharedMemoryReduceScatter(ReduceScatter):
        """FSDP2's gradient reduce-scatter through the shared buffer: every rank writes its whole input, then
        sums (and for AVG divides) its own chunk of everyone's, in rank order. Other reductions go through
        the group's backend."""

        allocate = staticmethod(_empty)

        def __init__(self, memory: SharedMemoryGroups):
            self.memory = memory

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            half = None
            if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                half = self.memory.shared_half(group, world * input_tensor.numel() * input_tensor.element_size())
            if half is None:
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            slots = half.view(input_tensor.dtype).view(world, world, output_tensor.numel())
            slots[rank].copy_(input_tensor.view(world, output_tensor.numel()))
            dist.barrier(group=group)
            torch.sum(slots[:, rank], dim=0, out=output_tensor)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(world)
            return None


def use_shared_memory_comms(model: torch.nn.Module, group, memory: SharedMemoryGroups) -> bool:
    """FSDP2 modules of `model` gather parameters and reduce gradients through `memory`'s buffer of `group`
    (their shard group) when every rank of it is on this machine; returns whether they do. A collective (all
    ranks call)."""
    if AllGather is None or dist.get_world_size(group) == 1 or not memory.ranks_share_a_machine(group):
        return False
    modules = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")]
    for module in modules:
        module.set_custom_all_gather(SharedMemoryAllGather(memory))
        module.set_custom_reduce_scatter(SharedMemoryReduceScatter(memory))
    return bool(modules)
