"""Process worlds of the tests: gloo worlds spawned once and kept for many jobs, a free port to rendezvous on, and
the two-GPU tensor-parallel world.

A spawned process spends seconds importing torch, transformers and rlframe before it computes anything: on two cores
that dominated the multi-process tests, which spawned a fresh world for every scenario. `spawned_world(n)` keeps one
`n`-process gloo world for the whole session; a job is a function `fn(rank, *args)` run on every rank at once, its
return values sent back. A job that fails or times out ends its world (the next call spawns a new one), so a job
never meets a world a failure left half way through a collective.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from queue import Empty

import torch
import torch.multiprocessing as mp

JOB_TIMEOUT_S = 300  # one job on every rank, and the gloo collectives' timeout inside it


def free_port() -> int:
    """A TCP port nobody listens on now, for a torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_tp2_gpu_world(rank: int, port: int):
    """This process as rank `rank` of a two-process NCCL world, shown one GPU as Ray shows it (LOCAL_RANK its index on
    the node); returns the world's tensor-parallel group."""
    os.environ.update(
        CUDA_VISIBLE_DEVICES=str(rank), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    return dist.new_group([0, 1])


class SpawnedWorld:
    """`size` spawned processes in one gloo process group (`dist.init_process_group` done once), serving jobs."""

    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        self.size = size
        self.jobs = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_serve, args=(rank, size, port, self.jobs[rank], self.results), name=f"world{size}-{rank}"
            )
            for rank in range(size)
        ]
        arenas = os.environ.get("MALLOC_ARENA_MAX")
        os.environ["MALLOC_ARENA_MAX"] = "2"  # gloo's and autograd's threads each grow a glibc arena: ~2 GB at the peak
        try:
            for proc in self.procs:
                proc.start()
        finally:
            if arenas is None:
                del os.environ["MALLOC_ARENA_MAX"]
            else:
                os.environ["MALLOC_ARENA_MAX"] = arenas

    def run(self, fn, *args, timeout: float = JOB_TIMEOUT_S) -> list:
        """fn(rank, *args) on every rank (the default group initialized, one torch thread each): their return values,
        by rank. A failure on any rank raises here with that rank's traceback; a rank that dies (the OOM killer's
        SIGKILL, a crash) raises at once, naming its exit code."""
        for queue in self.jobs:
            queue.put((fn, args, timeout))
        values, errors, answered = [None] * self.size, [], 0
        deadline = time.monotonic() + timeout
        while answered < self.size:
            try:
                rank, ok, payload = self.results.get(timeout=1)
            except Empty:
                dead = [f"rank {r} died (exit code {p.exitcode})" for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    break
                continue
            answered += 1
            if ok:
                values[rank] = torch.load(payload, mmap=True, weights_only=False)
                os.unlink(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                deadline = min(deadline, time.monotonic() + 30)  # the others may wait in a collective: not for long
        if answered < self.size or errors:
            self.close(kill=True)
            late = [] if answered == self.size else dead or [f"did not finish in {timeout}s (each rank's stacks above)"]
            raise RuntimeError(f"{fn.__name__} on {self.size} processes: " + "\n".join(late + errors))
        return values

    def close(self, kill: bool = False) -> None:
        _WORLDS.pop(self.size, None)
        for proc, queue in zip(self.procs, self.jobs):
            if kill:
                proc.kill()
            elif proc.is_alive():
                queue.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


_WORLDS: dict[int, SpawnedWorld] = {}


def spawned_world(size: int) -> SpawnedWorld:
    """The session's `size`-process gloo world, spawned on first use."""
    if size not in _WORLDS:
        _WORLDS[size] = SpawnedWorld(size)
    return _WORLDS[size]


@atexit.register
def _close_worlds() -> None:
    for world in list(_WORLDS.values()):
        world.close()


def _serve(rank: int, size: int, port: int, jobs, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    parent, seed = os.getppid(), torch.initial_seed()
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=JOB_TIMEOUT_S))
    try:
        while True:
            try:
                job = jobs.get(timeout=2)
            except Empty:
                if os.getppid() != parent:  # the test session died without closing its worlds
                    return
                continue
            if job is None:
                return
            torch.manual_seed(seed)  # every job starts from a fresh process's torch RNG and threads
            torch.set_num_threads(1)
            fn, args, timeout = job
            faulthandler.dump_traceback_later(max(timeout - 5, 1))  # where a job that hangs hangs, before it is killed
            results.put(_outcome(rank, fn, args))
            faulthandler.cancel_dump_traceback_later()
            del job, fn, args
            _give_back_memory()
    finally:
        dist.destroy_process_group()


def _outcome(rank: int, fn, args) -> tuple:
    """(rank, True, a file holding the return value saved by torch) or (rank, False, the traceback). A file, not the
    bytes through the queue: a gradient of a whole model would otherwise be held three times in each process."""
    try:
        value = fn(rank, *args)
        with tempfile.NamedTemporaryFile(prefix=f"world-rank{rank}-", suffix=".pt", delete=False) as file:
            torch.save(value, file)
        return rank, True, file.name
    except BaseException:
        return rank, False, traceback.format_exc()


def _give_back_memory() -> None:
    """Free what the last job left and hand the heap's free pages back to the OS: a world kept for the session must
    not hold a model's worth of memory between jobs."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the pages stay with the process until it exits
        pass
