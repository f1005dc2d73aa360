"""The one model forward shared by actor, reference and critic: log-probs, entropy or values per response token.

Layout of a micro-batch (an RL batch): `input_ids = [prompt (left-padded) | response (right-padded)]`,
`attention_mask` marks valid tokens, `position_ids = clip(cumsum(mask) - 1, 0)`, `responses` is the
last `response_length` columns. Token t's logits predict token t + 1, so response token j is scored
by the logits at column `seqlen - response_length - 1 + j`.

With `use_remove_padding` the valid tokens are packed into one row (see `rlframe.distributed.padding`)
and the model must use an attention that honours `cu_seq_lens_q` (`rlframe_varlen`, or transformers'
`flash_attention_2`). With a Ulysses group of size > 1 each rank runs 1/sp of the row and the per-token
results are gathered before padding back.

Only the positions that score a response token go through the output head: the prompt's positions
(most of a row in RL) are cut from the last hidden states with transformers' `logits_to_keep`, so the
[tokens, vocab] projection, log-softmax and entropy run on the response alone, in both layouts. The
other positions' per-token results are 0 and never read. Models whose forward has no `logits_to_keep`
(some remote code) and the fused head project every position, as before.

Value models are `AutoModelForTokenClassification` with `num_labels=1` (a causal LM backbone plus a
scalar `score` head; set `classifier_dropout=0.0` so training-mode values are deterministic). The
value of response token j is read at the same column as its log-prob: the state before emitting it.

Outputs are zero outside the response mask (`attention_mask[:, -response_length:]`), in every mode,
so results from any parallel configuration compare as whole tensors.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from rlframe.distributed.attention import ATTN_IMPLEMENTATION
from rlframe.distributed.padding import pack_tensor, pad_output, unpad_input
from rlframe.distributed.ulysses import gather_outputs, pad_packed_for_sp, slice_for_rank, sp_size_of

ENTROPY_CHUNK_TOKENS = 1024


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] as gathered logit − logsumexp, never materializing log_softmax.

    Pass fp32 logits for exact numbers; the result has the logits' dtype and shape[:-1].
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp − Σ p·logit (stable for any scale)."""
    # Both terms are shift-invariant; shifting by the max first keeps them O(1), so their
    # difference does not cancel catastrophically when logits are large.
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)


def forward_micro_batch(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    response_length: int,
    temperature: float = 1.0,
    use_remove_padding: bool = True,
    sp_group: dist.ProcessGroup | None = None,
    calculate_entropy: bool = False,
    value_head: bool = False,
    use_torch_compile: bool = False,
    calculate_sum_pi_squared: bool = False,
    use_fused_kernels: bool = False,
) -> dict[str, torch.Tensor]:
    """Run `model` on one micro-batch and score its responses.

    `micro_batch` holds `input_ids`, `attention_mask`, `position_ids` [batch, seqlen] and `responses`
    [batch, response_length]. Returns `{"log_probs"}` (plus `"entropy"` if `calculate_entropy`) for a
    causal LM, or `{"values"}` when `value_head`; each [batch, response_length]. `sp_group` is the
    Ulysses group (None: no sequence parallelism). `use_torch_compile` scores with `torch.compile`d
    log-prob and entropy kernels (verl's `use_torch_compile`). `calculate_sum_pi_squared` adds
    `"sum_pi_squared"`, Σ_v π(v)² of each token's distribution (the optimal token baseline's input).
    `use_fused_kernels` scores from the hidden states a chunk at a time (`rlframe.workers.fused_head`).
    """
    if use_fused_kernels and (value_head or calculate_sum_pi_squared):
        raise ValueError("use_fused_kernels scores log-probs and entropy only (no values, no Σπ²: no full logits)")
    fused = (temperature, calculate_entropy, use_torch_compile) if use_fused_kernels else None
    input_ids, attention_mask = micro_batch["input_ids"], micro_batch["attention_mask"]
    position_ids = micro_batch["position_ids"]
    responses = micro_batch["responses"]
    batch_size, seqlen = input_ids.shape

    if use_remove_padding:
        per_token, indices = _forward_packed(
            model,
            input_ids,
            attention_mask,
            position_ids,
            response_length,
            temperature,
            sp_group,
            calculate_entropy,
            value_head,
            use_torch_compile,
            calculate_sum_pi_squared,
            fused,
        )
        # [total_nnz] per token -> [batch, seqlen] -> the columns scoring the response tokens
        outputs = {
            name: pad_output(x, indices, batch_size, seqlen)[:, -response_length - 1 : -1]
            for name, x in per_token.items()
        }
    else:
        if sp_size_of(sp_group) > 1:
            raise ValueError(
                "ulysses_sequence_parallel_size > 1 (actor_rollout_ref.actor./critic.) needs "
                "use_remove_padding=True (actor_rollout_ref.model./critic.model.)"
            )
        labels = torch.roll(input_ids, shifts=-1, dims=1)  # the fused head scores every position
        scoring = slice(seqlen - response_length - 1, seqlen - 1)  # the columns whose logits score the response
        keep = {}
        if fused is None and _keeps_logits(model, value_head):
            keep["logits_to_keep"] = torch.arange(scoring.start, scoring.stop, device=input_ids.device)
        with _fused_scoring(model, labels, fused):
            output = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **keep
            )
        logits = output.logits if keep else output.logits[:, scoring]
        if fused is not None:
            outputs = _fused_outputs(logits, calculate_entropy)
        else:
            outputs = _score(
                logits,
                responses,
                temperature,
                calculate_entropy,
                value_head,
                use_torch_compile,
                calculate_sum_pi_squared,
            )

    response_mask = attention_mask[:, -response_length:].bool()
    return {name: torch.where(response_mask, x, torch.zeros_like(x)) for name, x in outputs.items()}


def _forward_packed(
    model,
    input_ids,
    attention_mask,
    position_ids,
    response_length,
    temperature,
    group,
    calculate_entropy,
    value_head,
    use_torch_compile=False,
    calculate_sum_pi_squared=False,
    fused=None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Forward the packed row; returns per-token results [total_nnz] and the packing `indices`."""
    ids, indices, cu_seqlens, max_seqlen = unpad_input(input_ids, attention_mask)
    pos = pack_tensor(position_ids, indices).unsqueeze(0)
    labels = torch.roll(ids, shifts=-1, dims=1)  # next token in the row; wrong only at sequence ends, never scored
    scored = None  # the packed positions whose results are read, when only they go through the head
    if fused is None and _keeps_logits(model, value_head):
        column = indices % input_ids.shape[1]  # padded columns seqlen - response_length - 1 .. seqlen - 2
        scored = ((column >= input_ids.shape[1] - response_length - 1) & (column < input_ids.shape[1] - 1))[None]
    sp_size = sp_size_of(group)
    pad_size = 0
    extra = {}
    if sp_size > 1:
        attn = getattr(getattr(model, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION)
        if attn != ATTN_IMPLEMENTATION:  # any other attention would silently ignore the SP group
            raise ValueError(
                f"Ulysses sequence parallelism needs attn_implementation={ATTN_IMPLEMENTATION!r}, "
                f"the model uses {attn!r}"
            )
        ids, pos, cu_seqlens, max_seqlen, pad_size = pad_packed_for_sp(ids, pos, cu_seqlens, max_seqlen, sp_size)
        labels = torch.nn.functional.pad(labels, (0, pad_size))
        ids, pos, labels = (slice_for_rank(x, group, dim=1) for x in (ids, pos, labels))
        if scored is not None:
            scored = slice_for_rank(torch.nn.functional.pad(scored, (0, pad_size)), group, dim=1)
        extra["ulysses_group"] = group
    keep = None
    if scored is not None:
        keep = scored[0].nonzero().flatten()  # this rank's scored positions in its share of the row
        extra["logits_to_keep"] = keep
        labels = labels[:, keep]

    with _fused_scoring(model, labels, fused):
        output = model(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
            **extra,
        )
    if fused is not None:
        per_token = _fused_outputs(output.logits[0], calculate_entropy)
    else:
        per_token = _score(
            output.logits[0],
            labels[0],
            temperature,
            calculate_entropy,
            value_head,
            use_torch_compile,
            calculate_sum_pi_squared,
        )
    if keep is not None:  # back to one entry per position of this rank's share; unscored positions are 0
        length = ids.shape[1]
        per_token = {name: x.new_zeros(length).index_copy(0, keep, x) for name, x in per_token.items()}
    per_token = {name: gather_outputs(x, group, dim=0, pad_size=pad_size) for name, x in per_token.items()}
    return per_token, indices


def _keeps_logits(model, value_head: bool) -> bool:
    """Whether the model's forward takes transformers' `logits_to_keep` (a causal LM head; value heads do not)."""
    if value_head:
        return False
    inner = model
    while True:  # through FSDP1's wrapper and a PEFT model to the transformers model that runs the head
        if hasattr(inner, "_fsdp_wrapped_module"):
            inner = inner._fsdp_wrapped_module
        elif hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        else:
            return _forward_takes_logits_to_keep(type(inner))


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _score(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    calculate_entropy: bool,
    value_head: bool,
    use_torch_compile: bool = False,
    calculate_sum_pi_squared: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token log-probs of `labels` (and entropy) from `logits` [..., vocab], or values from [..., 1].

    Computed in fp32 whatever the model's compute dtype (fp64 for an fp64 model): bf16 log-softmax
    and ratios are too coarse for PPO's importance weights and for the value loss.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if value_head:
        return {"values": logits[..., 0]}
    if temperature != 1.0:
        logits = logits / temperature
    logprobs, entropy = _compiled_kernels() if use_torch_compile else (logprobs_from_logits, entropy_from_logits)
    out = {"log_probs": logprobs(logits, labels)}
    if calculate_entropy:
        out["entropy"] = _entropy_from_logits_chunked(logits, entropy_fn=entropy)
    if calculate_sum_pi_squared:
        out["sum_pi_squared"] = sum_pi_squared_from_logits(logits)
    return out


def _fused_scoring(model, labels: torch.Tensor, fused: tuple | None):
    """With `fused` = (temperature, calculate_entropy, use_torch_compile): the head scores instead of projecting."""
    if fused is None:
        return contextlib.nullcontext()
    from rlframe.workers.fused_head import scoring_head

    return scoring_head(model, labels, functools.partial(_fused_chunk_stats, fused=fused))


def _fused_chunk_stats(logits: torch.Tensor, labels: torch.Tensor, fused: tuple) -> torch.Tensor:
    """One chunk's [tokens, 1 or 2] log-probs (and entropy): `_score`'s upcast, temperature and kernels."""
    temperature, calculate_entropy, use_torch_compile = fused
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    logprobs, entropy = _compiled_kernels() if use_torch_compile else (logprobs_from_logits, entropy_from_logits)
    columns = [logprobs(logits, labels)] + ([entropy(logits)] if calculate_entropy else [])
    return torch.stack(columns, dim=-1)


def _fused_outputs(stats: torch.Tensor, calculate_entropy: bool) -> dict[str, torch.Tensor]:
    out = {"log_probs": stats[..., 0]}
    if calculate_entropy:
        out["entropy"] = stats[..., 1]
    return out


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Σ_v softmax(logits)_v² = exp(logsumexp(2z) − 2·logsumexp(z)), without materializing the softmax.

    z = logits − max: both log-sum-exps then lie in [0, 2·log V], so their difference keeps fp32's
    precision even for huge logits (unshifted, 2e4 − 2e4 would lose the low bits).
    """
    z = logits - logits.max(dim=-1, keepdim=True).values
    return torch.exp(torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1))


@functools.lru_cache(maxsize=1)
def _compiled_kernels():
    """`torch.compile`d log-prob and entropy functions, built once per process (dynamic shapes)."""
    return (torch.compile(logprobs_from_logits, dynamic=True), torch.compile(entropy_from_logits, dynamic=True))


def _entropy_from_logits_chunked(
    logits: torch.Tensor, chunk_tokens: int = ENTROPY_CHUNK_TOKENS, entropy_fn=entropy_from_logits
) -> torch.Tensor:
    """`entropy_from_logits` a chunk of tokens at a time, so at most one chunk's softmax is alive.

    Under autograd each chunk is checkpointed: its softmax is recomputed in backward, not kept.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    needs_grad = torch.is_grad_enabled() and flat.requires_grad
    parts = [
        checkpoint(entropy_fn, chunk, use_reentrant=False) if needs_grad else entropy_fn(chunk)
        for chunk in flat.split(chunk_tokens)
    ]
    return torch.cat(parts).view(logits.shape[:-1])
