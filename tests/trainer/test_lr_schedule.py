"""Learning-rate schedules: the lr at every step equals verl 0.9.1's formula, bit for bit.

verl (verl/utils/torch_functional.py), at 0-indexed scheduler step s with warmup W and total T:
  warmup (both styles), s < W:  s / W                      (starts at 0, reaches 1 at s = W)
  constant, s >= W:             1
  cosine, s >= W:               max(m, cos(pi * p) * ((1 - m) * 0.5) + (1 + m) * 0.5),  p = (s - W) / (T - W)
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlframe.workers.lr_schedule import build_lr_scheduler

BASE_LR = 1e-3


def optim_config(style, warmup_steps=3, warmup_ratio=0.0, min_lr_ratio=0.1):
    return OmegaConf.create(
        {
            "lr_warmup_steps": warmup_steps,
            "lr_warmup_steps_ratio": warmup_ratio,
            "lr_scheduler_type": style,
            "warmup_style": None,
            "min_lr_ratio": min_lr_ratio,
        }
    )


def lrs_over(optim_cfg, total_steps, num_steps=None):
    """The lr the optimizer uses at each of `num_steps` steps (default: the whole schedule)."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)
    scheduler = build_lr_scheduler(optimizer, optim_cfg, total_steps)
    lrs = []
    for _ in range(total_steps if num_steps is None else num_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def verl_cosine_tail(min_lr_ratio, warmup, total):
    """verl's cosine factors for steps warmup..total-1, evaluated in verl's operation order."""
    coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5
    return [
        max(min_lr_ratio, math.cos(math.pi * ((s - warmup) / (total - warmup))) * coef + intercept)
        for s in range(warmup, total)
    ]


def test_constant_with_warmup_every_step():
    expected = [0.0, 1 / 3, 2 / 3] + [1.0] * 7
    assert lrs_over(optim_config("constant"), total_steps=10) == [BASE_LR * f for f in expected]


def test_cosine_with_warmup_and_floor_every_step():
    factors = [0.0, 1 / 3, 2 / 3] + verl_cosine_tail(0.1, warmup=3, total=10)
    assert lrs_over(optim_config("cosine"), total_steps=10) == [BASE_LR * f for f in factors]
    # The same factors written out: 0.55 + 0.45·cos(pi·k/7), k = 0..6, from 1 down towards the 0.1 floor.
    written_out = [
        0.0,
        0.3333333333,
        0.6666666667,
        1.0,
        0.9554359906,
        0.8305704108,
        0.6501344203,
        0.4498655797,
        0.2694295892,
        0.1445640094,
    ]
    assert factors == pytest.approx(written_out, abs=1e-10)


def test_cosine_without_warmup_starts_at_full_lr():
    factors = verl_cosine_tail(0.0, warmup=0, total=4)
    assert factors == pytest.approx([1.0, 0.8535533906, 0.5, 0.1464466094], abs=1e-10)
    assert lrs_over(optim_config("cosine", warmup_steps=-1, min_lr_ratio=0.0), 4) == [BASE_LR * f for f in factors]


@pytest.mark.parametrize(
    "warmup_steps, warmup_ratio, expected_warmup",
    [
        (-1, 0.3, 3),  # -1: the ratio of total steps, truncated (int(0.3 · 10))
        (0, 0.3, 3),  # verl 0.9.1: 0 also defers to the ratio
        (2, 0.3, 2),  # a positive step count wins over the ratio
        (-1, 0.0, 0),  # no warmup: full lr from the first step
    ],
)
def test_warmup_length_from_steps_or_ratio(warmup_steps, warmup_ratio, expected_warmup):
    lrs = lrs_over(optim_config("constant", warmup_steps, warmup_ratio), total_steps=10)
    expected = [BASE_LR * s / expected_warmup for s in range(expected_warmup)]
    assert lrs == expected + [BASE_LR] * (10 - expected_warmup)


def test_scheduler_state_resumes_the_schedule():
    # The worker checkpoint stores lr_scheduler.state_dict(); a restored scheduler continues the same values.
    cfg, total = optim_config("cosine"), 10
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)
    scheduler = build_lr_scheduler(optimizer, cfg, total)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    restored_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)
    restored = build_lr_scheduler(restored_optimizer, cfg, total)
    restored_optimizer.load_state_dict(optimizer.state_dict())
    restored.load_state_dict(scheduler.state_dict())
    assert restored_optimizer.param_groups[0]["lr"] == lrs_over(cfg, total)[5]


def test_schedule_errors_name_the_key():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)
    with pytest.raises(ValueError, match="lr_scheduler_type='linear'"):
        build_lr_scheduler(optimizer, optim_config("linear"), 10)
    with pytest.raises(ValueError, match="min_lr_ratio=1.5"):
        build_lr_scheduler(optimizer, optim_config("cosine", min_lr_ratio=1.5), 10)
