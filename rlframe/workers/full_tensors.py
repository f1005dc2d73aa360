"""A sharded model read whole: full tensors one at a time (the weight-sync stream) or as a CPU state dict.

`weight_sync.iter_full_params_bucketed` gathers FSDP2's shards a bucket at a time and falls back to
`iter_full_params` for what is not sharded that way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def on_mesh_device(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor moved to its mesh's device type when its local shard is elsewhere; anything else as is.

    FSDP2's CPUOffloadPolicy keeps shards on the CPU while the mesh (and its nccl group) is CUDA: a
    collective on such a DTensor (`full_tensor`, a norm's reduction) must run on a CUDA copy.
    """
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None or tensor.device.type == mesh.device_type:
        return tensor
    return tensor.to(mesh.device_type)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the unsharded parameters (every rank calls; every rank gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized() or not _is_fsdp(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    # FSDP1's CPU-offload gather crashes on CPU (docs/fsdp_engine.md): gather first, then move.
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=options).items()}


def iter_full_params(model: nn.Module):
    """(name, full tensor) one parameter at a time, on the model's device: the weight-sync stream.

    Under FSDP2 each DTensor is all-gathered on its own (every rank walks the same state-dict order),
    so at most one unsharded tensor is alive at a time, instead of a full CPU copy of the model.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):  # FSDP1 has no per-tensor gather: fall back to the full state dict
        yield from full_state_dict(model).items()
        return
    for name, tensor in model.state_dict().items():
        yield name, (on_mesh_device(tensor).full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP) or any(hasattr(p, "device_mesh") for p in model.parameters())
