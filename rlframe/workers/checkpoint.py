"""Checkpoints of one FSDP role through PyTorch Distributed Checkpoint (DCP): resumable at any world size.

Layout of `<dir>/`:

- `model/`, `optimizer/`: DCP folders (`.metadata` + `__<rank>_0.distcp`). Every rank writes only its
  own shards (no full gather); any world size, FSDP1, FSDP2, HSDP or a plain module reads them back,
  DCP re-slicing the saved shards onto the new layout. With LoRA, `model/` holds the adapter alone
  (the frozen base is re-read from model.path), `lora_adapter/adapter_config.json` its PEFT config (rank,
  alpha, targets: for `rlframe merge`), and `optimizer/` the adapter's state.
- `extra_state/rank_<r>.pt`: per rank, the RNG states (torch, CUDA, numpy, `random`, the mini-batch
  shuffle generator) and the lr scheduler, as tensors and plain containers only. Resuming at another
  world size, rank r takes the file of saved rank `r % saved_world_size`.
- `huggingface/` (with `hf_model` in save_contents): `save_pretrained` of the full model + tokenizer;
  with LoRA the merged model, and the PEFT adapter in `huggingface/lora_adapter/`.

Nothing in a checkpoint is loaded by code that can execute it: extra state goes through
`torch.load(weights_only=True)`, DCP's tensors too, and DCP's two pickles (the `.metadata` index and
non-tensor values such as the optimizer's hyperparameters) through a restricted unpickler and
`weights_only=True` instead of torch's defaults (`pickle.load` / `weights_only=False`).
Atomicity is the caller's: the trainer writes a whole step to a temporary folder and renames it. A
stale folder is removed without following a symlink out of `<dir>` (`rlframe.utils.safe_files`), and
a loaded model holding NaN/inf is refused, naming the tensor (`rlframe.models.weight_check`).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import warnings
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from rlframe.config.checks import SAVE_CONTENTS
from rlframe.models.weight_check import check_checkpoint_weights
from rlframe.utils.faults import KillPoints
from rlframe.utils.safe_files import remove_under, replace_folder, write_file_atomically
from rlframe.workers.full_tensors import full_state_dict
from rlframe.workers.lora import checkpoint_options, export_lora_hf, is_lora, save_adapter_config

MODEL_DIR, OPTIMIZER_DIR, EXTRA_DIR, HF_DIR = "model", "optimizer", "extra_state", "huggingface"
METADATA = ".metadata"
_EXTRA_FILE = re.compile(r"^rank_(\d+)\.pt$")
_OLD_LAYOUT = re.compile(r"^(model|optim|extra_state)_world_size_\d+_rank_\d+\.pt$")


# ---------------------------------------------------------------- RNG state as plain data
def rng_state() -> dict:
    """This process's RNG states as tensors and plain containers (loadable with weights_only=True)."""
    bit_generator, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(bit_generator),
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "random": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["key"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py_state = state["random"]
    random.setstate((py_state["version"], tuple(py_state["internal"].tolist()), py_state["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- DCP, loaded without executing code
# What DCP's `.metadata` pickle may name (what torch 2.13 writes): its own metadata dataclasses, the file
# reader's storage record, torch.Size / dtypes / layouts, and the path it was saved to. Each is plain data;
# none can reach os/subprocess/eval, which is all that a crafted index could otherwise call.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` index, refusing any global that is not part of DCP's metadata."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{self.path} refers to {module}.{name}, which is not part of a checkpoint index; refusing to load "
            "it (a crafted .metadata could run code)"
        )


class _NamedFiles(FileSystem):
    """DCP's local file system; a failed read names its file, and each written file is a kill point."""

    def __init__(self, kill_points: KillPoints | None = None):
        super().__init__()
        self.kill_points = kill_points

    @contextmanager
    def create_stream(self, path, mode: str):
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"{path} is not plain data; refusing to load it: {e}") from e
        except Exception as e:
            if "r" not in mode:
                raise
            raise RuntimeError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        if "w" in mode and self.kill_points is not None:
            self.kill_points.hit("checkpoint.file")


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with the `.metadata` index read by `_MetadataUnpickler`, not `pickle.load`,
    and read failures naming the shard file."""

    def __init__(self, path):
        super().__init__(path)
        self.fs = _NamedFiles()

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        path = os.path.join(str(self.path), METADATA if rank is None else f"__{rank}{METADATA}")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values (e.g. optimizer hyperparameters) load with weights_only."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"checkpoint value {fqn!r} is not plain data; refusing to load it: {e}") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


@contextmanager
def _dcp_errors(action: str, folder: str):
    """Re-raise DCP's CheckpointException (a BaseException, which `except Exception` misses) as a RuntimeError
    naming the folder and each rank's cause; silence DCP's warning that it runs in a single process."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            causes = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in e.failures.items())
            raise RuntimeError(f"cannot {action} checkpoint folder {folder}: {causes}") from e


def _dcp_save(state: dict, folder: str, no_dist: bool, kill_points: KillPoints | None = None) -> None:
    writer = FileSystemWriter(folder)
    writer.fs = _NamedFiles(kill_points)
    with _dcp_errors("save", folder):
        dcp.save(state, storage_writer=writer, no_dist=no_dist)


def _dcp_load(state: dict, folder: str, no_dist: bool) -> None:
    reader = SafeFileSystemReader(folder)
    reader.read_metadata()  # a refused index fails here with its own message, not inside DCP's retry chain
    with _dcp_errors("load", folder):
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)


def read_full_tensors(folder: str) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors of a DCP folder (`model/` or `optimizer/`; non-tensor values are left out),
    read in this process alone, without a process group: what an offline merge or a comparison needs."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _require(os.path.join(folder, METADATA), os.path.dirname(folder) or folder)
    metadata = SafeFileSystemReader(folder).read_metadata()
    state = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    _dcp_load(state, folder, no_dist=True)
    return state


# ---------------------------------------------------------------- save
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size of the default process group ((0, 1) without one)."""
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer=None,
    lr_scheduler=None,
    save_contents=SAVE_CONTENTS,
    tokenizer=None,
    generator: torch.Generator | None = None,
    kill_points: KillPoints | None = None,
) -> None:
    """Write this rank's part of the checkpoint under `path` (a collective: every rank calls it).

    Each file written is the kill point `checkpoint.file` of `kill_points` (the worker's, docs/reliability.md)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rank, world_size = _rank_and_world_size()
    unknown = [c for c in save_contents if c not in SAVE_CONTENTS]
    if unknown:
        raise ValueError(f"checkpoint.save_contents has unknown entries {unknown}; valid: {', '.join(SAVE_CONTENTS)}")
    if rank == 0:  # stale shards or rank files of an earlier save (maybe another world size) must not linger
        os.makedirs(path, exist_ok=True)
        for name in (MODEL_DIR, OPTIMIZER_DIR, EXTRA_DIR):
            remove_under(os.path.join(path, name), path)
    _barrier()
    no_dist = not _distributed()
    if "model" in save_contents:
        state = get_model_state_dict(model, options=checkpoint_options(model))  # with LoRA: the adapter only
        _dcp_save(state, os.path.join(path, MODEL_DIR), no_dist, kill_points)
        if rank == 0 and is_lora(model):  # the adapter's rank, alpha and targets, for an offline merge
            save_adapter_config(path, model)
    if "optimizer" in save_contents and optimizer is not None:
        _dcp_save(get_optimizer_state_dict(model, optimizer), os.path.join(path, OPTIMIZER_DIR), no_dist, kill_points)
    if "extra" in save_contents:
        _save_extra(path, rank, world_size, lr_scheduler, generator, kill_points)
    if "hf_model" in save_contents:
        export_hf(os.path.join(path, HF_DIR), model, tokenizer, rank)
    _barrier()


def _save_extra(path: str, rank: int, world_size: int, lr_scheduler, generator, kill_points) -> None:
    folder = os.path.join(path, EXTRA_DIR)
    os.makedirs(folder, exist_ok=True)
    extra = {
        "world_size": world_size,
        "rng": rng_state(),
        "generator": None if generator is None else generator.get_state(),
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
    }
    write_file_atomically(os.path.join(folder, f"rank_{rank}.pt"), lambda f: torch.save(extra, f))
    if kill_points is not None:
        kill_points.hit("checkpoint.file")


# ---------------------------------------------------------------- load
def _require(file: str, checkpoint: str) -> None:
    """Raise naming the checkpoint folder and the missing file (and the old layout, if that is what is there)."""
    if os.path.exists(file):
        return
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"checkpoint folder {checkpoint} does not exist")
    found = sorted(os.listdir(checkpoint))
    old = [name for name in found if _OLD_LAYOUT.match(name)]
    if old:
        raise ValueError(
            f"{checkpoint} holds per-rank torch.save files ({old[0]}, ...), a layout rlframe no longer "
            "reads (it resumed only at the same world size, and unpickling it could run code); "
            "start a fresh run or load it with the rlframe version that wrote it"
        )
    parent = os.path.dirname(file)
    held = sorted(os.listdir(parent)) if os.path.isdir(parent) else found
    where = os.path.relpath(parent, checkpoint) + "/" if os.path.isdir(parent) and parent != checkpoint else "it"
    raise FileNotFoundError(
        f"{checkpoint} is not a complete checkpoint: {os.path.relpath(file, checkpoint)} is "
        f"missing ({where} holds {held})"
    )


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer=None,
    lr_scheduler=None,
    load_contents=("model", "optimizer", "extra"),
    generator: torch.Generator | None = None,
) -> None:
    """Load a checkpoint written by `save_checkpoint` at any world size (a collective: every rank calls it).

    The model is required; optimizer and extra state are loaded when the checkpoint has them
    (`save_contents` may have left them out).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank, world_size = _rank_and_world_size()
    model_dir, optim_dir = os.path.join(path, MODEL_DIR), os.path.join(path, OPTIMIZER_DIR)
    _require(os.path.join(model_dir, METADATA), path)
    if os.path.isdir(optim_dir):
        _require(os.path.join(optim_dir, METADATA), path)
    no_dist = not _distributed()
    model_state = {}
    if "model" in load_contents:
        options = checkpoint_options(model)  # with LoRA: the adapter only
        model_state = get_model_state_dict(model, options=options)  # this rank's shards, filled in place by DCP
        _dcp_load(model_state, model_dir, no_dist)
        set_model_state_dict(model, model_state, options=options)
    if "optimizer" in load_contents and optimizer is not None and os.path.isdir(optim_dir):
        state = get_optimizer_state_dict(model, optimizer)
        _dcp_load(state, optim_dir, no_dist)
        set_optimizer_state_dict(model, optimizer, state)
    if "extra" in load_contents and os.path.isdir(os.path.join(path, EXTRA_DIR)):
        extra = _load_extra(path, rank)
        if rank == 0 and extra["world_size"] != world_size:
            print(
                f"[rlframe] {path} was saved by {extra['world_size']} ranks and is loaded by {world_size}: "
                f"rank r continues the RNG streams of saved rank r % {extra['world_size']}",
                flush=True,
            )
        set_rng_state(extra["rng"])
        if generator is not None and extra["generator"] is not None:
            generator.set_state(extra["generator"])
        if lr_scheduler is not None and extra["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(extra["lr_scheduler"])
    check_checkpoint_weights(model_state, model_dir)  # last: a rank raising earlier would leave its peers in DCP


def _load_extra(path: str, rank: int) -> dict:
    """Rank `rank`'s extra state: the file of saved rank `rank % saved_world_size`."""
    folder = os.path.join(path, EXTRA_DIR)
    ranks = sorted(int(m.group(1)) for name in os.listdir(folder) if (m := _EXTRA_FILE.match(name)))
    if not ranks or ranks != list(range(len(ranks))):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: {EXTRA_DIR}/ should hold rank_0.pt .. "
            f"rank_<W-1>.pt but has ranks {ranks}"
        )
    file = os.path.join(folder, f"rank_{rank % len(ranks)}.pt")
    try:
        extra = torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{file} is not plain data (tensors and containers); refusing to load it: {e}"
        ) from e
    if extra["world_size"] != len(ranks):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: {file} was saved at world size "
            f"{extra['world_size']} but {EXTRA_DIR}/ holds {len(ranks)} rank files"
        )
    return extra


# ---------------------------------------------------------------- Hugging Face export
def export_hf(out_dir: str, model: nn.Module, tokenizer=None, rank: int = 0) -> None:
    """`save_pretrained` of the full (gathered) model on rank 0, written to a temp dir then renamed."""
    state = full_state_dict(model)  # collective: every rank takes part
    if rank != 0:
        return
    if is_lora(model):  # the merged model, and the adapter in lora_adapter/
        export_lora_hf(out_dir, model, state, tokenizer)
        return
    inner = getattr(model, "module", model)  # FSDP1 wraps; FSDP2 does not

    def fill(tmp: str) -> None:
        inner.save_pretrained(tmp, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    replace_folder(out_dir, fill)
