"""Names and checks of config values that need no worker code, so the launch checks run before Ray.

Workers import their accepted names from here (never the other way round): the FSDP strategies,
what a checkpoint may hold and the device and model-folder checks. The rollout engines' names are their
registry's (`rlframe.workers.rollout.registry`); the parallel degrees (shard sizes included) are the batch plan's.
"""

from __future__ import annotations

import os

import torch

STRATEGIES = ("fsdp2", "fsdp")
SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def resolve_device(device: str) -> str:
    """`trainer.device` (auto|cpu|cuda) to a torch device type."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device={device!r} is not one of auto, cpu, cuda")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return device


def planned_device(device: str) -> str:
    """The device type `trainer.device` means on this machine, without the availability check."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def check_model_path(path: str, key: str = "actor_rollout_ref.model.path") -> None:
    """Fail early, naming the key, when a model directory has no config or no weights."""
    if not os.path.isdir(path):
        raise ValueError(f"{key}={path!r} is not a directory; point it at a local Hugging Face model folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{key}={path!r} has no config.json; it is not a Hugging Face model folder")
    names = os.listdir(path)
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        raise ValueError(f"{key}={path!r} has a config.json but no weights (*.safetensors or *.bin)")
