"""GPU log-prob comparisons: the bf16 slack and floor, a free port, HF log-probs, the mean absolute difference."""

from __future__ import annotations

import torch

BF16_SLACK = 3.0  # how far a bf16 path may be from fp32, in units of the plain HF bf16 forward's own error


FLOOR = 1e-3


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    diff = (a.float() - b.float()).abs()
    return float(diff[mask.bool()].mean() if mask is not None else diff.mean())


# ---------------------------------------------------------------------------------------- vLLM
def _hf_log_probs(path: str, state: dict | None, batch: dict, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from rlframe.workers.model_forward import LOG_PROBS, PaddedLayout, forward_micro_batch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if state is not None:
        model.load_state_dict(state)
    model = model.to("cuda", dtype)
    width = batch["responses"].shape[1]
    with torch.no_grad():
        out = forward_micro_batch(model, {k: v.cuda() for k, v in batch.items()}, width, LOG_PROBS, PaddedLayout())
    return out["log_probs"].float().cpu()
