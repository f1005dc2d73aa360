"""verl 0.9.1's learning-rate schedules: linear warmup, then constant or cosine down to `min_lr_ratio`."""

from __future__ import annotations

import torch


def cosine_lr_factor(step: int, warmup: int, total_steps: int, min_lr_ratio: float) -> float:
    """verl's cosine schedule (num_cycles 0.5): lr / base lr at scheduler step `step`, 0-indexed."""
    import math

    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total_steps - warmup)
    # Evaluated as verl does, not as transformers' cosine helpers do (0.5·(1+cos)·(1−m) + m): the
    # same number mathematically, but it differs in the last bit for about a third of the steps.
    return max(min_lr_ratio, math.cos(math.pi * progress) * ((1 - min_lr_ratio) * 0.5) + (1 + min_lr_ratio) * 0.5)


def scheduler_type(optim_cfg) -> str:
    """`lr_scheduler_type`, unless the deprecated `warmup_style` is set (verl 0.9.1 copies it over)."""
    return optim_cfg.warmup_style or optim_cfg.lr_scheduler_type


def build_lr_scheduler(optimizer, optim_cfg, total_steps: int):
    """verl 0.9.1's schedules: linear warmup from 0, then constant or cosine down to min_lr_ratio · lr."""
    from functools import partial

    from transformers.optimization import get_constant_schedule_with_warmup

    warmup = optim_cfg.lr_warmup_steps
    if warmup is None or warmup <= 0:  # verl: 0 warmup steps also defers to the ratio
        warmup = int(optim_cfg.lr_warmup_steps_ratio * max(total_steps, 0))
    style = scheduler_type(optim_cfg)
    if style == "constant":  # transformers' helper computes verl's values exactly: step / warmup, then 1
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if style != "cosine":
        raise ValueError(f"optim.lr_scheduler_type={style!r} is not one of constant, cosine")
    min_ratio = optim_cfg.min_lr_ratio
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio={min_ratio} must be in [0, 1] (the cosine floor as a fraction of lr)")
    factor = partial(cosine_lr_factor, warmup=warmup, total_steps=total_steps, min_lr_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
