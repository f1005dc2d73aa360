"""DataProto: the one container that flows between the driver and the workers.

A DataProto holds three things about the same `N` samples:

- `batch`: a `tensordict.TensorDict` of tensors whose first dimension is `N`;
- `non_tensor_batch`: a dict of 1-D numpy object arrays of length `N` (uids, raw prompts, ...);
- `meta_info`: a plain dict of per-call information (temperature, metrics, sizes).

Every operation keeps the three aligned, and every misuse fails with a `ValueError`
or `TypeError` that names the keys or sizes involved.
"""

from __future__ import annotations

import copy
import numbers
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "DataProto",
    "all_gather_data_proto",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]


def plain_data(value: Any, where: str, refusal: str) -> Any:
    """`value` as tensors, numbers, strings, bytes (an image's PNG) and lists/tuples/dicts of them: what
    `torch.load(weights_only=True)` reads back. numpy scalars become Python numbers and numpy arrays tensors;
    anything else raises a TypeError naming `where`, followed by `refusal` (what the caller writes, and why only that).

    Used at save time (DataProto.save_to_disk, the checkpoint's data.pt), so that a value a
    weights_only load would refuse fails the save that wrote it, not the load.
    """
    if value is None or isinstance(value, (bool, str, bytes, torch.Tensor)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {k: plain_data(v, f"{where}[{k!r}]", refusal) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_data(v, f"{where}[{i}]", refusal) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(f"{where} is a {type(value).__name__}; {refusal}")


# Why DataProto.save_to_disk refuses a value (plain_data's `refusal`).
_SAVE_TO_DISK_REFUSAL = (
    "DataProto.save_to_disk writes only tensors, numbers, strings, bytes and lists/tuples/dicts of them "
    "(so that loading the file cannot run code)"
)


def _as_object_array(values: Any, key: str) -> np.ndarray:
    """Turn a list/array of per-sample values into a 1-D numpy object array."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise TypeError(
            f"non_tensor_batch[{key!r}] must be a list or numpy array of per-sample values, got {type(values).__name__}"
        )
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # element-wise so lists stay lists instead of becoming a 2-D array
        out[i] = value
    return out


def _index_to_array(idx: Any, length: int) -> np.ndarray:
    """Normalize a slice/int list/array/tensor index into an int64 numpy array."""
    if isinstance(idx, slice):
        return np.ascontiguousarray(np.arange(length)[idx])  # torch.from_numpy rejects negative strides
    if isinstance(idx, torch.Tensor):
        if idx.dtype == torch.bool:
            return np.nonzero(idx.cpu().numpy())[0]
        return idx.cpu().numpy().astype(np.int64).reshape(-1)
    arr = np.asarray(idx)
    if arr.dtype == bool:
        return np.nonzero(arr)[0]
    return arr.astype(np.int64).reshape(-1)


def _merge_meta(metas: Sequence[dict]) -> dict:
    """Merge meta_info dicts of parts; list-valued `metrics` are concatenated per key."""
    merged: dict = {}
    for meta in metas:
        for key, value in meta.items():
            if key == "metrics" and isinstance(value, dict):
                target = merged.setdefault("metrics", {})
                for name, v in value.items():
                    target.setdefault(name, []).extend(v if isinstance(v, list) else [v])
            elif key == "metrics" and isinstance(value, list):
                merged.setdefault("metrics", []).extend(value)
            elif key not in merged:
                merged[key] = value
    return merged


@dataclass
class DataProto:
    """A batch of samples: tensors, per-sample python objects and call-level meta info."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls, tensors: dict | None = None, non_tensors: dict | None = None, meta_info: dict | None = None
    ) -> DataProto:
        """Build from a dict of tensors (same first dim), a dict of per-sample values and meta info."""
        tensors = dict(tensors or {})
        non_tensors = {k: _as_object_array(v, k) for k, v in (non_tensors or {}).items()}
        batch = None
        if tensors:
            for k, v in tensors.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"tensors[{k!r}] must be a torch.Tensor, got {type(v).__name__}")
                if v.dim() == 0:
                    raise ValueError(f"tensors[{k!r}] is a scalar; every tensor needs a batch dimension")
            sizes = {k: v.shape[0] for k, v in tensors.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(f"tensors have different batch sizes: {sizes}")
            batch = TensorDict(tensors, batch_size=[next(iter(sizes.values()))])
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict, meta_info: dict | None = None) -> DataProto:
        """Build from one dict: tensors go to `batch`, everything else to `non_tensor_batch`."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info)

    def check_consistency(self) -> None:
        """Raise if `batch` and `non_tensor_batch` disagree on the number of samples."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(f"DataProto.batch must have exactly one batch dim, got {self.batch.batch_size}")
        sizes = {f"non_tensor_batch[{k!r}]": len(v) for k, v in self.non_tensor_batch.items()}
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value).__name__}")
        if self.batch is not None:
            sizes["batch"] = self.batch.batch_size[0]
        if len(set(sizes.values())) > 1:
            raise ValueError(f"DataProto parts have different lengths: {sizes}")

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, item):
        """`data[i]`: sample i as a length-1 DataProto; slices/index arrays select; a key string returns that field."""
        if isinstance(item, str):
            if self.batch is not None and item in self.batch.keys():
                return self.batch[item]
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            raise KeyError(
                f"{item!r} is in neither batch {self.batch_keys} nor non_tensor_batch {list(self.non_tensor_batch)}"
            )
        if isinstance(item, (int, np.integer)):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"index {item} out of range for DataProto of length {n}")
            return self.select_idxs([item % n])
        return self.select_idxs(item)

    @property
    def batch_keys(self) -> list[str]:
        return [] if self.batch is None else list(self.batch.keys())

    def select_idxs(self, idxs) -> DataProto:
        """Samples at `idxs` (slice, int list/array, bool mask or tensor), in that order.

        A slice gives views of the tensors (no copy), like slicing a tensor; index arrays copy.
        """
        if isinstance(idxs, slice) and (idxs.step is None or idxs.step > 0):  # torch has no negative steps
            batch = None if self.batch is None else self.batch[idxs]
            non_tensor = {k: v[idxs] for k, v in self.non_tensor_batch.items()}
            return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))
        index = _index_to_array(idxs, len(self))
        n = len(self)
        if index.size and (index.min() < -n or index.max() >= n):
            raise IndexError(f"indices out of range for DataProto of length {n}: min {index.min()}, max {index.max()}")
        batch = None
        if self.batch is not None:
            batch = self.batch[torch.from_numpy(index)]
        non_tensor = {k: v[index] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def select(
        self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None, deepcopy: bool = False
    ) -> DataProto:
        """A view with only the named keys (None keeps all of that part)."""

        def pick(available, wanted, part):
            missing = [k for k in wanted if k not in available]
            if missing:
                raise KeyError(f"{part} has no keys {missing}; it has {list(available)}")
            return wanted

        batch = self.batch
        if batch_keys is not None and batch is not None:
            batch = batch.select(*pick(batch.keys(), list(batch_keys), "batch"))
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            keys = pick(non_tensor, list(non_tensor_batch_keys), "non_tensor_batch")
            non_tensor = {k: non_tensor[k] for k in keys}
        else:
            non_tensor = dict(non_tensor)
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {k: meta[k] for k in pick(meta, list(meta_info_keys), "meta_info")}
        else:
            meta = dict(meta)
        if deepcopy:
            batch = None if batch is None else batch.clone()
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(self, batch_keys=(), non_tensor_batch_keys=(), meta_info_keys=()) -> DataProto:
        """Remove the named keys from self and return them as a new DataProto."""
        tensors = {}
        for key in batch_keys:
            if self.batch is None or key not in self.batch.keys():
                raise KeyError(f"cannot pop {key!r}: batch has {self.batch_keys}")
            tensors[key] = self.batch.pop(key)
        non_tensors = {}
        for key in non_tensor_batch_keys:
            if key not in self.non_tensor_batch:
                raise KeyError(f"cannot pop {key!r}: non_tensor_batch has {list(self.non_tensor_batch)}")
            non_tensors[key] = self.non_tensor_batch.pop(key)
        meta = {}
        for key in meta_info_keys:
            if key not in self.meta_info:
                raise KeyError(f"cannot pop {key!r}: meta_info has {list(self.meta_info)}")
            meta[key] = self.meta_info.pop(key)
        return DataProto.from_dict(tensors, non_tensors, meta)

    def union(self, other: DataProto) -> DataProto:
        """Merge `other` into self; shared keys must hold equal values."""
        if len(self) != len(other) and len(self) and len(other):
            raise ValueError(f"cannot union DataProtos of lengths {len(self)} and {len(other)}")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for key in other.batch.keys():
                    if key in self.batch.keys():
                        if not torch.equal(self.batch[key], other.batch[key]):
                            raise ValueError(f"union conflict: batch[{key!r}] differs between the two DataProtos")
                    else:
                        self.batch[key] = other.batch[key]
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch:
                mine = self.non_tensor_batch[key]
                if len(mine) != len(value) or not all(_equal(a, b) for a, b in zip(mine, value)):
                    raise ValueError(f"union conflict: non_tensor_batch[{key!r}] differs between the two DataProtos")
            else:
                self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _equal(self.meta_info[key], value):
                raise ValueError(f"union conflict: meta_info[{key!r}] is {self.meta_info[key]!r} vs {value!r}")
            self.meta_info[key] = value
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ splitting / joining
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` contiguous parts whose sizes differ by at most one (larger first)."""
        if not isinstance(chunks, (int, np.integer)) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunk(chunks) needs a positive int, got {chunks!r}")
        n = len(self)
        base, extra = divmod(n, chunks)
        sizes = [base + (1 if i < extra else 0) for i in range(chunks)]
        return self._split_sizes(sizes)

    def split(self, split_size: int) -> list[DataProto]:
        """Split into parts of `split_size` samples (the last may be smaller)."""
        if not isinstance(split_size, (int, np.integer)) or split_size < 1:
            raise ValueError(f"split(split_size) needs a positive int, got {split_size!r}")
        n = len(self)
        sizes = [min(split_size, n - start) for start in range(0, n, split_size)]
        return self._split_sizes(sizes)

    def _split_sizes(self, sizes: list[int]) -> list[DataProto]:
        parts, start = [], 0
        for size in sizes:
            parts.append(self.select_idxs(slice(start, start + size)))
            start += size
        return parts

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate parts in order; meta_info['metrics'] lists are merged, other meta from the first."""
        data = list(data)
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        ref_batch = data[0].batch_keys
        ref_non = sorted(data[0].non_tensor_batch)
        for i, part in enumerate(data[1:], start=1):
            if sorted(part.batch_keys) != sorted(ref_batch) or sorted(part.non_tensor_batch) != ref_non:
                raise ValueError(
                    f"DataProto.concat: part {i} has keys batch={sorted(part.batch_keys)}, "
                    f"non_tensor={sorted(part.non_tensor_batch)}; part 0 has batch={sorted(ref_batch)}, "
                    f"non_tensor={ref_non}"
                )
        batch = None
        if data[0].batch is not None:
            batch = torch.cat([part.batch for part in data], dim=0)
        non_tensor = {k: np.concatenate([part.non_tensor_batch[k] for part in data]) for k in ref_non}
        return DataProto(
            batch=batch, non_tensor_batch=non_tensor, meta_info=_merge_meta([part.meta_info for part in data])
        )

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every sample; interleave=True gives a,a,b,b (GRPO groups), False gives a,b,a,b."""
        if not isinstance(repeat_times, (int, np.integer)) or repeat_times < 1:
            raise ValueError(f"repeat_times must be a positive int, got {repeat_times!r}")
        n = len(self)
        if interleave:
            index = np.repeat(np.arange(n), repeat_times)
        else:
            index = np.tile(np.arange(n), repeat_times)
        return self.select_idxs(index)

    def reorder(self, indices) -> None:
        """Reorder in place so that new[i] = old[indices[i]]; `indices` must be a permutation."""
        index = _index_to_array(indices, len(self))
        n = len(self)
        if index.shape != (n,) or not np.array_equal(np.sort(index), np.arange(n)):
            raise ValueError(
                f"reorder needs a permutation of range({n}); got {len(index)} indices "
                f"with {len(np.unique(index))} distinct values in [{index.min() if index.size else '-'}, "
                f"{index.max() if index.size else '-'}]"
            )
        reordered = self.select_idxs(index)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    # ------------------------------------------------------------------ misc
    def to(self, device) -> DataProto:
        """Move tensors to `device` (in place) and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def save_to_disk(self, path: str) -> None:
        """Write with `torch.save` as tensors and plain containers only, so that loading cannot run code."""
        torch.save(
            {
                "batch": None if self.batch is None else {k: v for k, v in self.batch.items()},
                "batch_size": None if self.batch is None else list(self.batch.batch_size),
                "non_tensor_batch": {
                    k: [
                        plain_data(v, f"non_tensor_batch[{k!r}][{i}]", _SAVE_TO_DISK_REFUSAL)
                        for i, v in enumerate(values)
                    ]
                    for k, values in self.non_tensor_batch.items()
                },
                "meta_info": plain_data(self.meta_info, "meta_info", _SAVE_TO_DISK_REFUSAL),
            },
            path,
        )

    @staticmethod
    def load_from_disk(path: str) -> DataProto:
        """Read what `save_to_disk` wrote, with `torch.load(weights_only=True)`: a crafted file is refused."""
        try:
            saved = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"{path} is not plain data; refusing to load it: {e}") from e
        if not isinstance(saved, dict) or set(saved) != {"batch", "batch_size", "non_tensor_batch", "meta_info"}:
            raise TypeError(f"{path} does not hold a DataProto written by DataProto.save_to_disk")
        batch = None if saved["batch"] is None else TensorDict(saved["batch"], batch_size=saved["batch_size"])
        non_tensor = {k: _as_object_array(v, k) for k, v in saved["non_tensor_batch"].items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=saved["meta_info"])

    def __getstate__(self):
        # Tensors travel as (dict of tensors, batch size): one buffer per tensor, as fast as
        # TensorDict's own pickling (bench/protocol_pickle.py) and independent of its format.
        tensors = None if self.batch is None else {k: v for k, v in self.batch.items()}
        size = None if self.batch is None else list(self.batch.batch_size)
        return tensors, size, self.non_tensor_batch, self.meta_info

    def __setstate__(self, state):
        tensors, size, non_tensor, meta = state
        self.batch = None if tensors is None else TensorDict(tensors, batch_size=size)
        self.non_tensor_batch, self.meta_info = non_tensor, meta

    def __repr__(self) -> str:
        shapes = {} if self.batch is None else {k: tuple(v.shape) for k, v in self.batch.items()}
        return (
            f"DataProto(len={len(self)}, batch={shapes}, non_tensor={list(self.non_tensor_batch)}, "
            f"meta={list(self.meta_info)})"
        )


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return a is b


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad by repeating leading samples until len is a multiple of `size_divisor`."""
    if size_divisor < 1:
        raise ValueError(f"size_divisor must be >= 1, got {size_divisor}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    if n == 0:
        raise ValueError("cannot pad an empty DataProto")
    index = np.concatenate([np.arange(n), np.arange(pad_size) % n])
    return data.select_idxs(index), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` samples added by `pad_dataproto_to_divisor`."""
    if pad_size == 0:
        return data
    return data.select_idxs(slice(0, len(data) - pad_size))


def all_gather_data_proto(data: DataProto, process_group=None) -> DataProto:
    """Gather a DataProto from every rank of `process_group`, concatenated in rank order.

    Works on gloo: tensors go through `all_gather_object` on CPU copies, so ranks may hold
    different numbers of samples. Returns a new DataProto on the input's device.
    """
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    if world == 1:
        return data
    device = None
    if data.batch is not None and len(data.batch.keys()):
        device = next(iter(data.batch.values())).device
    payload = DataProto(
        batch=None if data.batch is None else data.batch.to("cpu"),
        non_tensor_batch=data.non_tensor_batch,
        meta_info=data.meta_info,
    )
    gathered: list = [None] * world
    dist.all_gather_object(gathered, payload, group=process_group)
    out = DataProto.concat(gathered)
    out.meta_info = dict(data.meta_info)
    if device is not None:
        out.to(device)
    return out
