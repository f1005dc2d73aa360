"""The optimizer and what surrounds its step: AdamW over the parameters that train, gradient clipping across
shards, and the optimizer state's offload to the CPU between steps (`optimizer_offload`)."""

from __future__ import annotations

import torch
from torch import nn

from rlframe.workers.full_tensors import on_mesh_device
from rlframe.workers.lora import trainable_parameters


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (with LoRA: the adapter only, so state is kept for it alone).

    `foreach=True` on every device (torch picks it by default on CUDA only): one multi-tensor op per
    update term instead of one op per parameter, the same numbers bitwise (tests/workers/test_optimizer.py).
    Under FSDP2 every parameter is a DTensor and each op pays DTensor's dispatch, so the per-parameter loop
    cost the tiny model's update a quarter of its time on CPU (docs/benchmarks.md).
    """
    return torch.optim.AdamW(
        trainable_parameters(model),
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        weight_decay=optim_cfg.weight_decay,
        foreach=True,
    )


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global grad norm across shards, clipped in place; returns the norm before clipping."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return model.clip_grad_norm_(max_norm)
    params = [p for p in model.parameters() if p.grad is not None]
    # FSDP2: the norm of sharded grads is a DTensor whose reduction runs on the mesh's backend; under
    # param_offload the grads (and so the norm) live on the CPU, which nccl does not take.
    norm = on_mesh_device(torch.nn.utils.get_total_norm([p.grad for p in params]))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def optimizer_state_device(param: torch.Tensor, target: str | int | torch.device) -> torch.device:
    """Where one parameter's optimizer state goes when it is moved to `target` (optimizer_offload).

    Adam's step runs where the parameter and its grad are: a parameter kept on the CPU by param_offload
    keeps its state on the CPU too, or the step would mix devices.
    """
    target = torch.device("cuda", target) if isinstance(target, int) else torch.device(target)
    return param.device if target.type != "cpu" and param.device.type == "cpu" else target


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | int | torch.device) -> None:
    """Move optimizer state tensors (optimizer_offload): to CPU after a step, back before the next.

    A device-to-host copy with non_blocking returns before the data has arrived, so the offload waits
    for it: a checkpoint may read the state right after.
    """
    copied_from_cuda = False
    for param, state in optimizer.state.items():
        target = optimizer_state_device(param, device)
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step" and value.device != target:
                copied_from_cuda |= value.is_cuda and target.type == "cpu"
                state[key] = value.to(target, non_blocking=True)
    if copied_from_cuda:
        torch.cuda.synchronize()
