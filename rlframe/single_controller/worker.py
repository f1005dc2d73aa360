"""Worker: the base class of every process a worker group manages (one per device)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch

from rlframe.config import trace
from rlframe.distributed.shm_gather import SharedMemoryGroups
from rlframe.single_controller.errors import WorkerError
from rlframe.single_controller.transport import pack_value, unpack_value
from rlframe.utils.faults import KillPoints
from rlframe.utils.shm import remove_registered

# Environment a worker group sets on each worker process before its class is constructed.
# Set for a group whose ranks all run on one node: torch.distributed rendezvouses through this file
# (a FileStore) instead of a TCPStore, which would listen on every network interface of rank 0's node.
RENDEZVOUS_FILE_ENV = "RLFRAME_RENDEZVOUS_FILE"
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", RENDEZVOUS_FILE_ENV)


class _FromEnv:
    """A read-only worker attribute: the environment variable `name` the group set, cast, or its default."""

    def __init__(self, name: str, cast, default, doc: str):
        self.name, self.cast, self.default, self.__doc__ = name, cast, default, doc

    def __get__(self, worker, owner=None):
        return self if worker is None else self.cast(os.environ.get(self.name, self.default))


class Worker:
    """One process of a worker group: knows its place, sets up torch.distributed on request.

    Rank, world size, local rank and the rendezvous address come from the environment the
    group sets when it creates the process, so they are valid inside a subclass's `__init__`
    (which may call `init_process_group` right away). Outside a group they default to a
    single process.
    """

    def __repr__(self) -> str:
        # Ray prefixes what a worker prints with its repr: "(ColocatedWorker rank 1 pid=...)" names the rank
        return f"{type(self).__name__} rank {self.rank}"

    rank = _FromEnv("RANK", int, 0, "Global rank of this process in its worker group.")
    world_size = _FromEnv("WORLD_SIZE", int, 1, "Number of processes in the worker group.")
    local_rank = _FromEnv("LOCAL_RANK", int, 0, "Index of this process among the group's processes on its node.")
    local_world_size = _FromEnv("LOCAL_WORLD_SIZE", int, 1, "Number of the group's processes on this node.")
    master_addr = _FromEnv("MASTER_ADDR", str, "127.0.0.1", "IP of rank 0's node, where torch.distributed meets.")
    master_port = _FromEnv("MASTER_PORT", int, 29500, "Port on rank 0's node for the rendezvous (free when built).")

    @property
    def device(self) -> torch.device:
        """This worker's accelerator: the one CUDA device Ray assigned it, else the CPU."""
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # Ray narrows CUDA_VISIBLE_DEVICES to this process's GPU(s); with one visible it is index 0.
        index = 0 if torch.cuda.device_count() == 1 else self.local_rank
        return torch.device("cuda", index)

    def init_process_group(self, backend: str | None = None, timeout_s: float = 600.0) -> None:
        """Join the group's default process group (gloo on CPU, nccl on CUDA); no-op if joined."""
        import torch.distributed as dist

        if dist.is_initialized():
            return
        if backend is None:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        store_file = os.environ.get(RENDEZVOUS_FILE_ENV)
        dist.init_process_group(
            backend=backend,
            init_method=f"file://{store_file}" if store_file else f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    # ------------------------------------------------------------------ what the process's roles share
    # Owned by the worker (a ColocatedWorker's roles use their host's), created on first use, gone with it.
    @property
    def kill_points(self) -> KillPoints:
        """This process's kill points (`rlframe.utils.faults`)."""
        return self.process_state("kill_points", KillPoints)

    @property
    def shared_memory(self) -> SharedMemoryGroups:
        """What this process's groups agreed on and their /dev/shm buffers (`rlframe.distributed.shm_gather`)."""
        return self.process_state("shared_memory", SharedMemoryGroups)

    @property
    def config_trace(self):
        """The config-read trace of this process (`rlframe.config.trace`): a context, a no-op unless asked for."""
        return self.process_state("config_trace", trace.from_env)

    def process_state(self, name: str, make):
        """The object `name` of this process, made by `make()` on first use: the worker's, or its host's for a
        role of a ColocatedWorker, so that the roles of one process share it (instead of a module global)."""
        owner = self.__dict__.get("_rlframe_host", self)
        states = owner.__dict__.setdefault("_rlframe_process_state", {})
        if name not in states:
            states[name] = make()
        return states[name]

    # ------------------------------------------------------------------ called by the worker group
    def _rlframe_target(self, role: str | None):
        """The object whose methods the group calls: the worker itself (roles: see ColocatedWorker)."""
        if role is not None:
            raise ValueError(f"{type(self).__name__} hosts no roles, asked for role {role!r}")
        return self

    def _rlframe_call(self, role: str | None, method: str, *args, **kwargs):
        """Run `method` on the role's object; a failure comes back as a WorkerError with this rank."""
        target = self._rlframe_target(role)
        try:
            args = tuple(unpack_value(a) for a in args)
            kwargs = {k: unpack_value(v) for k, v in kwargs.items()}
            with self.config_trace:
                return pack_value(getattr(target, method)(*args, **kwargs))
        except Exception:  # noqa: BLE001 - every failure must reach the driver with its rank
            raise WorkerError(self.rank, f"{type(target).__name__}.{method}", traceback.format_exc()) from None

    def _rlframe_release(self) -> None:
        """Remove this process's files in shared memory (LoRA adapters, its hold on a model copy): the group calls it
        before killing it."""
        remove_registered()

    def _rlframe_info(self) -> dict:
        """Where this process runs; the group asks once, so constructor failures surface at build time."""
        import ray

        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            **{key: os.environ.get(key) for key in RANK_ENV},
        }
