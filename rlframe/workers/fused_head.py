"""The fused output head (`actor_rollout_ref.model.use_fused_kernels`): log-probs and entropy straight
from the last hidden states, a chunk of tokens at a time, so the [tokens, vocab] logits never exist whole.

verl 0.9.1 replaces the causal LM's forward so that it returns per-token log-probs and entropy instead of
logits (its `FusedLinearForPPO`, torch backend). Here the model runs its own forward; for the duration of
one call its output head (`get_output_embeddings()`, a plain `nn.Linear`) scores the hidden states instead
of projecting them: it returns per-token statistics [..., k] in place of logits [..., vocab]. The head
runs inside the model's forward, so FSDP has its weight gathered exactly as for a plain forward.

Each chunk projects its hidden states, upcasts to fp32, divides by the temperature and scores with the
same kernels as the plain path (`rlframe.workers.model_forward`). Under autograd each chunk is
checkpointed: its logits are recomputed in backward, never kept, so the peak is one chunk's logits
(CHUNK_TOKENS × vocab) instead of all tokens'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 512  # verl's FusedLinearForPPO chunk size
# config fields of heads that post-process the logits (soft-capping, scaling): the fused head would skip that
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def output_head(model: nn.Module) -> nn.Linear:
    """The model's vocabulary projection, checked to be one the fused head computes exactly."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(
            f"actor_rollout_ref.model.use_fused_kernels=true needs a plain nn.Linear output head; this model's is "
            f"{type(head).__name__} (an adapter on lm_head?); set use_fused_kernels=false"
        )
    config = getattr(model, "config", None)
    for name in LOGIT_POSTPROCESSING:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"actor_rollout_ref.model.use_fused_kernels=true: this model post-processes its logits "
                f"(config.{name}={getattr(config, name)}), which the fused head would skip; set use_fused_kernels=false"
            )
    return head


@contextlib.contextmanager
def scoring_head(model: nn.Module, labels: torch.Tensor, score_chunk: Callable) -> Iterator[None]:
    """Within the block, the model's output head returns `chunked_stats(hidden, weight, bias, labels, ...)`.

    `labels` [..., tokens] must have the hidden states' leading shape (the next token of each position).
    """
    head = output_head(model)

    def fused_forward(hidden: torch.Tensor) -> torch.Tensor:
        return chunked_stats(hidden, head.weight, head.bias, labels, score_chunk)

    head.forward = fused_forward
    try:
        yield
    finally:
        del head.forward  # back to nn.Linear.forward


def chunked_stats(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, score_chunk: Callable
) -> torch.Tensor:
    """`score_chunk(logits, labels)` [n, k] over chunks of CHUNK_TOKENS tokens, each projected on its own."""
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    needs_grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
    parts = []
    for start in range(0, flat.shape[0], CHUNK_TOKENS):
        args = (flat[start : start + CHUNK_TOKENS], weight, bias, flat_labels[start : start + CHUNK_TOKENS])
        if needs_grad:
            parts.append(checkpoint(_project_and_score, *args, score_chunk, use_reentrant=False))
        else:
            parts.append(_project_and_score(*args, score_chunk))
    return torch.cat(parts).view(*hidden.shape[:-1], -1)


def _project_and_score(hidden, weight, bias, labels, score_chunk) -> torch.Tensor:
    return score_chunk(F.linear(hidden, weight, bias), labels)
