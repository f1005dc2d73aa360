"""Remove padding: pack a padded batch into one row of valid tokens, and scatter results back.

A batch `[batch, seqlen]` with a 0/1 `attention_mask` (left-padded prompts, right-padded responses)
becomes one packed row `[1, total_nnz]` of its valid tokens, row after row. `cu_seqlens` marks
where each sequence starts in the row; the varlen attention keeps sequences from seeing each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Pack the valid tokens of `input_ids` [batch, seqlen] into one row.

    Returns `(packed_ids [1, total_nnz], indices [total_nnz], cu_seqlens [batch + 1] int32, max_seqlen)`,
    where `indices` are positions in the flattened `[batch * seqlen]` batch.
    """
    mask = attention_mask.bool()
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    packed_ids = pack_tensor(input_ids, indices).unsqueeze(0)
    return packed_ids, indices, cu_seqlens, max_seqlen


def pack_tensor(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather `x` [batch, seqlen, ...] at `indices` from `unpad_input` into [total_nnz, ...].

    Used for position ids: for left-padded prompts they are `clip(cumsum(mask) - 1, 0)`, so the
    gathered row restarts at 0 for every sequence.
    """
    return x.flatten(0, 1)[indices]


def pad_output(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter `packed` [total_nnz, ...] back to [batch, seqlen, ...]; padding positions are 0.

    Differentiable with respect to `packed`.
    """
    out = packed.new_zeros((batch * seqlen, *packed.shape[1:]))
    out = out.index_put((indices,), packed)
    return out.view(batch, seqlen, *packed.shape[1:])


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left/right-padded batch: `clip(cumsum(mask) - 1, 0)`."""
    return torch.clip(torch.cumsum(attention_mask.long(), dim=-1) - 1, min=0)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Recover `(cu_seqlens int32, max_seqlen)` of a packed row [1, T] whose positions restart at 0."""
    pos = position_ids.flatten()
    starts = torch.nonzero(pos == 0, as_tuple=False).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed position_ids must start every sequence at 0 (first position is not 0)")
    total = torch.tensor([pos.numel()], device=pos.device, dtype=starts.dtype)
    cu_seqlens = torch.cat([starts, total]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
