"""The update loop actor and critic share: `ppo_epochs` passes of mini-batch optimizer steps.

One optimizer step over a mini-batch: the global counts (the loss denominators, summed over the DP
group), the micro-batch split, zero_grad, then per micro-batch the role's loss (`loss_fn(micro,
counts) -> (loss, metrics)`) scaled by `dp_size` and back-propagated, then the DP sum of the
metrics, the micro-batch packing metrics and the clipped optimizer step. A role (`PPOActor`,
`PPOCritic`) supplies only its loss and the keys it reads; the math itself lives in
`rlframe.algorithms`.

With `fsdp_config.reshard_after_forward=false` (FSDP2) the gathered parameters are kept from a
micro-batch's forward through its backward; the updater also keeps them from one micro-batch to
the next of the same optimizer step and reshards after the step's last backward, before the
optimizer step. The peak memory is the same (every micro-batch holds them from its forward to its
backward anyway); the micro-batches after the first gather nothing; the gradients are
reduce-scattered per micro-batch as before, so the arithmetic is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tensordict import TensorDict

from rlframe.workers.batching import GlobalCounts, dp_sum, global_counts, micro_batch_metrics, split_micro_batches
from rlframe.workers.fsdp_utils import clip_grad_norm

# A role's loss on one micro-batch: (loss to back-propagate, metrics to sum over micro-batches and DP ranks).
# Metric names come without the role prefix; values are floats or 0-dim tensors, already weighted so
# that their sum over the mini-batch is the mini-batch's value (see GlobalCounts.token_share).
LossFn = Callable[[TensorDict, GlobalCounts], tuple[torch.Tensor, dict[str, torch.Tensor | float]]]


class PPOUpdater:
    """A module, its optimizer and the groups it reduces over, trained by mini-batch optimizer steps.

    Subclasses set `role` (the metric prefix) and call `_train` with their loss function.
    """

    role: str

    def __init__(
        self,
        module,
        optimizer,
        settings,
        dp_group=None,
        sp_group=None,
        dp_size: int = 1,
        lr_scheduler=None,
        seed: int = 0,
    ):
        self.module, self.optimizer, self.settings = module, optimizer, settings
        self.dp_group, self.sp_group, self.dp_size = dp_group, sp_group, dp_size
        self.lr_scheduler = lr_scheduler
        self.generator = torch.Generator().manual_seed(seed)

    def _train(self, batch: TensorDict, loss_fn: LossFn, prepare=None) -> dict[str, list[float]]:
        """One optimizer step per mini-batch of every epoch; metric lists, one value per step.

        `prepare(mini) -> mini`, when given, adds what the loss needs from the whole mini-batch
        (after any shuffle, before the micro-batch split) at the start of each optimizer step.
        """
        s = self.settings
        self.module.train()
        metrics: dict[str, list[float]] = {}
        for epoch in range(s.ppo_epochs):
            if s.shuffle:
                batch = batch[torch.randperm(len(batch), generator=self.generator)]
            if epoch == 0:
                batch = self._before_first_step(batch)
            for mini in batch.split(s.mini_batch_size):
                if prepare is not None:
                    mini = prepare(mini)
                for name, value in self._optimizer_step(mini, loss_fn).items():
                    metrics.setdefault(name, []).append(value)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return metrics

    def _before_first_step(self, batch: TensorDict) -> TensorDict:
        """The batch in the order its mini-batches are cut (after the first epoch's shuffle), before any step."""
        return batch

    def _optimizer_step(self, mini: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate the gradient of `mini`'s loss over its micro-batches, then step; the step's metrics."""
        counts = global_counts(mini, self.dp_group)
        micro_batches, _ = split_micro_batches(mini, self.settings.update, self.dp_group)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        keep_gathered = not self.settings.reshard_after_forward and hasattr(self.module, "set_reshard_after_backward")
        for index, micro in enumerate(micro_batches):
            if keep_gathered:  # FSDP2 re-gathers nothing until the step's last backward (see module doc)
                self.module.set_reshard_after_backward(index == len(micro_batches) - 1)
            loss, micro_metrics = loss_fn(micro, counts)
            # FSDP averages gradients over the dp ranks; the counts are already global, so scale back up.
            (loss * self.dp_size).backward()
            for name, value in micro_metrics.items():
                value = float(value.detach() if isinstance(value, torch.Tensor) else value)
                sums[f"{self.role}/{name}"] = sums.get(f"{self.role}/{name}", 0.0) + value
        step_metrics = dp_sum(sums, self.dp_group)
        step_metrics.update(micro_batch_metrics(micro_batches, self.settings.update, self.role))
        step_metrics.update(apply_gradients(self.module, self.optimizer, self.settings.grad_clip, self.role))
        return step_metrics


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
