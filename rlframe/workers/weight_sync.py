"""The weight-sync stream from the FSDP actor into the rollout: full tensors, gathered a bucket at a time.

`iter_full_params` (full_tensors) all-gathers every FSDP2 parameter on its own: one collective per tensor,
~270 for SmolLM2-135M, each paying gloo's latency on CPU. `iter_full_params_bucketed` gathers the dim-0
shards of many tensors of one dtype with one `all_gather` per bucket of about `bucket_bytes` (flat
buffers, each rank's shard sizes known from DTensor's chunking rule), then cuts each full tensor back out:
the same bytes (a copy, no arithmetic), in the same order, with at most one bucket of full tensors alive
at a time. On CPU with every rank on one machine the gather goes through shared memory instead of gloo's
sockets, and the full tensors yielded are views of it, valid until the stream has moved two buckets on
(`rlframe.distributed.shm_gather`): a consumer copies each one, or keeps it only until the next. Tensors
that are not sharded that way (FSDP1, HSDP's 2-D meshes, plain tensors) go through `iter_full_params`'s
path.

A LoRA actor reaches a rollout engine as `rollout_weights` gives it: merged weights for the HF engine, the base
weights once and then the adapter for vLLM (the merge and the adapter's files are `lora.py`'s). The colocated
rollout loads it as it streams (`sync_lora_to_rollout`); `separate_async`'s rollout pool receives a copy
(`copied_weights`, `ActorRolloutRefWorker.export_weights`) and loads it the same way (`load_rollout_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlframe.distributed.shm_gather import SharedMemoryGroups
from rlframe.workers.full_tensors import iter_full_params, on_mesh_device
from rlframe.workers.lora import (
    ADAPTER,
    base_name,
    full_adapter_state,
    is_adapter_tensor,
    is_lora,
    lora_scalings,
    merged_params,
    peft_adapter_files,
    peft_model_of,
)

BUCKET_BYTES = 64 * 2**20


def _dim0_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's fully_shard layout), its shard on the mesh's device."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
        and tensor.device.type == tensor.device_mesh.device_type
    )


def _kind(tensor: torch.Tensor, mesh_ranks: dict) -> tuple:
    """What tensors of one bucket share: dtype and mesh (by its ranks, the same on every rank).

    `mesh_ranks` caches each mesh's ranks by the mesh object: reading them costs more than the tiny
    model's whole copy, and every parameter shares one mesh.
    """
    mesh = tensor.device_mesh
    if id(mesh) not in mesh_ranks:
        mesh_ranks[id(mesh)] = (mesh, tuple(mesh.mesh.flatten().tolist()))  # the mesh kept alive with its id
    return tensor.dtype, mesh.device_type, mesh_ranks[id(mesh)][1]


def _rows_per_rank(rows: int, world: int) -> list[int]:
    """Rows of each rank's shard under DTensor's Shard(0): torch.chunk's split, empty shards last."""
    chunk = -(-rows // world) if rows else 0
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(world)]


def _gather_bucket(
    bucket: list[tuple[str, torch.Tensor]], memory: SharedMemoryGroups
) -> Iterator[tuple[str, torch.Tensor]]:
    """One gather of the shards of `bucket` (same mesh and dtype); yields the full tensors in order.

    On one machine (CPU) each rank writes its rows of every tensor where they belong in the shared buffer
    and the full tensors are read there, as views (`rlframe.distributed.shm_gather`: valid until the next
    bucket but one); otherwise one flat all_gather through the group's backend, cut into new tensors.
    """
    mesh = bucket[0][1].device_mesh
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    locals_ = [tensor.to_local() for _, tensor in bucket]
    sizes = []  # sizes[i][r]: elements of tensor i held by rank r
    for (name, tensor), local in zip(bucket, locals_):
        rows = _rows_per_rank(tensor.shape[0], world)
        if local.shape[0] != rows[rank]:
            raise RuntimeError(f"weight sync: {name}'s shard has {local.shape[0]} rows, not {rows[rank]}")
        row_numel = math.prod(tensor.shape[1:])
        sizes.append([r * row_numel for r in rows])
    dtype = locals_[0].dtype
    total = sum(tensor.numel() for _, tensor in bucket)
    shared = memory.shared_half(group, total * dtype.itemsize) if locals_[0].device.type == "cpu" else None
    if shared is not None:
        full, offset = shared.view(dtype), 0
        for (_, tensor), local, size in zip(bucket, locals_, sizes):
            start = offset + sum(size[:rank])
            full[start : start + local.numel()].copy_(local.reshape(-1))
            offset += tensor.numel()
        dist.barrier(group=group)
        offset = 0
        for name, tensor in bucket:
            yield name, full[offset : offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
        return
    totals = [sum(s[r] for s in sizes) for r in range(world)]
    width = max(totals)
    send = torch.empty(width, dtype=dtype, device=locals_[0].device)
    flat = torch.cat([local.reshape(-1) for local in locals_])
    send[: flat.numel()].copy_(flat)
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send, group=group)
    offsets = [0] * world
    for (name, tensor), size in zip(bucket, sizes):
        pieces = []
        for r in range(world):
            pieces.append(parts[r][offsets[r] : offsets[r] + size[r]])
            offsets[r] += size[r]
        yield name, torch.cat(pieces).view(tensor.shape)


def iter_full_params_bucketed(model: nn.Module, bucket_bytes: int = BUCKET_BYTES):
    """(name, full tensor) of `model`'s state dict in order, FSDP2 shards gathered a bucket at a time.

    On CPU the buckets go through the shared memory `wrap_fsdp` gave the model (the worker's)."""
    state = model.state_dict()
    if not any(_dim0_sharded(t) for t in state.values()):
        yield from iter_full_params(model)
        return
    memory = getattr(model, "_rlframe_shared_memory", None)
    if memory is None:  # sharded without wrap_fsdp: the model keeps its own
        memory = model._rlframe_shared_memory = SharedMemoryGroups()
    bucket: list[tuple[str, torch.Tensor]] = []
    nbytes, mesh_ranks = 0, {}
    for name, tensor in state.items():
        tensor, sharded = tensor.detach(), _dim0_sharded(tensor)
        same_kind = sharded and bucket and _kind(tensor, mesh_ranks) == _kind(bucket[0][1], mesh_ranks)
        if bucket and (not same_kind or nbytes >= bucket_bytes):
            yield from _gather_bucket(bucket, memory)
            bucket, nbytes = [], 0
        if not sharded:
            yield name, (on_mesh_device(tensor).full_tensor() if hasattr(tensor, "full_tensor") else tensor)
            continue
        bucket.append((name, tensor))
        nbytes += tensor.numel() * tensor.element_size()
    if bucket:
        yield from _gather_bucket(bucket, memory)


@dataclass
class AdapterWeights:
    """A LoRA actor as an engine whose `capabilities.lora` is "adapter" (vLLM) takes it: the base weights while the
    engine still needs them (started from dummy weights: once, first), then the adapter as PEFT saves it."""

    base: Iterable[tuple[str, torch.Tensor]] | None
    tensors: dict[str, torch.Tensor]
    peft_config: Any


def rollout_weights(
    model: nn.Module, adapter: bool, with_base: bool
) -> Iterable[tuple[str, torch.Tensor]] | AdapterWeights:
    """What a rollout engine takes of the actor `model`: its full tensors by HF name; a LoRA actor's merged
    weights, or with `adapter` its `AdapterWeights` (the base only `with_base`).

    A collective under FSDP: every rank calls it and consumes what it returns, in the same order.
    """
    if not is_lora(model):
        return iter_full_params_bucketed(model)
    if not adapter:
        return merged_params(iter_full_params_bucketed(model), lora_scalings(model))
    base = None
    if with_base:
        base = ((base_name(n), t) for n, t in iter_full_params_bucketed(model) if not is_adapter_tensor(n))
    tensors = peft_adapter_files(model, full_adapter_state(model))
    return AdapterWeights(base, tensors, peft_model_of(model).peft_config[ADAPTER])


def load_rollout_weights(rollout, weights: Iterable[tuple[str, torch.Tensor]] | dict | AdapterWeights) -> None:
    """Load what `rollout_weights` gives (or a copy of it: tensors by name) into the rollout engine."""
    if not isinstance(weights, AdapterWeights):
        rollout.update_weights(weights.items() if isinstance(weights, dict) else weights)
        return
    if weights.base is not None:
        rollout.update_weights(weights.base.items() if isinstance(weights.base, dict) else weights.base)
    rollout.update_lora_adapter(weights.tensors, weights.peft_config)


def copied_weights(weights: Iterable[tuple[str, torch.Tensor]] | AdapterWeights) -> dict | AdapterWeights:
    """`rollout_weights`'s answer held in CPU memory of its own (the stream yields views of a buffer it reuses)."""

    def copy(named_tensors):
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in named_tensors}

    if not isinstance(weights, AdapterWeights):
        return copy(weights)
    base = None if weights.base is None else copy(weights.base)
    return AdapterWeights(base, copy(weights.tensors.items()), weights.peft_config)


def drain_weights(weights: Iterable[tuple[str, torch.Tensor]] | AdapterWeights) -> None:
    """Take part in `rollout_weights`'s collectives without keeping anything (the ranks that do not export)."""
    stream = (weights.base or ()) if isinstance(weights, AdapterWeights) else weights
    for _ in stream:
        pass


def sync_lora_to_rollout(rollout, model: nn.Module, adapter: bool) -> None:
    """Send the LoRA actor to the colocated rollout: merged weights, or with `adapter` (an engine whose declared
    `capabilities.lora` is "adapter", vLLM) the adapter after the base once.

    A collective under FSDP: every rank calls it, in the same state (every engine replica is in step).
    """
    load_rollout_weights(rollout, rollout_weights(model, adapter, with_base=rollout.needs_base_weights))
