"""A process group of its own between processes of different worlds: the trainer's weight push.

The training pool and the rollout pool of `trainer.v1.trainer_mode=separate_async` are two torch.distributed
worlds (each Ray worker group its own default group), so `dist.new_group` cannot span them. `PushGroup` builds a
separate group from an explicit TCP rendezvous instead: the sender (rank 0) listens on a `TCPStore`
(`open_store`), every member constructs the backend's process group (`ProcessGroupGloo` on CPU,
`ProcessGroupNCCL` on CUDA) on that store with its rank and the group's size, and the default group of either
world is never touched.

A push starts once every receiver has reached it (each sets a key in the store as its `receive` starts, and every
rank waits for all the keys), so the group's timeout bounds the transfer, not how long the rollout processes take
to finish what was queued before it.
What travels is a state of named tensors, bucketed (`rlframe.distributed.tensor_buckets`): `send` broadcasts the
layout first (pickled into a uint8 tensor, its length before it), then one buffer per bucket; `receive` gives the
layout, and `receive_part` allocates the same buffers and yields each bucket's tensors (views of its buffer) as
it arrives.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlframe.distributed.tensor_buckets import Bucket, empty_buffer, pack, plan_buckets, unpack

SENDER = 0
# how long a push waits for its receivers to reach it (they finish the generations queued before it first): a
# receiver that died ends the run through the driver long before
RECEIVER_WAIT = timedelta(days=1)


def open_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The sender's rendezvous: a TCPStore listening on `port` (0: a free one, `store.port` tells which)."""
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class PushGroup:
    """Rank `rank` of a `world_size`-process group that meets at `host:port` (rank 0 passes its own `store`)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        store: dist.Store | None = None,
    ):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self._store = store  # kept alive: the sender's listens for the group's lifetime
        prefixed = self._prefixed = dist.PrefixStore("rlframe/weight_push", store)
        self._pushes = 0  # pushes so far: the name of the next one's ready keys, the same on every rank
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            torch.cuda.set_device(self.device)
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = SENDER
        self._pg.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def _broadcast_object(self, value: Any = None) -> Any:
        """The sender's `value` on every rank (pickled: plain data only)."""
        if self.rank == SENDER:
            payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(self.device)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        if self.rank != SENDER:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(payload)
        return value if self.rank == SENDER else pickle.loads(payload.cpu().numpy().tobytes())

    def _ready_key(self, rank: int) -> str:
        return f"ready/{self._pushes}/{rank}"

    def _wait_for_receivers(self) -> None:
        """Until every receiver has entered this push's `receive` (on every rank). A receive is queued behind a
        rollout process's generations, which may outlast the group's timeout: the broadcast's clock starts once all
        are there."""
        keys = [self._ready_key(rank) for rank in range(1, self.world_size)]
        self._prefixed.wait(keys, RECEIVER_WAIT)
        self._pushes += 1

    def send(self, parts: dict[str, dict[str, torch.Tensor]], extra: Any, bucket_bytes: int) -> int:
        """Broadcast `parts` (named states of tensors) and `extra` (plain data) from the sender; the bytes sent.

        Each part is cut into buckets of at most `bucket_bytes`, packed one at a time on the group's device."""
        layout = {name: plan_buckets(state.items(), bucket_bytes) for name, state in parts.items()}
        self._wait_for_receivers()
        self._broadcast_object((layout, extra))
        sent = 0
        for name, buckets in layout.items():
            for bucket in buckets:
                buffer = pack(bucket, parts[name], self.device)
                self._broadcast(buffer)
                sent += bucket.nbytes
        return sent

    def receive(self) -> tuple[dict[str, list[Bucket]], Any]:
        """The sender's layout (each part's buckets, in the order they come) and its `extra`; then read each part
        with `receive_part`, in the layout's order."""
        self._prefixed.set(self._ready_key(self.rank), "1")
        self._wait_for_receivers()
        return self._broadcast_object()

    def receive_part(self, buckets: list[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of one part as its buckets arrive: views of a new buffer per bucket. Read it to its end
        (every bucket is a collective)."""
        for bucket in buckets:
            buffer = empty_buffer(bucket, self.device)
            self._broadcast(buffer)
            yield from unpack(bucket, buffer)
