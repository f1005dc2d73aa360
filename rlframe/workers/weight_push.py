"""The collective weight push of `separate_async` (`actor_rollout_ref.rollout.checkpoint_engine.backend=nccl`).

The naive push (verl's default backend) returns the actor's full tensors from the training pool's rank 0 to the
driver, which queues them on every rollout process through Ray's object store. This one moves the same tensors
over a process group of their own (`rlframe.distributed.push_group.PushGroup`: gloo on CPU, nccl on CUDA)
spanning the training pool's rank 0 (rank 0 of the push group) and every process of the rollout pool (rank
1 + its rank there), so each process of a TP replica receives the full tensors it cuts its shard from, as the
naive push gives them.

- `WeightPushSender` (the training processes): `open_weight_push` listens for the group on rank 0 and returns the
  address; `push_weights` gathers the actor's full tensors once on every rank (`weight_sync.rollout_weights`, the
  naive push's stream), rank 0 copies them (the same copy the naive push returns) and hands them to its sending
  thread, which broadcasts them in buckets of `update_weights_bucket_megabytes` while the call returns: the
  training pool goes on to the next step as the bytes move.
- `WeightPushReceiver` (the rollout pool): `join_weight_push` joins the group; `receive_weights`, queued after the
  generations on the older weights as the naive `load_weights` is, receives the buckets and loads them as they
  arrive through the engine's `update_weights` (a LoRA adapter engine's adapter through `load_rollout_weights`).

The tensors are the naive push's, byte for byte (copies and a bucket layout, no arithmetic), so a run is the same
with either backend.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rlframe.distributed.push_group import PushGroup, open_store
from rlframe.single_controller import Dispatch, Execute, register
from rlframe.workers.weight_sync import (
    AdapterWeights,
    copied_weights,
    drain_weights,
    load_rollout_weights,
    rollout_weights,
)

TENSORS, BASE, ADAPTER = "tensors", "base", "adapter"  # the parts a push sends


def push_parts(weights: dict[str, torch.Tensor] | AdapterWeights) -> tuple[dict, dict]:
    """`copied_weights`' answer as the push group sends it: named parts of tensors, and the plain data beside."""
    if not isinstance(weights, AdapterWeights):
        return {TENSORS: weights}, {"kind": TENSORS}
    parts = {BASE: weights.base} if weights.base is not None else {}
    parts[ADAPTER] = weights.tensors
    return parts, {"kind": ADAPTER, "peft_config": weights.peft_config}


def receive_into(group: PushGroup, rollout) -> None:
    """Receive one push and load it into `rollout` as it arrives (the naive push's load path)."""
    layout, extra = group.receive()
    if extra["kind"] == TENSORS:
        stream = group.receive_part(layout[TENSORS])
        load_rollout_weights(rollout, stream)
        for _ in stream:  # every bucket is a collective: read to the end whatever the engine left
            pass
        return
    if BASE in layout:
        stream = group.receive_part(layout[BASE])
        rollout.update_weights(stream)
        for _ in stream:
            pass
    adapter = dict(group.receive_part(layout[ADAPTER]))
    load_rollout_weights(rollout, AdapterWeights(None, adapter, extra["peft_config"]))


def bucket_bytes(config) -> int:
    """actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes, in bytes."""
    return int(config.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes) * 2**20


class WeightSender:
    """The training pool's rank 0 in the push group: its rendezvous, and one thread that joins, then sends."""

    def __init__(self, world_size: int, device: torch.device, bucket_bytes: int, timeout_s: float):
        import ray

        host = ray.util.get_node_ip_address()
        store = open_store(host, 0, world_size, timeout_s)
        self.address = (host, int(store.port))
        self.bucket_bytes = bucket_bytes
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlframe-weight-push")
        # the group forms once every rollout process has joined (`join_weight_push`), meanwhile this call returns
        self._group: Future = self._thread.submit(
            PushGroup, host, self.address[1], 0, world_size, device, timeout_s, store
        )
        self._sending: Future | None = None
        self.previous_push: tuple[int, float] | None = None  # (bytes, seconds) of the send before the latest

    def send(self, weights: dict[str, torch.Tensor] | AdapterWeights) -> None:
        """Start broadcasting `weights` (after the previous push, whose error this raises); returns at once."""
        self.previous_push = self.wait()
        group = self._group.result()
        parts, extra = push_parts(weights)

        def run() -> tuple[int, float]:
            start = time.perf_counter()
            return group.send(parts, extra, self.bucket_bytes), time.perf_counter() - start

        self._sending = self._thread.submit(run)

    def wait(self) -> tuple[int, float] | None:
        """Until the push under way has gone out to every rollout process: its (bytes, seconds), None if none was."""
        if self._sending is None:
            return None
        sent, self._sending = self._sending.result(), None
        return sent


class WeightPushSender:
    """The training processes' side (mixed into `ActorRolloutRefWorker`)."""

    weight_sender: WeightSender | None = None

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def open_weight_push(self, world_size: int) -> tuple[str, int]:
        """Listen for a push group of `world_size` processes (this one and the rollout pool's); the (host, port)
        they join at."""
        self.weight_sender = WeightSender(
            world_size, self.device, bucket_bytes(self.config), float(self.config.actor_rollout_ref.nccl_timeout)
        )
        return self.weight_sender.address

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def push_weights(self, with_base: bool = False) -> tuple[int, float] | None:
        """Gather what the rollout pool's engine takes of the actor (as `export_weights`) and start broadcasting it
        from rank 0; returns once rank 0 holds its copy, while the buckets go out. Rank 0's answer: the bytes and
        seconds of the previous push's broadcast (finished before this one starts), None at the first."""
        adapter = self.rollout_engine.capabilities.lora == "adapter"
        weights = rollout_weights(self.actor_module, adapter, with_base)
        if self.rank != 0:  # its shards reach rank 0 through the gathers
            drain_weights(weights)
            return None
        self.weight_sender.send(copied_weights(weights))
        return self.weight_sender.previous_push


class WeightPushReceiver:
    """The rollout pool's side (mixed into `RolloutWorker`)."""

    push_group: PushGroup | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_push(self, host: str, port: int, world_size: int) -> None:
        """Join the push group at `host:port` as rank 1 + this process's rank in the rollout pool."""
        self.push_group = PushGroup(
            host, port, 1 + self.rank, world_size, self.device, float(self.config.actor_rollout_ref.nccl_timeout)
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int) -> None:
        """Receive the push under way and load it as policy version `version` (the collective `load_weights`)."""
        receive_into(self.push_group, self.rollout)
        self.versioned.version = int(version)
        self._idle_since = time.perf_counter()
