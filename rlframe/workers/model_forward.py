"""The one model forward shared by actor, reference, critic and reward model: per-token results of a micro-batch.

Layout of a micro-batch (an RL batch): `input_ids = [prompt (left-padded) | response (right-padded)]`,
`attention_mask` marks valid tokens, `position_ids = clip(cumsum(mask) - 1, 0)`, `responses` is the
last `response_length` columns. Token t's logits predict token t + 1, so response token j is scored
by the logits at column `seqlen - response_length - 1 + j`.
A vision-language micro-batch (Qwen2-VL family) has `position_ids` [batch, 4, seqlen] and its rows' images,
found by the `IMAGE_ROW` each row carries; `rlframe.workers.multimodal` says how both go through each layout.

One forward, two independent choices:
- what is scored, a frozen `ScoringSpec`: log-probs at a temperature, plus entropy, Σπ² and the top-k
  log-probs and ids when asked, through plain or `torch.compile`d kernels, from the logits or from the fused
  head (`rlframe.workers.fused_head`); or values, for a value head. The log-probs of chosen tokens per position
  (a distillation teacher's top-k ids, `gather_ids`) travel through the layout with the labels;
- how the micro-batch is laid out for the model, a layout: `PaddedLayout` ([batch, seqlen] under the
  attention mask) or `PackedLayout` (`use_remove_padding`: the valid tokens packed into one row, see
  `rlframe.distributed.padding`; the model must use an attention that honours `cu_seq_lens_q`,
  `rlframe_varlen` or transformers' `flash_attention_2`). With a Ulysses group of size > 1 each rank
  runs 1/sp of the packed row and the per-token results are gathered. `layout.prepare` gives the
  model's inputs and each scored position's label; its `restore` brings the per-token results back to
  padded columns.
`score_positions` runs the model once and scores the head's output: the results at chosen padded
columns. `forward_micro_batch` reads the response tokens' (actor, reference, critic); the reward model
reads each row's last valid token (`rlframe.workers.reward_model.last_token_scores`).

Only the positions whose results are read go through the output head: the prompt's positions (most
of a row in RL) are cut from the last hidden states with transformers' `logits_to_keep`, so the
[tokens, vocab] projection, log-softmax and entropy run on the response alone, in both layouts. The
other positions' per-token results are 0 and never read. Models whose forward has no
`logits_to_keep` (some remote code), value heads and the fused head project every position.

Value models are `AutoModelForTokenClassification` with `num_labels=1` (a causal LM backbone plus a
scalar `score` head; set `classifier_dropout=0.0` so training-mode values are deterministic). The
value of response token j is read at the same column as its log-prob: the state before emitting it.

`forward_micro_batch`'s outputs are zero outside the response mask (`attention_mask[:, -response_length:]`),
in every mode, so results from any parallel configuration compare as whole tensors.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from rlframe.distributed.attention import ATTN_IMPLEMENTATION
from rlframe.distributed.padding import pack_tensor, pad_output, unpad_input
from rlframe.distributed.ulysses import gather_outputs, pad_packed_for_sp, slice_for_rank, sp_size_of
from rlframe.workers.multimodal import IMAGE_ROW, RowImages, vision_hooks

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


# ------------------------------------------------------------------------------------------- what is scored
@dataclass(frozen=True)
class ScoringSpec:
    """What the forward computes at each scored position.

    A causal LM gives `"log_probs"` (plus `"entropy"` if `calculate_entropy`, `"sum_pi_squared"`,
    Σ_v π(v)² of each token's distribution (the optimal token baseline's input), if
    `calculate_sum_pi_squared`) of the logits divided by `temperature`; a value model (`value_head`)
    gives `"values"`. `use_torch_compile` scores with `torch.compile`d log-prob and entropy kernels
    (verl's `use_torch_compile`); `use_fused_kernels` scores from the hidden states a chunk at a time
    (`rlframe.workers.fused_head`), never holding the whole logits.
    """

    temperature: float = 1.0
    calculate_entropy: bool = False
    calculate_sum_pi_squared: bool = False
    topk: int = 0  # > 0: also "topk_log_probs" and "topk_ids" [..., topk] of each position's distribution
    use_torch_compile: bool = False
    use_fused_kernels: bool = False
    value_head: bool = False

    def __post_init__(self):
        if self.use_fused_kernels and (self.value_head or self.calculate_sum_pi_squared or self.topk):
            raise ValueError(
                "use_fused_kernels scores log-probs and entropy only (no values, no Σπ², no top-k: no full logits)"
            )

    def output_head(self, model, labels: torch.Tensor):
        """The context the model runs in: with the fused head, its output head scores `labels` instead of projecting."""
        if not self.use_fused_kernels:
            return contextlib.nullcontext()
        from rlframe.workers.fused_head import scoring_head

        return scoring_head(model, labels, self._chunk_stats)

    def score(
        self, head_output: torch.Tensor, labels: torch.Tensor, gather_ids: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-token results from the head's output at the scored positions and their `labels` (next tokens).

        The head's output is logits [..., vocab] (values [..., 1]), or the fused head's statistics [..., 1 or 2].
        Computed in fp32 whatever the model's compute dtype (fp64 for an fp64 model): bf16 log-softmax
        and ratios are too coarse for PPO's importance weights and for the value loss. `gather_ids` [..., k]:
        also "gathered_log_probs", the log-probs of those tokens at each position.
        """
        if self.use_fused_kernels:
            if gather_ids is not None:
                raise ValueError("use_fused_kernels has no full logits to gather chosen tokens' log-probs from")
            out = {"log_probs": head_output[..., 0]}
            if self.calculate_entropy:
                out["entropy"] = head_output[..., 1]
            return out
        logits = _at_least_fp32(head_output)
        if self.value_head:
            return {"values": logits[..., 0]}
        logits = self._tempered(logits)
        logprobs, entropy = self._kernels()
        out = {"log_probs": logprobs(logits, labels)}
        if self.calculate_entropy:
            out["entropy"] = _entropy_from_logits_chunked(logits, entropy_fn=entropy)
        if self.calculate_sum_pi_squared:
            out["sum_pi_squared"] = sum_pi_squared_from_logits(logits)
        if self.topk or gather_ids is not None:
            log_probs = torch.log_softmax(logits, dim=-1)
            if self.topk:
                out["topk_log_probs"], out["topk_ids"] = log_probs.topk(self.topk, dim=-1)
            if gather_ids is not None:
                out["gathered_log_probs"] = log_probs.gather(-1, gather_ids.long())
        return out

    def _chunk_stats(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The fused head's [tokens, 1 or 2] log-probs (and entropy) of one chunk: `score`'s upcast, temperature
        and kernels."""
        logits = self._tempered(_at_least_fp32(logits))
        logprobs, entropy = self._kernels()
        columns = [logprobs(logits, labels)] + ([entropy(logits)] if self.calculate_entropy else [])
        return torch.stack(columns, dim=-1)

    def _tempered(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.temperature if self.temperature != 1.0 else logits

    def _kernels(self):
        return _compiled_kernels() if self.use_torch_compile else (logprobs_from_logits, entropy_from_logits)


LOG_PROBS = ScoringSpec()
VALUES = ScoringSpec(value_head=True)


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


# ------------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class PaddedLayout:
    """The micro-batch as it comes, [batch, seqlen]: the model runs the padding too, under the attention mask."""

    def prepare(
        self,
        model,
        micro_batch: dict[str, torch.Tensor],
        columns: slice,
        keep_logits: bool,
        images: dict,
        gather_ids: torch.Tensor | None = None,
    ) -> PaddedBatch:
        """The model's inputs; with `keep_logits` only the scored `columns` go through the output head.

        `images`: the micro-batch's `pixel_values` and `image_grid_thw` ({} for none), passed as they are.
        `gather_ids` [batch, seqlen, k]: tokens whose log-probs each position's logits give (`score`).
        """
        input_ids = micro_batch["input_ids"]
        inputs = {name: micro_batch[name] for name in ("input_ids", "attention_mask")}
        position_ids = micro_batch["position_ids"]
        # a vision-language row's [4, seqlen] positions: transformers' Qwen2-VL takes [4, batch, seqlen]
        inputs["position_ids"] = position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids
        inputs.update(images)
        if keep_logits:
            inputs["logits_to_keep"] = torch.arange(columns.start, columns.stop, device=input_ids.device)
        labels = torch.roll(input_ids, shifts=-1, dims=1)  # the fused head scores every position
        gathered = None if gather_ids is None else gather_ids[:, columns]
        return PaddedBatch(inputs, labels, labels[:, columns], None if keep_logits else columns, gathered)


@dataclass(frozen=True)
class PaddedBatch:
    """A padded micro-batch laid out for the model (`PaddedLayout.prepare`)."""

    inputs: dict  # the model's keyword arguments
    head_labels: torch.Tensor  # [batch, seqlen] the next token of every position (the fused head sees them all)
    labels: torch.Tensor  # [batch, len(columns)] the next token of each scored position
    columns: slice | None  # the scored columns to cut from the head's output (None: it has only those)
    gather_ids: torch.Tensor | None = None  # [batch, len(columns), k] tokens whose log-probs are read

    def select(self, head_output: torch.Tensor) -> torch.Tensor:
        """The head's output at the scored positions."""
        return head_output if self.columns is None else head_output[:, self.columns]

    def restore(self, per_token: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-token results [batch, len(columns)], already in place."""
        return per_token


@dataclass(frozen=True)
class PackedLayout:
    """The valid tokens packed into one row [1, total_nnz], each sequence attending only to itself.

    With a Ulysses group (`sp_group`) of size > 1, each rank runs its 1/sp of the row (padded to a
    multiple of sp) and the per-token results are gathered before padding back.
    """

    sp_group: dist.ProcessGroup | None = None

    def prepare(
        self,
        model,
        micro_batch: dict[str, torch.Tensor],
        columns: slice,
        keep_logits: bool,
        images: dict,
        gather_ids: torch.Tensor | None = None,
    ) -> PackedRow:
        """The packed row's inputs; with `keep_logits` only the positions of the scored `columns` go through
        the output head.

        A vision-language micro-batch's positions [batch, 4, seqlen] are packed like the tokens, into
        [4, 1, total_nnz]; its `images` (`pixel_values`, `image_grid_thw`) go to the model as they are. With
        Ulysses and images the model gets the whole row and each rank slices the embeddings, once the image
        features are in them (`rlframe.workers.multimodal.vision_hooks`). `gather_ids` [batch, seqlen, k] (tokens
        whose log-probs each position's logits give) are packed, sliced and kept like the positions' labels.
        """
        input_ids, attention_mask = micro_batch["input_ids"], micro_batch["attention_mask"]
        ids, indices, cu_seqlens, max_seqlen = unpad_input(input_ids, attention_mask)
        pos = _pack_positions(micro_batch["position_ids"], indices)
        labels = torch.roll(ids, shifts=-1, dims=1)  # next token in the row; wrong only at sequence ends, never scored
        gathered = None if gather_ids is None else pack_tensor(gather_ids, indices).unsqueeze(0)  # [1, nnz, k]
        scored = None  # the packed positions whose results are read, when only they go through the head
        if keep_logits:
            column = indices % input_ids.shape[1]
            scored = ((column >= columns.start) & (column < columns.stop))[None]
        group, pad_size, extra = self.sp_group, 0, {}
        sp_size = sp_size_of(group)
        if sp_size > 1:
            _check_ulysses_attention(model)
            ids, pos, cu_seqlens, max_seqlen, pad_size = pad_packed_for_sp(ids, pos, cu_seqlens, max_seqlen, sp_size)
            labels = torch.nn.functional.pad(labels, (0, pad_size))
            labels = slice_for_rank(labels, group, dim=1)
            if gathered is not None:
                gathered = slice_for_rank(torch.nn.functional.pad(gathered, (0, 0, 0, pad_size)), group, dim=1)
            if not images:  # with images the language model's pre-hook slices the embeddings and positions
                ids, pos = slice_for_rank(ids, group, dim=1), slice_for_rank(pos, group, dim=-1)
            if scored is not None:
                scored = slice_for_rank(torch.nn.functional.pad(scored, (0, pad_size)), group, dim=1)
            extra["ulysses_group"] = group
        labels_length, keep = labels.shape[1], None  # this rank's share of the row
        if scored is not None:
            keep = scored[0].nonzero().flatten()  # this rank's scored positions in its share of the row
            extra["logits_to_keep"] = keep
            labels = labels[:, keep]
            gathered = None if gathered is None else gathered[:, keep]
        # the sequences' bounds travel under transformers' names for its varlen attention
        inputs = {"input_ids": ids, "position_ids": pos, "cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens}
        inputs.update(max_length_q=max_seqlen, max_length_k=max_seqlen, **extra, **images)
        unpack = _Unpack(keep, labels_length, group, pad_size, indices, tuple(input_ids.shape), columns)
        return PackedRow(inputs, labels, labels[0], unpack, None if gathered is None else gathered[0])


@dataclass(frozen=True)
class _Unpack:
    """How a packed row's per-token results go back to padded columns."""

    keep: torch.Tensor | None  # the positions of this rank's share that went through the head (None: all)
    length: int  # this rank's share of the row
    group: dist.ProcessGroup | None  # the Ulysses group the row is split over
    pad_size: int  # the row's padding to a multiple of the group's size
    indices: torch.Tensor  # each packed token's place in the flattened [batch * seqlen] micro-batch
    shape: tuple[int, int]  # [batch, seqlen]
    columns: slice  # the padded columns read


@dataclass(frozen=True)
class PackedRow:
    """A packed micro-batch laid out for the model (`PackedLayout.prepare`)."""

    inputs: dict  # the model's keyword arguments
    head_labels: torch.Tensor  # [1, positions] the next token of each position through the head (fused head's)
    labels: torch.Tensor  # [positions] the same, for scoring the head's output
    unpack: _Unpack
    gather_ids: torch.Tensor | None = None  # [positions, k] tokens whose log-probs are read

    def select(self, head_output: torch.Tensor) -> torch.Tensor:
        """The head's output [positions, ...]: every position it sees is scored."""
        return head_output[0]

    def restore(self, per_token: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-token results [positions, ...] -> this rank's share -> the whole row -> [batch, len(columns), ...].

        Positions that did not go through the head are 0.
        """
        u = self.unpack
        if u.keep is not None:
            per_token = {
                name: x.new_zeros((u.length, *x.shape[1:])).index_copy(0, u.keep, x) for name, x in per_token.items()
            }
        per_token = {name: gather_outputs(x, u.group, dim=0, pad_size=u.pad_size) for name, x in per_token.items()}
        return {name: pad_output(x, u.indices, *u.shape)[:, u.columns] for name, x in per_token.items()}


def layout_for(use_remove_padding: bool, sp_group: dist.ProcessGroup | None = None) -> PaddedLayout | PackedLayout:
    """The layout the config's `use_remove_padding` and Ulysses group ask for."""
    if use_remove_padding:
        return PackedLayout(sp_group)
    if sp_size_of(sp_group) > 1:
        raise ValueError(
            "ulysses_sequence_parallel_size > 1 (actor_rollout_ref.actor./critic.) needs "
            "use_remove_padding=True (actor_rollout_ref.model./critic.model.)"
        )
    return PaddedLayout()


def _check_ulysses_attention(model) -> None:
    attn = getattr(getattr(model, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION)
    if attn != ATTN_IMPLEMENTATION:  # any other attention would silently ignore the SP group
        raise ValueError(
            f"Ulysses sequence parallelism needs attn_implementation={ATTN_IMPLEMENTATION!r}, the model uses {attn!r}"
        )


PACKED = PackedLayout()  # no sequence parallelism


def _pack_positions(position_ids: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[batch, seqlen] -> [1, total_nnz]; a vision-language batch's [batch, 4, seqlen] -> [4, 1, total_nnz]."""
    if position_ids.dim() == 2:
        return pack_tensor(position_ids, indices).unsqueeze(0)
    return pack_tensor(position_ids.transpose(1, 2), indices).T.unsqueeze(1)


# ------------------------------------------------------------------------------------------- the forward
def forward_micro_batch(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    response_length: int,
    spec: ScoringSpec = LOG_PROBS,
    layout: PaddedLayout | PackedLayout = PACKED,
    images: RowImages | None = None,
    gather_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Run `model` on one micro-batch and score its responses: `spec`'s results, each [batch, response_length, ...].

    `micro_batch` holds `input_ids`, `attention_mask`, `position_ids` [batch, seqlen] ([batch, 4, seqlen] for a
    vision-language model) and `responses` [batch, response_length]. `layout` defaults to the packed row without
    sequence parallelism (`layout_for(use_remove_padding, sp_group)` builds one from the config's two knobs).
    `images`: the call's per-row image inputs, found by the micro-batch's `IMAGE_ROW` (rlframe.workers.multimodal).
    `gather_ids` [batch, response_length, k]: also "gathered_log_probs", the log-probs of these tokens in place of
    each response token (a distillation teacher's top-k ids).
    """
    seqlen = micro_batch["input_ids"].shape[1]
    scoring_columns = slice(seqlen - response_length - 1, seqlen - 1)  # the logits of column t score token t + 1
    if gather_ids is not None:  # in the columns of the logits that score each response token
        full = gather_ids.new_zeros((gather_ids.shape[0], seqlen, *gather_ids.shape[2:]))
        full[:, scoring_columns] = gather_ids
        gather_ids = full
    outputs = score_positions(model, micro_batch, spec, layout, scoring_columns, images, gather_ids)
    response_mask = micro_batch["attention_mask"][:, -response_length:].bool()
    return {name: torch.where(_expand(response_mask, x), x, torch.zeros_like(x)) for name, x in outputs.items()}


def _expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`mask` [batch, len] with trailing singleton dims to broadcast against `like` [batch, len, ...]."""
    return mask.view(*mask.shape, *([1] * (like.dim() - mask.dim())))


def score_positions(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    spec: ScoringSpec,
    layout: PaddedLayout | PackedLayout,
    columns: slice,
    images: RowImages | None = None,
    gather_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The model's forward on `micro_batch` ([batch, seqlen] `input_ids`, `attention_mask`, `position_ids`),
    scored by `spec` at the padded `columns` (the results of column t are from its logits, which predict
    token t + 1): each result [batch, len(columns), ...]. `gather_ids` [batch, seqlen, k]: tokens whose
    log-probs each column's logits give ("gathered_log_probs")."""
    keep_logits = not spec.use_fused_kernels and _keeps_logits(model, spec.value_head)
    device = micro_batch["input_ids"].device
    image_inputs = {} if images is None else images.of(micro_batch[IMAGE_ROW], device)
    laid_out = layout.prepare(model, micro_batch, columns, keep_logits, image_inputs, gather_ids)
    sp_group = layout.sp_group if isinstance(layout, PackedLayout) and sp_size_of(layout.sp_group) > 1 else None
    with spec.output_head(model, laid_out.head_labels), vision_hooks(model, bool(image_inputs), sp_group):
        output = model(**laid_out.inputs, use_cache=False)
    return laid_out.restore(spec.score(laid_out.select(output.logits), laid_out.labels, laid_out.gather_ids))


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


# ------------------------------------------------------------------------------------------- kernels
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
