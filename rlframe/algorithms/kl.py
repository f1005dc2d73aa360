"""Per-token estimators of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL divergence"),
the fixed and adaptive KL controllers, and the KL penalty subtracted from the rewards.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rlframe.algorithms.masked import lookup, masked_mean, register

KL_PENALTIES: dict[str, Callable] = {}


def get_kl_penalty_fn(name: str) -> Callable:
    """The per-token KL estimator `fn(logprob, ref_logprob)` registered as `name`."""
    return lookup(KL_PENALTIES, "kl penalty", name)


def _register_kl(*names: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        for name in names:
            register(KL_PENALTIES, "kl penalty", name)(fn)
        return fn

    return decorator


@_register_kl("kl", "k1")
def _kl_k1(logprob, ref_logprob):
    """k1 = log π − log π_ref (unbiased for the KL, single samples can be negative)."""
    return logprob - ref_logprob


@_register_kl("abs")
def _kl_abs(logprob, ref_logprob):
    """|log π − log π_ref|."""
    return (logprob - ref_logprob).abs()


@_register_kl("mse", "k2")
def _kl_k2(logprob, ref_logprob):
    """k2 = ½(log π − log π_ref)² (biased, non-negative; its gradient is the KL's)."""
    return 0.5 * (logprob - ref_logprob).square()


@_register_kl("low_var_kl", "k3")
def _kl_k3(logprob, ref_logprob):
    """k3 = r − log r − 1 with r = π_ref/π (unbiased, non-negative, low variance; Schulman 2020)."""
    # k3 = r - log r - 1 with r = π_ref/π: unbiased, non-negative, low variance. Clamping the
    # log-ratio keeps exp finite; clamping the result bounds the rare huge outliers.
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)


def _straight_through(value_fn: Callable) -> Callable:
    """The estimator with `value_fn`'s value and k2's gradient (verl 0.9.1's `name+` types).

    k1 and k3 are unbiased for the KL's value but their expected gradients are not the KL's
    gradient; k2's is (for samples from π, up to the sampling distribution's own dependence), so
    `k3+` reports k3 and trains with ∇k2 = (log π − log π_ref)·∇log π.
    """

    def estimator(logprob, ref_logprob):
        k2 = _kl_k2(logprob, ref_logprob)
        return k2 - k2.detach() + value_fn(logprob, ref_logprob).detach()

    estimator.__doc__ = f"the value of {value_fn.__doc__.split(' (')[0]}, the gradient of k2 (straight-through)"
    return estimator


for _name, _fn in list(KL_PENALTIES.items()):
    register(KL_PENALTIES, "kl penalty", f"{_name}+")(_straight_through(_fn))


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate of type `kl_penalty` (kl/k1, abs, mse/k2, low_var_kl/k3, and each with a
    `+`: that value with k2's gradient)."""
    return get_kl_penalty_fn(kl_penalty)(logprob, ref_logprob)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """KL coefficient steered toward `target_kl` (Ziegler et al. 2019, proportional control)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by 1 + clip(kl/target - 1, ±0.2) · n_steps / horizon."""
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


def make_kl_controller(kl_ctrl_type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None):
    """A `fixed` or `adaptive` KL controller (algorithm.kl_ctrl.type)."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None or horizon <= 0:
            raise ValueError(f"adaptive KL control needs target_kl and horizon > 0, got {target_kl=}, {horizon=}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl controller {kl_ctrl_type!r}; valid names: adaptive, fixed")


def apply_kl_penalty(token_level_scores, old_log_prob, ref_log_prob, response_mask, kl_ctrl, kl_penalty="kl"):
    """Rewards = scores − β·KL per token; then updates `kl_ctrl` with this batch's KL.

    Returns (token_level_rewards, metrics); metrics hold the batch KL (mean over sequences of the
    per-sequence token mean) and the β that was applied (before the update), as floats.
    """
    kld = get_kl_penalty_fn(kl_penalty)(old_log_prob, ref_log_prob)
    kld = torch.where(response_mask.bool(), kld, 0.0)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
