"""Model FLOPs and device peaks, for MFU (`perf/mfu/actor`, bench/gpu_mfu.py)."""

from __future__ import annotations

import os

import torch

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' datasheets. Matched as a
# substring of torch.cuda.get_device_name(), first match wins, so specific names come first.
PEAK_BF16_TFLOPS = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("MI325X", 1307.0),
    ("MI300X", 1307.0),
]
PEAK_ENV = "RLFRAME_PEAK_TFLOPS"


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookup.

    The input embedding is a gather (no FLOPs); the LM head is a [hidden x vocab] matmul. With
    tied embeddings they are one tensor, counted once here, for the head.
    """
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())
    return total if head is not None and head.weight is embedding else total - embedding.numel()


def train_flops(num_matmul_params: int, num_layers: int, attn_width: int, seqlens: list[int]) -> float:
    """Forward+backward FLOPs of a packed batch: 6·N·tokens + 12·L·d·Σ s²/2.

    Dense part: a matmul with N weights costs 2N FLOPs per token forward (multiply + add) and 4N
    backward (gradients of the input and of the weight): 6N per token.
    Attention part (not in N): per layer and head, QKᵀ is [s, d_h] x [d_h, s] = 2·s²·d_h FLOPs and
    PV the same, so 4·s²·d forward over all heads (d = heads · head_dim, query heads: GQA shares
    K/V but not this work) and 12·s²·d with backward. A causal kernel (flash-attn varlen) computes
    only the lower triangle, half of it: 12·L·d·s²/2 per sequence, summed per packed sequence
    (packing never attends across sequences, so it is Σ s², not (Σ s)²).
    """
    tokens = sum(seqlens)
    return 6.0 * num_matmul_params * tokens + 12.0 * num_layers * attn_width * sum(s * s for s in seqlens) / 2


def device_peak_tflops(device_name: str, override: float | None = None) -> tuple[float | None, str]:
    """(peak bf16 TFLOP/s, where it came from); None when unknown."""
    if override:
        return override, "override"
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]), f"${PEAK_ENV}"
    for pattern, peak in PEAK_BF16_TFLOPS:
        if pattern in device_name:
            return peak, f"table ({pattern})"
    return None, f"unknown device: set {PEAK_ENV}"


def model_flops_info(model: torch.nn.Module) -> dict:
    """What the driver needs to count an actor step's FLOPs (read before FSDP wrapping). A vision-language model's
    attention is its language model's; its vision tower's matmuls count as if they ran on every token (an estimate)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "matmul_params": matmul_params(model),
        "num_layers": config.num_hidden_layers,
        "attn_width": config.num_attention_heads * head_dim,
    }
