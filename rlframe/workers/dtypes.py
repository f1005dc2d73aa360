"""Dtype names as the config spells them (`param_dtype: bf16`, `auto`) and the torch dtype each resolves to."""

from __future__ import annotations

import torch

from rlframe.workers.config.model import DTYPES

TORCH_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPES.items()}


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    """`param_dtype: auto` means bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]
