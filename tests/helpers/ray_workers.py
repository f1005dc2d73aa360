"""Ray worker classes the single-controller tests share."""

import sys
import time

import pytest
import torch

from rlframe.protocol import DataProto
from rlframe.single_controller import (
    Dispatch,
    Execute,
    Worker,
    register,
)

# Ray workers cannot import tests/ (it is not on their path): ship this module's classes by value.
ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EchoWorker(Worker):
    """Returns what it got, tagged with its rank, one method per dispatch mode."""

    def __init__(self, offset: float = 0.0):
        self.offset = offset
        self.last_seen = None

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, tag):
        return {
            "rank": self.rank,
            "tag": tag,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "master": (self.master_addr, self.master_port),
        }

    @register(Dispatch.DP_COMPUTE_PROTO)
    def add_offset(self, data: DataProto) -> DataProto:
        """Add the constructor offset to x, in place, and tag each sample with this rank."""
        self.last_seen = data.non_tensor_batch["uid"].tolist()
        data.batch["x"] += 1.0 + self.offset
        data.batch["rank"] = torch.full((len(data),), self.rank)
        return data

    @register(Dispatch.RANK_ZERO)
    def rank_zero_answer(self):
        return self.rank

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero_runs(self):
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def add_one_in_place(self, data: DataProto) -> DataProto:
        data.batch["x"] += 1.0
        return data

    @register(Dispatch.ONE_TO_ALL)
    def sleepy(self, seconds):
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def stamped_sleep(self, seconds):
        """(start, end) of a sleep on the machine's monotonic clock, which every process on it shares."""
        start = time.monotonic()
        time.sleep(seconds)
        return start, time.monotonic()

    @register(Dispatch.ONE_TO_ALL)
    def get_last_seen(self):
        return self.last_seen

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"boom from {rank}")
        return "ok"

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self):
        import torch.distributed as dist

        self.init_process_group()
        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item()

    @register(Dispatch.ONE_TO_ALL)
    def rendezvous_store(self):
        """The kind of store the default process group rendezvoused through (after joining it)."""
        from torch.distributed.distributed_c10d import _get_default_store

        self.all_reduce_rank()
        store = _get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStores wrap the rendezvous store
            store = store.underlying_store
        return type(store).__name__
