"""A state of named tensors as byte buckets of bounded size, and back, bit for bit.

A collective moves one flat buffer per call. `plan_buckets` lays the tensors of a state out in buckets of at most
`bucket_bytes` each (a tensor larger than that has a bucket of its own), in the state's order, any dtypes mixed in
one bucket: each tensor's bytes start at a multiple of `ALIGN`, so that unpacking can view them in their own dtype
without a copy. `pack` writes a bucket's tensors into one uint8 buffer; `unpack` gives them back as views of it, so
the buffer must outlive them. The layout (`TensorSlot`s) is plain data, which the sender broadcasts first so that
every receiver allocates the same buffers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 16  # bytes: every dtype's element size divides it


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in its bucket: its name, dtype, shape and first byte."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """The tensors of one buffer, and its size in bytes."""

    slots: tuple[TensorSlot, ...]
    nbytes: int


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """The buckets of `tensors` (name, tensor) in order, each at most `bucket_bytes` unless one tensor alone is
    larger."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, slots, used = [], [], 0  # used: the end of the bucket's last tensor
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if slots and _aligned(used) + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), used))
            slots, used = [], 0
        offset = _aligned(used)
        slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), offset))
        used = offset + nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), used))
    return buckets


def empty_buffer(bucket: Bucket, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialized buffer for `bucket`, which a receive fills."""
    return torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)


def pack(bucket: Bucket, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """`bucket`'s tensors of `state` as one uint8 buffer on `device` (padding bytes zero)."""
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for slot in bucket.slots:
        tensor = state[slot.name]
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"{slot.name}: {tensor.dtype} {tuple(tensor.shape)} does not match the bucket's "
                f"{slot.dtype} {slot.shape}"
            )
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(raw)
    return buffer


def unpack(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `bucket`, views of `buffer` in their dtypes and shapes."""
    if buffer.dtype != torch.uint8 or buffer.numel() != bucket.nbytes:
        raise ValueError(f"a bucket of {bucket.nbytes} bytes needs a uint8 buffer of that size, got {buffer.shape}")
    for slot in bucket.slots:
        raw = buffer[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(slot.dtype).view(slot.shape)
