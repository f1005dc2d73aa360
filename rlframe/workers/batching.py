"""Mini/micro-batch cutting shared by actor and critic, and the global counts that make losses exact.

Static micro-batching splits by sequence count, so every rank runs the same number of micro-batches
by construction. Dynamic micro-batching packs by a token budget through
`rlframe.seqpack.rearrange_micro_batches`, which all-reduces the micro-batch count over the DP group
(unequal counts would deadlock FSDP's collectives) and returns the index lists that put outputs
back in the caller's order.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlframe.seqpack import MicroBatchSpec, get_reverse_idx, packing_metrics, rearrange_micro_batches
from rlframe.workers.fsdp_utils import clip_grad_norm


def micro_batch_spec(plan, token_len_key: str) -> MicroBatchSpec:
    """The MicroBatchSpec of one role's ForwardPlan/UpdatePlan (see rlframe.batch_plan)."""
    return MicroBatchSpec(plan.use_dynamic_bsz, plan.micro_batch_size, plan.max_token_len, plan.packing_algorithm,
                          token_len_key)


def split_micro_batches(batch: TensorDict, spec: MicroBatchSpec, dp_group=None
                        ) -> tuple[list[TensorDict], list[int] | None]:
    """Micro-batches of `batch`, plus the reverse index that restores order (None when order is kept)."""
    if not spec.use_dynamic_bsz:
        return list(batch.split(spec.micro_batch_size)), None
    micro_batches, index_lists = rearrange_micro_batches(
        batch, max_token_len=spec.max_token_len, dp_group=dp_group, same_micro_num_in_dp=True,
        packing_algorithm=spec.packing_algorithm, config_key=spec.token_len_key)
    return micro_batches, get_reverse_idx(index_lists)


def micro_batch_metrics(micro_batches: list[TensorDict], spec: MicroBatchSpec, prefix: str) -> dict[str, float]:
    """Token loads of one mini-batch's dynamic micro-batches against the budget (the second balancing level)."""
    if not spec.use_dynamic_bsz:
        return {}
    loads = [int(micro["attention_mask"].sum()) for micro in micro_batches]
    packed = packing_metrics(loads, capacity=spec.max_token_len)
    return {f"{prefix}/micro_batch/{name}": float(packed[name])
            for name in ("num_groups", "max", "imbalance_ratio", "max_over_mean", "utilization", "wasted_tokens")}


def restore_order(outputs: list[torch.Tensor], reverse_idx: list[int] | None) -> torch.Tensor:
    """Concatenate per-micro-batch outputs and undo the dynamic packing's reordering."""
    out = torch.cat(outputs, dim=0)
    if reverse_idx is not None:
        out = out[torch.as_tensor(reverse_idx, device=out.device)]
    return out


def global_counts(response_mask: torch.Tensor, dp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid tokens and non-empty sequences of a whole mini-batch, summed over the DP group.

    These are the denominators of every loss aggregation mode, so that summing micro-batch losses
    over gradient accumulation and DP ranks gives exactly the full-batch loss.
    """
    counts = torch.stack([response_mask.sum(), (response_mask.sum(-1) > 0).sum()]).to(torch.float64)
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    return counts[0], counts[1]


def dp_sum(values: dict[str, float], dp_group=None) -> dict[str, float]:
    """Sum scalar metrics over the DP group (one collective for all of them)."""
    if not values:
        return {}
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        backend = dist.get_backend(dp_group)
        device = "cuda" if backend == "nccl" else "cpu"
        tensor = tensor.to(device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=dp_group)
    return dict(zip(keys, tensor.cpu().tolist()))


def response_mask_of(batch: TensorDict) -> torch.Tensor:
    """The response mask: given explicitly, or the last response_length columns of attention_mask."""
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    response_length = batch["responses"].shape[-1]
    return batch["attention_mask"][:, -response_length:]


class DataParallelModel:
    """What actor and critic share: the module, its optimizer, the groups it reduces over, and the
    loop of `ppo_epochs` passes of mini-batch optimizer steps."""

    def __init__(self, module, optimizer, settings, dp_group=None, sp_group=None, dp_size: int = 1,
                 lr_scheduler=None, seed: int = 0):
        self.module, self.optimizer, self.settings = module, optimizer, settings
        self.dp_group, self.sp_group, self.dp_size = dp_group, sp_group, dp_size
        self.lr_scheduler = lr_scheduler
        self.generator = torch.Generator().manual_seed(seed)

    def _train(self, batch: TensorDict, optimizer_step: Callable[[TensorDict], dict]) -> dict[str, list[float]]:
        """Run `optimizer_step` on every mini-batch of every epoch; metric lists, one value per step."""
        s = self.settings
        self.module.train()
        metrics: dict[str, list[float]] = {}
        for _ in range(s.ppo_epochs):
            if s.shuffle:
                batch = batch[torch.randperm(len(batch), generator=self.generator)]
            for mini in batch.split(s.mini_batch_size):
                for name, value in optimizer_step(mini).items():
                    metrics.setdefault(name, []).append(value)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return metrics


def apply_gradients(module, optimizer, grad_clip: float, prefix: str) -> dict[str, float]:
    """Clip to `grad_clip` and step; a non-finite norm would poison the weights, so it skips the step."""
    grad_norm = float(clip_grad_norm(module, grad_clip))
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return {f"{prefix}/grad_norm": grad_norm, f"{prefix}/skipped_steps": float(skipped),
            f"{prefix}/lr": optimizer.param_groups[0]["lr"]}
