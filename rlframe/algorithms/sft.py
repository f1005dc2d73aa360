"""verl 0.9.1's SFT loss: the negative log-likelihood of the trained tokens over the step's global count."""

from __future__ import annotations

import torch


def sft_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor, global_num_tokens: torch.Tensor) -> torch.Tensor:
    """-Σ log p over the tokens `loss_mask` marks / `global_num_tokens` (the step's trained tokens, all ranks).

    Summed over a step's micro-batches and DP ranks this is its mean NLL per trained token. verl's `sft_loss` also
    multiplies by dp_size, for FSDP's average of the gradients over ranks; rlframe's updater applies that factor to
    every role's loss (`rlframe.workers.updater`).
    """
    return -(log_probs * loss_mask).sum() / global_num_tokens.clamp(min=1)
