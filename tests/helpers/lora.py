"""LoRA: the base model, randomized B matrices, scores."""

from __future__ import annotations

import torch

from rlframe.workers.model_loading import ModelSpec, load_hf_model


def base_model(path: str, use_remove_padding: bool = False):
    return load_hf_model(ModelSpec(path=path, role="actor", dtype=torch.float32, use_remove_padding=use_remove_padding))


def randomize_b(peft_model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


# ---------------------------------------------------------------- GPU: vLLM serves the adapter
def _scores(model, out) -> torch.Tensor:
    """log p(response tokens) under `model` (fp32, padded forward), zero outside the response mask."""
    from rlframe.workers.model_forward import LOG_PROBS, PaddedLayout, forward_micro_batch

    batch = {k: out.batch[k].cpu() for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    with torch.no_grad():
        return forward_micro_batch(model, batch, out.batch["responses"].shape[-1], LOG_PROBS, PaddedLayout())[
            "log_probs"
        ]
