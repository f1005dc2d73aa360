"""NaN/inf in loaded weights, caught where they enter: one min/max pass over each floating-point tensor.

A model file holding non-finite values (damaged bytes, or a run that diverged and then saved) otherwise
loads silently and turns every log-prob, loss and gradient after it into NaN, far from its cause. The
check reads each tensor once where it was loaded (a sharded tensor: this rank's shard) in one reduction,
a small cost beside reading the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch


class NonFiniteWeightsError(ValueError):
    """A loaded tensor holds NaN or inf; the message names the file (or folder), the tensor and the fix."""


def _local_parts(tensor: object) -> list[torch.Tensor]:
    """The plain tensors this rank holds of `tensor`: a DTensor's local shard (FSDP2), a ShardedTensor's local
    shards (FSDP1's sharded state dict), or the tensor itself."""
    if hasattr(tensor, "to_local"):
        return [tensor.to_local()]
    if hasattr(tensor, "local_shards"):
        return [shard.tensor for shard in tensor.local_shards()]
    return [tensor] if isinstance(tensor, torch.Tensor) else []


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite: NaN and +-inf propagate into the min or the max, so one `aminmax` pass
    decides (measured on CPU: 7 GB/s against 0.4-0.7 GB/s for `isfinite(t).all()`, which builds a mask)."""
    return tensor.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())


def first_non_finite(named_tensors: Iterable[tuple[str, object]]) -> tuple[str, int, int] | None:
    """(name, number of NaN/inf values, size) of the first floating-point tensor holding any, else None."""
    for name, tensor in named_tensors:
        parts = [p for p in _local_parts(tensor) if p.is_floating_point() and not p.is_meta]
        if not all(_finite(p) for p in parts):
            bad = sum(int((~torch.isfinite(p)).sum()) for p in parts)  # counted on the failure path only
            return name, bad, sum(p.numel() for p in parts)
    return None


def weights_file(folder: str, name: str) -> str:
    """The file of a Hugging Face folder that holds tensor `name` (its safetensors index, or its only weights
    file); the folder itself when neither tells."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            file = json.load(f).get("weight_map", {}).get(name)
        if file:
            return os.path.join(folder, file)
    if not os.path.isdir(folder):
        return folder
    files = [n for n in sorted(os.listdir(folder)) if n.endswith((".safetensors", ".bin"))]
    return os.path.join(folder, files[0]) if len(files) == 1 else folder


def check_pretrained_weights(model: torch.nn.Module, folder: str) -> None:
    """After `from_pretrained(folder)`: raise NonFiniteWeightsError naming the file and the tensor holding NaN/inf."""
    found = first_non_finite(model.state_dict().items())
    if found is not None:
        name, bad, size = found
        raise NonFiniteWeightsError(
            f"{weights_file(folder, name)}: tensor {name!r} holds {bad} NaN/inf value(s) of {size}; the file is "
            "damaged or was saved by a run that diverged: point the model path at an intact copy"
        )


def check_checkpoint_weights(state: dict, folder: str) -> None:
    """After a checkpoint's model is loaded from `folder`: raise NonFiniteWeightsError naming the NaN/inf tensor."""
    found = first_non_finite(state.items())
    if found is not None:
        name, bad, size = found
        raise NonFiniteWeightsError(
            f"{folder}: tensor {name!r} holds {bad} NaN/inf value(s) of {size} (this rank's shard); the run had "
            "diverged when it saved this checkpoint: resume from an earlier one (trainer.resume_mode=resume_path "
            "trainer.resume_from_path=<trainer.default_local_dir>/global_step_K)"
        )
