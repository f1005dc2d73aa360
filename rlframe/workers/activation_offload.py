"""Activation offload (`model.enable_activation_offload`): what a training forward saves for backward waits in
host memory, not on the GPU, and comes back when backward needs it.

verl 0.9.1 wraps each decoder layer with its own offload handler. Here one saved-tensors hook, active from
the root module's forward pre-hook to its forward hook, copies every tensor autograd saves during the
forward to host memory and copies it back when backward unpacks it. Parameters (and views of them) stay
where they are: FSDP owns their memory. With gradient checkpointing a decoder layer saves only its inputs,
and torch's non-reentrant checkpoint saves those through the same hooks, so they are offloaded too (the
layer's own saves, inside the checkpoint, are dropped and recomputed as usual).

Copies are exact, so gradients are bitwise those without offload. On CUDA the host buffers are pinned and
the copies run on the compute stream (ordered with the kernels that use them). On a CPU device the
activations already live in host memory: the worker turns the hooks on for CUDA only.
"""

from __future__ import annotations

import torch
from torch import nn


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on `device` with `tensor`'s values (pinned host memory when it comes from a GPU)."""
    pin = device.type == "cpu" and tensor.is_cuda
    out = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device=device, pin_memory=pin)
    return out.copy_(tensor, non_blocking=True)


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor if tensor._base is None else tensor._base
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


class ActivationOffload:
    """Installed on a model by `enable`; `offloaded_bytes` counts what went to host memory (for tests)."""

    def __init__(self, host: torch.device):
        self.host = host
        self.offloaded_bytes = 0
        self._context = None

    def pack(self, tensor: torch.Tensor):
        if _is_parameter(tensor):
            return tensor
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        return tensor.device, copy_to(tensor, self.host)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host_copy = packed
        return copy_to(host_copy, device)

    def enter(self, module, args) -> None:
        if torch.is_grad_enabled() and self._context is None:
            self._context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._context.__enter__()

    def exit(self, module, args, output) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


def enable(model: nn.Module, host: torch.device | str = "cpu") -> ActivationOffload:
    """Offload `model`'s activations to `host` during every forward under autograd (see the module docstring)."""
    offload = ActivationOffload(torch.device(host))
    model.register_forward_pre_hook(offload.enter)
    model.register_forward_hook(offload.exit, always_call=True)
    return offload
