"""Sharded checkpoints of one FSDP role: model, optimizer, lr scheduler and RNG state per rank.

Layout of `<dir>/`: `model_world_size_W_rank_R.pt`, `optim_world_size_W_rank_R.pt`,
`extra_state_world_size_W_rank_R.pt`, and with `hf_model` in save_contents a `huggingface/`
folder (`save_pretrained` of the full model + tokenizer, written by rank 0). Every file is written
to a temporary name and renamed, so a crash never leaves a half-written file under a real name.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlframe.config.checks import SAVE_CONTENTS
from rlframe.workers.fsdp_utils import full_state_dict

def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _names(rank: int, world: int) -> dict[str, str]:
    suffix = f"world_size_{world}_rank_{rank}.pt"
    return {"model": f"model_{suffix}", "optimizer": f"optim_{suffix}", "extra": f"extra_state_{suffix}"}


def _sharded_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=True)


def save_checkpoint(path: str, model: nn.Module, optimizer=None, lr_scheduler=None, save_contents=SAVE_CONTENTS,
                    tokenizer=None, rank: int = 0, world_size: int = 1) -> None:
    """Write this rank's shards (and, on rank 0, the HF export) under `path`."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    unknown = [c for c in save_contents if c not in SAVE_CONTENTS]
    if unknown:
        raise ValueError(f"checkpoint.save_contents has unknown entries {unknown}; valid: {', '.join(SAVE_CONTENTS)}")
    os.makedirs(path, exist_ok=True)
    names = _names(rank, world_size)
    distributed = dist.is_initialized() and world_size > 1
    if "model" in save_contents:
        state = get_model_state_dict(model, options=_sharded_options()) if distributed else model.state_dict()
        _atomic_save(state, os.path.join(path, names["model"]))
    if "optimizer" in save_contents and optimizer is not None:
        state = (get_optimizer_state_dict(model, optimizer, options=_sharded_options()) if distributed
                 else optimizer.state_dict())
        _atomic_save(state, os.path.join(path, names["optimizer"]))
    if "extra" in save_contents:
        extra = {"rng": rng_state(), "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict()}
        _atomic_save(extra, os.path.join(path, names["extra"]))
    if "hf_model" in save_contents:
        export_hf(os.path.join(path, "huggingface"), model, tokenizer, rank)
    if distributed:
        dist.barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer=None, lr_scheduler=None, rank: int = 0,
                    world_size: int = 1, load_contents=("model", "optimizer", "extra")) -> None:
    """Load this rank's shards written by `save_checkpoint` with the same world size."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    names = _names(rank, world_size)
    model_file = os.path.join(path, names["model"])
    if not os.path.isfile(model_file):
        found = sorted(f for f in os.listdir(path) if f.startswith("model_")) if os.path.isdir(path) else []
        raise FileNotFoundError(f"no checkpoint shard {names['model']} in {path} (found {found}); a checkpoint "
                                f"must be resumed with the world size it was saved with ({world_size} now)")
    distributed = dist.is_initialized() and world_size > 1
    if "model" in load_contents:
        state = torch.load(model_file, weights_only=False)
        if distributed:
            set_model_state_dict(model, state, options=_sharded_options())
        else:
            model.load_state_dict(state)
    optim_file = os.path.join(path, names["optimizer"])
    if "optimizer" in load_contents and optimizer is not None and os.path.isfile(optim_file):
        state = torch.load(optim_file, weights_only=False)
        if distributed:
            set_optimizer_state_dict(model, optimizer, state, options=_sharded_options())
        else:
            optimizer.load_state_dict(state)
    extra_file = os.path.join(path, names["extra"])
    if "extra" in load_contents and os.path.isfile(extra_file):
        extra = torch.load(extra_file, weights_only=False)
        set_rng_state(extra["rng"])
        if lr_scheduler is not None and extra["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(extra["lr_scheduler"])


def export_hf(out_dir: str, model: nn.Module, tokenizer=None, rank: int = 0) -> None:
    """`save_pretrained` of the full (gathered) model on rank 0, written to a temp dir then renamed."""
    state = full_state_dict(model)  # collective: every rank takes part
    if rank != 0:
        return
    import shutil

    inner = getattr(model, "module", model)  # FSDP1 wraps; FSDP2 does not
    tmp = f"{out_dir}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    inner.save_pretrained(tmp, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
