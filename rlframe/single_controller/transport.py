"""How a DataProto crosses Ray's object store.

Pickling a torch tensor goes through `torch.save` into a byte string: a copy, slow (~150 MB/s
here), and the object store then copies that string again. A numpy array instead travels as
an out-of-band pickle-5 buffer: it is written into the object store once and read back without
a copy. So tensors travel as raw byte views (`uint8` numpy, any dtype, bf16 included) and are
rebuilt on the other side. Only a DataProto passed or returned at the top level is packed;
anything else uses Ray's ordinary serialization.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlframe.protocol import DataProto


@dataclass
class PackedDataProto:
    """A DataProto whose tensors are raw byte arrays (out-of-band in Ray's serializer)."""

    tensors: dict[str, tuple[np.ndarray, torch.dtype, tuple[int, ...]]] | None
    batch_size: list[int] | None
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]


def pack(data: DataProto) -> PackedDataProto:
    """Byte views of the tensors (no copy when they are contiguous CPU tensors)."""
    tensors = None
    if data.batch is not None:
        tensors = {}
        for key, tensor in data.batch.items():
            tensor = tensor.detach().cpu().contiguous()
            raw = tensor.reshape(-1).view(torch.uint8).numpy()
            tensors[key] = (raw, tensor.dtype, tuple(tensor.shape))
    batch_size = None if data.batch is None else list(data.batch.batch_size)
    return PackedDataProto(tensors, batch_size, data.non_tensor_batch, data.meta_info)


def unpack(packed: PackedDataProto, copy: bool = True) -> DataProto:
    """Rebuild the DataProto; `copy=False` keeps tensors on the (read-only) object-store memory.

    Use `copy=False` only when the caller copies anyway (e.g. concatenation): object-store
    memory is shared by every reader of the object, so writing to it in place would leak
    into other workers' inputs.
    """
    batch = None
    if packed.tensors is not None:
        tensors = {}
        for key, (raw, dtype, shape) in packed.tensors.items():
            if copy:
                raw = raw.copy()
            with warnings.catch_warnings():  # torch warns on read-only arrays; copy=False is deliberate
                warnings.simplefilter("ignore", UserWarning)
                tensors[key] = torch.from_numpy(raw).view(dtype).reshape(shape)
        batch = TensorDict(tensors, batch_size=packed.batch_size)
    return DataProto(batch=batch, non_tensor_batch=packed.non_tensor_batch, meta_info=packed.meta_info)


def pack_value(value: Any) -> Any:
    """Pack a top-level DataProto; leave anything else as it is."""
    return pack(value) if isinstance(value, DataProto) else value


def unpack_value(value: Any, copy: bool = True) -> Any:
    """Inverse of `pack_value`."""
    return unpack(value, copy=copy) if isinstance(value, PackedDataProto) else value
