"""Varlen causal attention for packed rows, plugged into transformers as `attn_implementation="rlframe_varlen"`.

transformers (5.x) calls a registered attention function as
`fn(module, query [b, heads, T, dim], key, value [b, kv_heads, T, dim], attention_mask, dropout=,
scaling=, sliding_window=, position_ids=, **forward_kwargs)` and expects `([b, T, heads, dim], weights)`.
Extra keyword arguments given to the model's forward reach the function unchanged, so the packed
row's `cu_seq_lens_q`/`max_length_q` (transformers' own names for them) and the Ulysses group
(`ulysses_group`) travel that way; they also survive activation-checkpoint recomputation.

One model object serves every use: on a packed row (batch 1, no attention mask) each sequence
attends causally to itself only; on a padded batch or during generation the function is exactly
transformers' `sdpa`.

A packed row runs the first of these that applies (`varlen_kernel` names it):
1. flash-attn's `flash_attn_varlen_func`, when the package imports (CUDA, bf16/fp16);
2. torch's own `torch.nn.attention.varlen.varlen_attn` (the same flash kernel, built into torch; CUDA,
   bf16/fp16, sm80 or newer, no dropout);
3. torch SDPA one sequence at a time: CPU, fp32, or a GPU without either kernel. FlexAttention with a
   document mask was measured as the CPU alternative and loses (bench/packed_attention_cpu.py: it has
   no backward on CPU, and its forward is 3-9x slower than this loop compiled, 29-240x eager).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from rlframe.distributed.padding import cu_seqlens_from_position_ids
from rlframe.distributed.ulysses import (
    check_ulysses_config,
    head_to_seq_shard,
    kv_repeat_factor,
    seq_to_head_shard,
    sp_size_of,
)

ATTN_IMPLEMENTATION = "rlframe_varlen"
FLASH_ATTN_VARLEN = "flash-attn varlen"
TORCH_VARLEN_ATTN = "torch varlen_attn"
SDPA_PER_SEQUENCE = "torch SDPA per sequence"


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    scaling: float | None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each segment of a packed row, each token seeing at most `sliding_window` tokens.

    q [T, heads, dim], k/v [T, kv_heads, dim] -> [T, heads, dim]; `cu_seqlens` [num_segments + 1].
    """
    kernel = varlen_kernel(q.device.type, q.dtype, dropout)
    if kernel == SDPA_PER_SEQUENCE:
        return _sdpa_per_sequence(q, k, v, cu_seqlens, scaling, dropout, sliding_window)
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    # transformers' window of S tokens is the query and the S - 1 before it: flash's (left S - 1, right 0)
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    if kernel == FLASH_ATTN_VARLEN:
        windowed = {} if sliding_window is None else {"window_size": window}  # flash-attn before 2.3 has none
        return _flash_attn_varlen_func()(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
            **windowed,
        )
    # varlen_attn is causal exactly when window_size == (-1, 0); (S - 1, 0) is causal within the window.
    # Its kernel takes fewer kv heads as they are (GQA); a form without enable_gqa repeats them (_repeating_kv_heads).
    return _torch_varlen_attn()(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        scale=scaling,
        window_size=window,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def _sdpa_per_sequence(q, k, v, cu_seqlens, scaling, dropout, sliding_window) -> torch.Tensor:
    """torch SDPA on each segment, heads first: exact causal attention per sequence without a [T, T] mask."""
    num_groups = q.shape[1] // k.shape[1]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if num_groups > 1:
        k, v = k.repeat_interleave(num_groups, dim=0), v.repeat_interleave(num_groups, dim=0)
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[1]:
        raise ValueError(f"cu_seqlens {bounds[0]}..{bounds[-1]} does not cover the packed row of {q.shape[1]} tokens")
    # A leading batch dim matters: on 3-D inputs SDPA picks its math kernel, which keeps the full
    # [heads, T, T] attention weights for backward (bench/ulysses_memory.py: 3.6× the memory).
    outs = [
        F.scaled_dot_product_attention(
            q[None, :, s:e],
            k[None, :, s:e],
            v[None, :, s:e],
            dropout_p=dropout,
            scale=scaling,
            **_causal_mask(e - s, sliding_window, q.device),
        )[0]
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    return torch.cat(outs, dim=1).transpose(0, 1)


def _causal_mask(length: int, sliding_window: int | None, device: torch.device) -> dict:
    """SDPA's causal arguments for one segment: `is_causal`, or a banded mask when the window is shorter."""
    if sliding_window is None or sliding_window >= length:
        return {"is_causal": True}
    offsets = torch.arange(length, device=device)
    offsets = offsets[:, None] - offsets[None, :]  # query position minus key position
    return {"attn_mask": (offsets >= 0) & (offsets < sliding_window)}


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The `rlframe_varlen` attention function (see the module docstring for the calling convention)."""
    group = kwargs.get("ulysses_group")
    sp_size = sp_size_of(group)
    cu_seqlens, max_seqlen = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu_seqlens is None and sp_size == 1 and _is_packed_row(query, key, attention_mask, kwargs.get("position_ids")):
        cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(kwargs["position_ids"])
    if cu_seqlens is None:
        if sp_size > 1:
            raise ValueError(
                "Ulysses sequence parallelism needs the packed row's cu_seq_lens_q passed to the model "
                "forward (the position ids each rank sees are only its shard)"
            )
        if attention_mask is None and query.shape[2] == key.shape[2]:  # `_varlen_mask` gave none: add the window
            attention_mask = _causal_mask(query.shape[2], sliding_window, query.device).get("attn_mask")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row (batch 1), got batch {query.shape[0]}")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION} does not implement logit softcapping")

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T(/sp), heads, dim]
    if sp_size > 1:
        check_ulysses_config(q.shape[1], k.shape[1], sp_size)
        repeat = kv_repeat_factor(k.shape[1], sp_size)
        if repeat > 1:  # fewer kv heads than ranks: repeat each in place so GQA's grouping survives the split
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q, k, v = (seq_to_head_shard(x, group) for x in (q, k, v))
    out = varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, sliding_window)
    if sp_size > 1:
        out = head_to_seq_shard(out, group)
    return out.unsqueeze(0), None


def _is_packed_row(query, key, attention_mask, position_ids) -> bool:
    """A single row, no padding mask, no cache, positions restarting at 0 somewhere after the start."""
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return False
    return bool((position_ids.flatten()[1:] == 0).any())


def _varlen_mask(
    batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs
) -> torch.Tensor | None:
    """No mask for a fresh unpadded input (packing comes from cu_seqlens); sdpa's mask otherwise."""
    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, **kwargs
    )


@functools.cache
def _flash_attn_varlen_func():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as err:
        if importlib.util.find_spec("flash_attn") is not None:  # installed but broken: say so, once
            warnings.warn(
                f"flash_attn is installed but does not import ({err}); packed attention runs torch's varlen_attn "
                "or SDPA per sequence instead (reinstall flash-attn built for this torch: scripts/setup.sh gpu)",
                stacklevel=2,
            )
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen_attn():
    """torch's `varlen_attn` when this build and GPU run it (flash attention compiled in, sm80 or newer), else None.

    Its form changed between releases: the first took `is_causal` and neither `scale` nor `window_size` (not used
    here); a later one has those but no `enable_gqa`, and then kv heads are repeated to the query's.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params or "scale" not in params:
        return None
    if not (torch.backends.cuda.is_flash_attention_available() and torch.cuda.is_available()):
        return None
    if torch.cuda.get_device_capability() < (8, 0):  # the flash kernel needs Ampere or newer
        return None
    return varlen_attn if "enable_gqa" in params else _repeating_kv_heads(varlen_attn)


def _repeating_kv_heads(varlen_attn):
    """`varlen_attn` for a form without `enable_gqa`: each kv head repeated for its group of query heads."""

    def call(q, k, v, *args, enable_gqa: bool = False, **kwargs):
        if enable_gqa:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return varlen_attn(q, k, v, *args, **kwargs)

    return call


def varlen_kernel(device_type: str, dtype: torch.dtype, dropout: float = 0.0) -> str:
    """The kernel packed attention runs for tensors of this device type and dtype (benchmarks report it)."""
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return SDPA_PER_SEQUENCE
    if _flash_attn_varlen_func() is not None:
        return FLASH_ATTN_VARLEN
    if dropout == 0.0 and _torch_varlen_attn() is not None:  # its dropout is fixed at 0
        return TORCH_VARLEN_ATTN
    return SDPA_PER_SEQUENCE


def register_varlen_attention() -> str:
    """Register `rlframe_varlen` with transformers (idempotent); returns the name to pass as attn_implementation."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    # Without a mask function transformers would hand this function no mask at all, padded batches included.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _varlen_mask)
    return ATTN_IMPLEMENTATION


register_varlen_attention()
