"""Masked reductions over response tokens, and the registry helper every name lookup uses."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _sum(x: torch.Tensor, axis: int | None) -> torch.Tensor:
    return x.sum() if axis is None else x.sum(dim=axis)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set (masked entries may hold NaN/inf; they are ignored)."""
    return _sum(torch.where(mask.bool(), values, 0.0), axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is set; 0 (not NaN) where nothing is set."""
    count = _sum(mask.bool(), axis).clamp(min=1)
    return masked_sum(values, mask, axis) / count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries; Bessel-corrected when `unbiased` and there are ≥ 2 of them."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.bool().sum()
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Scale `values` to unit variance over the masked entries; also center them if `shift_mean`."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def register(registry: dict, kind: str, name: str) -> Callable:
    """Decorator: store `fn` in `registry` under `name`; a second, different `fn` is an error."""

    def decorator(fn: Callable) -> Callable:
        if name in registry and registry[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered")
        registry[name] = fn
        return fn

    return decorator


def lookup(registry: dict, kind: str, name: str) -> Callable:
    """`registry[name]`, or a ValueError listing the valid names."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(registry))}")
    return registry[name]
