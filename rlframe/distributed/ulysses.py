"""Ulysses sequence parallelism: shard a packed row along the sequence, attention by head shards.

Each of the `sp` ranks of a group holds `1/sp` of the packed row (the row is padded to a multiple
of `sp`). Everything outside attention is per-token, so it runs on the shard as is. Inside
attention one all-to-all turns `[seq/sp, heads, dim]` into `[seq, heads/sp, dim]`: every rank then
sees the *whole* row for its heads, so the causal varlen attention over the global `cu_seqlens` is
exactly the one without SP. A second all-to-all turns the result back.

Gradients: the all-to-all's adjoint is the same all-to-all, and `gather_outputs`' backward is a
reduce-scatter (the true adjoint of an all-gather). Every SP rank computes the same loss on the
gathered outputs, so averaging parameter gradients over the SP group (which FSDP does over the
whole dp x sp mesh) gives exactly the single-process gradient.

The SP group is always passed explicitly (None: no SP). The two autograd functions are written
here, not taken from torch: `torch.distributed.nn.functional` is deprecated and its all_gather
fails on gloo for an SP group without global rank 0; the private `_functional_collectives` is
exact but renames its API within the torch versions rlframe supports (docs/sequence_parallel.md,
bench/ulysses_collectives.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

SP_SIZE_KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


def sp_size_of(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `group`; 1 for None."""
    return 1 if group is None else dist.get_world_size(group)


def sp_rank_of(group: dist.ProcessGroup | None) -> int:
    """This rank's index in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def check_ulysses_config(
    num_attention_heads: int, num_key_value_heads: int, sp_size: int, key: str = SP_SIZE_KEY
) -> None:
    """Raise ValueError unless a model with these heads can run with Ulysses degree `sp_size`.

    Query heads must divide evenly over the ranks. Key/value heads need not: they are repeated
    (`kv_repeat_factor`) until they do, which keeps GQA's query-to-kv-head mapping intact.
    """
    if sp_size < 1:
        raise ValueError(f"{key}={sp_size}: must be >= 1")
    if num_attention_heads % sp_size != 0:
        raise ValueError(
            f"{key}={sp_size} must divide the model's num_attention_heads={num_attention_heads} "
            f"(each SP rank attends with num_attention_heads / {key} heads)"
        )
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not a multiple of num_key_value_heads={num_key_value_heads}"
        )


def kv_repeat_factor(num_key_value_heads: int, sp_size: int) -> int:
    """Smallest r such that `num_key_value_heads * r` is a multiple of `sp_size`."""
    return sp_size // math.gcd(num_key_value_heads, sp_size)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (split evenly); its adjoint is the same all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all_to_all_single: chunk j of dim 0 goes to rank j, chunk j of the result came from rank j."""
    return _AllToAll.apply(x, group)


def seq_to_head_shard(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[seq/sp, heads, dim] (a sequence shard, all heads) -> [seq, heads/sp, dim] (all tokens, a head shard)."""
    sp = sp_size_of(group)
    seq_local, heads, dim = x.shape
    x = x.reshape(seq_local, sp, heads // sp, dim).transpose(0, 1)  # [sp, seq/sp, heads/sp, dim]
    x = all_to_all(x, group)  # chunk j now holds sequence shard j of this rank's heads
    return x.reshape(sp * seq_local, heads // sp, dim)


def head_to_seq_shard(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[seq, heads/sp, dim] -> [seq/sp, heads, dim]; the inverse of `seq_to_head_shard`."""
    sp = sp_size_of(group)
    seq, heads_local, dim = x.shape
    x = x.reshape(sp, seq // sp, heads_local, dim)
    x = all_to_all(x, group)  # chunk j now holds head shard j of this rank's tokens
    return x.transpose(0, 1).reshape(seq // sp, sp * heads_local, dim)


def pad_packed_for_sp(
    input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, sp_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Pad a packed row [1, T] to a multiple of `sp_size`.

    The padding tokens (id 0) form one extra sequence with positions 0, 1, ...: they attend only
    to each other, so real tokens are untouched, and `cu_seqlens` stays consistent with the
    position ids. Returns `(input_ids, position_ids, cu_seqlens, max_seqlen, pad_size)`.
    """
    total = input_ids.shape[-1]
    pad_size = (-total) % sp_size
    if pad_size == 0:
        return input_ids, position_ids, cu_seqlens, max_seqlen, 0
    input_ids = F.pad(input_ids, (0, pad_size), value=0)
    pad_pos = torch.arange(pad_size, device=position_ids.device, dtype=position_ids.dtype)
    position_ids = torch.cat([position_ids, pad_pos.expand(*position_ids.shape[:-1], pad_size)], dim=-1)
    end = torch.tensor([total + pad_size], device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    cu_seqlens = torch.cat([cu_seqlens, end])
    return input_ids, position_ids, cu_seqlens, max(max_seqlen, pad_size), pad_size


def slice_for_rank(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous 1/sp share of `x` along `dim` (its length must divide by sp)."""
    sp = sp_size_of(group)
    if sp == 1:
        return x
    if x.shape[dim] % sp != 0:
        raise ValueError(f"length {x.shape[dim]} along dim {dim} is not a multiple of sp={sp}; pad first")
    return x.chunk(sp, dim=dim)[sp_rank_of(group)]


class _GatherSeq(torch.autograd.Function):
    """all_gather along `dim` (equal shards); backward is reduce-scatter, done with an all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sp = dist.get_world_size(ctx.group)
        chunks = torch.stack(grad.chunk(sp, dim=ctx.dim))  # [sp, *shard]: chunk j belongs to rank j
        received = all_to_all(chunks, ctx.group)  # every rank's gradient for my shard
        return received.sum(dim=0), None, None


def gather_outputs(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1, pad_size: int = 0) -> torch.Tensor:
    """Gather per-rank sequence shards of `x` along `dim` and drop the last `pad_size` entries."""
    if sp_size_of(group) > 1:
        dim = dim % x.dim()
        x = _GatherSeq.apply(x, group, dim)
    if pad_size:
        x = x.narrow(dim, 0, x.shape[dim] - pad_size)
    return x
