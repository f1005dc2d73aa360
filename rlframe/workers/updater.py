"""The update loop actor and critic share: `ppo_epochs` passes of mini-batch optimizer steps.

One optimizer step over a mini-batch: the global counts (the loss denominators, summed over the DP
group), the micro-batch split, zero_grad, then per micro-batch the role's loss (`_loss(micro,
counts, ctx) -> (loss, metrics)`) scaled by `dp_size` and back-propagated, then the DP sum of the
metrics, the micro-batch packing metrics and the clipped optimizer step. A role (`PPOActor`,
`PPOCritic`) is built from its typed config section and its plan, and supplies its loss and the keys it
reads; `ctx` is whatever one call of the role's update knows besides its batch (the critic: nothing), passed
to its loss untouched. `_train` is the plain loop over epochs and mini-batches; a role that prepares its
batches (the actor) writes its loop from the same parts (`_epochs`, `_optimizer_step`, `_end_update`). The
math itself lives in `rlframe.algorithms`.

With `fsdp_config.reshard_after_forward=false` (FSDP2) the gathered parameters are kept from a
micro-batch's forward through its backward; the updater also keeps them from one micro-batch to
the next of the same optimizer step and reshards after the step's last backward, before the
optimizer step. The peak memory is the same (every micro-batch holds them from its forward to its
backward anyway); the micro-batches after the first gather nothing; the gradients are
reduce-scattered per micro-batch as before, so the arithmetic is unchanged.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from rlframe.batch_plan import ForwardPlan, UpdatePlan
from rlframe.distributed.parallel_dims import ParallelDims
from rlframe.workers.batching import (
    GlobalCounts,
    dp_sum,
    forward_inputs,
    global_counts,
    micro_batch_metrics,
    restore_order,
    split_micro_batches,
)
from rlframe.workers.optimizer import clip_grad_norm


@dataclass(frozen=True)
class ModelOptions:
    """How a role runs its model: the model keys it honours, resolved for this device."""

    use_remove_padding: bool
    use_fused_kernels: bool = False  # model.use_fused_kernels: score from hidden states a chunk at a time
    use_torch_compile: bool = False  # the role's use_torch_compile, on CUDA only
    reshard_after_forward: bool = True  # fsdp_config's; False: gathered across an optimizer step (see above)


@dataclass
class RoleModel:
    """A role's (possibly FSDP-wrapped) module, how it is run, and what trains it (None: forward only)."""

    module: nn.Module
    options: ModelOptions
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None


class PPOUpdater(ABC):
    """A role's model and the DP/SP dims it reduces over, trained by mini-batch optimizer steps.

    Subclasses set `role` (the metric prefix) and implement `_loss(micro, counts, ctx)`.
    """

    role: str

    def __init__(
        self,
        model: RoleModel,
        config,
        plan: UpdatePlan,
        dims: ParallelDims,
        seed: int = 0,
        forward: ForwardPlan | None = None,
    ):
        """`plan` cuts the update into mini- and micro-batches; `forward` replaces its forward pass (`plan.forward`)."""
        self.module, self.options = model.module, model.options
        self.optimizer, self.lr_scheduler = model.optimizer, model.lr_scheduler
        self.config, self.plan, self.dims = config, plan, dims
        self.forward_plan = forward or plan.forward
        self.generator = torch.Generator().manual_seed(seed)

    def _train(self, batch: TensorDict, ctx: Any = None) -> dict[str, list[float]]:
        """One optimizer step per mini-batch of every epoch; metric lists, one value per step."""
        self.module.train()
        metrics: dict[str, list[float]] = {}
        for epoch_batch in self._epochs(batch):
            for mini in epoch_batch.split(self.plan.mini_batch_size_per_dp):
                append_metrics(metrics, self._optimizer_step(mini, ctx))
        self._end_update()
        return metrics

    def _epochs(self, batch: TensorDict) -> Iterator[TensorDict]:
        """`batch` once per epoch, each epoch shuffling the last one's order when the role's `shuffle` is on."""
        for _ in range(self.plan.ppo_epochs):
            if self.config.shuffle:
                batch = batch[torch.randperm(len(batch), generator=self.generator)]
            yield batch

    def _end_update(self) -> None:
        """After an update's last step: the learning-rate schedule advances once per update."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _no_grad_outputs(self, batch: TensorDict, plan: ForwardPlan | UpdatePlan, forward) -> dict[str, torch.Tensor]:
        """`forward(micro) -> {name: per-token tensor}` over `batch` cut as `plan`, without gradients, in its order."""
        with torch.no_grad():
            micro_batches, reverse_idx = split_micro_batches(forward_inputs(batch), plan, self.dims.dp_group)
            outputs = [forward(micro) for micro in micro_batches]
        return {name: restore_order([out[name] for out in outputs], reverse_idx) for name in outputs[0]}

    @abstractmethod
    def _loss(self, micro: TensorDict, counts: GlobalCounts, ctx: Any) -> tuple[torch.Tensor, dict]:
        """(loss to back-propagate, metrics summed over micro-batches and DP ranks) of one micro-batch.

        Metric names come without the role prefix; values are floats or 0-dim tensors, already weighted so
        that their sum over the mini-batch is the mini-batch's value (see GlobalCounts.token_share).
        """

    def _optimizer_step(self, mini: TensorDict, ctx: Any) -> dict[str, float]:
        """Accumulate the gradient of `mini`'s loss over its micro-batches, then step; the step's metrics."""
        dp_group = self.dims.dp_group
        counts = global_counts(mini, dp_group)
        micro_batches, _ = split_micro_batches(mini, self.plan, dp_group)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        keep_gathered = not self.options.reshard_after_forward and hasattr(self.module, "set_reshard_after_backward")
        for index, micro in enumerate(micro_batches):
            if keep_gathered:  # FSDP2 re-gathers nothing until the step's last backward (see module doc)
                self.module.set_reshard_after_backward(index == len(micro_batches) - 1)
            loss, micro_metrics = self._loss(micro, counts, ctx)
            # FSDP averages gradients over the dp ranks; the counts are already global, so scale back up.
            (loss * self.dims.dp_size).backward()
            for name, value in micro_metrics.items():
                value = float(value.detach() if isinstance(value, torch.Tensor) else value)
                sums[f"{self.role}/{name}"] = sums.get(f"{self.role}/{name}", 0.0) + value
        step_metrics = dp_sum(sums, dp_group)
        step_metrics.update(micro_batch_metrics(micro_batches, self.plan, self.role))
        step_metrics.update(apply_gradients(self.module, self.optimizer, self.config.optim.clip_grad, self.role))
        return step_metrics


def append_metrics(metrics: dict[str, list[float]], step_metrics: dict[str, float]) -> None:
    """Append one optimizer step's metrics to the update's lists."""
    for name, value in step_metrics.items():
        metrics.setdefault(name, []).append(value)


def apply_gradients(module, optimizer, grad_clip: float, prefix: str) -> dict[str, float]:
    """Clip to `grad_clip` and step; a non-finite norm would poison the weights, so it skips the step."""
    grad_norm = float(clip_grad_norm(module, grad_clip))
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return {
        f"{prefix}/grad_norm": grad_norm,
        f"{prefix}/skipped_steps": float(skipped),
        f"{prefix}/lr": optimizer.param_groups[0]["lr"],
    }
