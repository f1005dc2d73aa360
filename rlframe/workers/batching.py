"""Mini/micro-batch cutting shared by actor and critic, the keys they read, and the global counts that make
losses exact.

Static micro-batching splits by sequence count, so every rank runs the same number of micro-batches
by construction. Dynamic micro-batching packs by a token budget through
`rlframe.seqpack.rearrange_micro_batches`, which all-reduces the micro-batch count over the DP group
(unequal counts would deadlock FSDP's collectives) and returns the index lists that put outputs
back in the caller's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlframe.algorithms.loss import Aggregation
from rlframe.batch_plan import ForwardPlan, UpdatePlan
from rlframe.distributed.parallel_dims import spans_ranks
from rlframe.seqpack import get_reverse_idx, packing_metrics, rearrange_micro_batches
from rlframe.workers.multimodal import IMAGE_ROW

# What a model forward reads; a role's update adds its loss keys (update_inputs).
MODEL_INPUTS = ("responses", "input_ids", "attention_mask", "position_ids")
# read when the batch carries it: a vision-language row's index into its images (rlframe.workers.multimodal)
OPTIONAL_MODEL_INPUTS = (IMAGE_ROW,)


def split_micro_batches(
    batch: TensorDict, plan: ForwardPlan | UpdatePlan, dp_group=None
) -> tuple[list[TensorDict], list[int] | None]:
    """Micro-batches of `batch` cut as one pass of the batch plan says, plus the reverse index that restores
    order (None when order is kept)."""
    if not plan.use_dynamic_bsz:
        return list(batch.split(plan.micro_batch_size)), None
    micro_batches, index_lists = rearrange_micro_batches(
        batch,
        max_token_len=plan.max_token_len,
        dp_group=dp_group,
        same_micro_num_in_dp=True,
        packing_algorithm=plan.packing_algorithm,
        config_key=plan.max_token_len_key,
    )
    return micro_batches, get_reverse_idx(index_lists)


def micro_batch_metrics(
    micro_batches: list[TensorDict], plan: ForwardPlan | UpdatePlan, prefix: str
) -> dict[str, float]:
    """Token loads of one mini-batch's dynamic micro-batches against the budget (the second balancing level)."""
    if not plan.use_dynamic_bsz:
        return {}
    loads = [int(micro["attention_mask"].sum()) for micro in micro_batches]
    packed = packing_metrics(loads, capacity=plan.max_token_len)
    return {
        f"{prefix}/micro_batch/{name}": float(packed[name])
        for name in ("num_groups", "max", "imbalance_ratio", "max_over_mean", "utilization", "wasted_tokens")
    }


def restore_order(outputs: list[torch.Tensor], reverse_idx: list[int] | None) -> torch.Tensor:
    """Concatenate per-micro-batch outputs and undo the dynamic packing's reordering."""
    out = torch.cat(outputs, dim=0)
    if reverse_idx is not None:
        out = out[torch.as_tensor(reverse_idx, device=out.device)]
    return out


@dataclass(frozen=True)
class GlobalCounts:
    """Valid response tokens and sequences (rows) of a whole mini-batch, summed over the DP group.

    These are the denominators of every loss aggregation mode, so that summing micro-batch losses
    over gradient accumulation and DP ranks gives exactly the full-batch loss.
    """

    num_tokens: torch.Tensor
    num_seqs: torch.Tensor
    response_length: int  # the constant divisor of seq-mean-token-sum-norm

    def aggregation(self, mode: str) -> Aggregation:
        """The loss aggregation `mode` normalized by these counts (the `agg` every loss takes)."""
        return Aggregation(mode, self.num_tokens, self.num_seqs, self.response_length)

    def token_share(self, response_mask: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the global tokens: weighting local means by it sums to the global mean."""
        return response_mask.sum() / self.num_tokens.clamp(min=1)


def global_counts(mini_batch: TensorDict, dp_group=None) -> GlobalCounts:
    """The GlobalCounts of `mini_batch` (one all-reduce over the DP group)."""
    response_mask = response_mask_of(mini_batch)
    # N_seq counts every row, empty responses included: verl 0.9.1 divides by ppo_mini_batch_size × n
    counts = torch.stack([response_mask.sum(), torch.tensor(response_mask.shape[0], device=response_mask.device)]).to(
        torch.float64
    )
    if spans_ranks(dp_group):
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    return GlobalCounts(counts[0], counts[1], mini_batch["responses"].shape[-1])


def dp_sum(values: dict[str, float], dp_group=None) -> dict[str, float]:
    """Sum scalar metrics over the DP group (one collective for all of them)."""
    if not values:
        return {}
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if spans_ranks(dp_group):
        backend = dist.get_backend(dp_group)
        device = "cuda" if backend == "nccl" else "cpu"
        tensor = tensor.to(device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=dp_group)
    return dict(zip(keys, tensor.cpu().tolist()))


def response_mask_of(batch: TensorDict) -> torch.Tensor:
    """The response mask: given explicitly, or the last response_length columns of attention_mask."""
    if "response_mask" in batch:
        return batch["response_mask"]
    response_length = batch["responses"].shape[-1]
    return batch["attention_mask"][:, -response_length:]


def forward_inputs(batch: TensorDict) -> TensorDict:
    """The keys a model forward reads (`rlframe.workers.model_forward.forward_micro_batch`)."""
    return batch.select(*MODEL_INPUTS, *_present(batch, OPTIONAL_MODEL_INPUTS))


def update_inputs(batch: TensorDict, *keys: str) -> TensorDict:
    """The model inputs, a role's loss `keys`, and the response mask when the batch carries one."""
    return batch.select(*MODEL_INPUTS, *keys, *_present(batch, ("response_mask", *OPTIONAL_MODEL_INPUTS)))


def _present(batch: TensorDict, keys: tuple[str, ...]) -> list[str]:
    return [key for key in keys if key in batch.keys()]
