"""Partial rollout: responses cut by a weight update, continued from their tokens under the new weights.

In `separate_async` with `actor_rollout_ref.rollout.partial_rollout=true`, a push of new weights interrupts the
generation running on the rollout pool: every unfinished row stops at the next decoding step and comes back with
the engine's stop reason `Stop.INTERRUPTED` (`STOP_KEY`), the tokens, log-probs and versions it has so far. Rows
that stopped at an EOS, at their budget, or at a budget the engine's context limit shortened are finished and never
sent again. The driver sends the interrupted rows back (`continue_generation`): the engine prefills prompt + prefix
under the new weights (the KV cache is recomputed, not kept) and generates the rest of the row's budget
(`response_length` minus the prefix). The prefix and the continuation are then laid out as one response
(`build_rollout_output`), so the trainer sees the contract of an uninterrupted call, with each token's policy
version in `rollout_versions`. A multi-turn trajectory continues from its state instead (`multi_turn.py`).

A row keeps its sample seed (`SEED_KEY`) across the cut, and the sampler keys every draw by (seed, position), so
a continuation under unchanged weights draws the tokens the uninterrupted row would have drawn.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlframe.protocol import DataProto
from rlframe.workers.rollout.base import (
    SEED_KEY,
    STOP_KEY,
    VERSIONS_KEY,
    Stop,
    build_rollout_output,
    mark_rollout_state,
)


def interrupted(output: DataProto) -> torch.Tensor:
    """[B] bool: the rows the engine reports cut by the interrupt (`Stop.INTERRUPTED`), the only ones continued."""
    return output.batch[STOP_KEY] == int(Stop.INTERRUPTED)


def continuation_prompts(rows: DataProto) -> tuple[DataProto, torch.Tensor]:
    """(prompt + prefix of each cut row, left-padded as the engine takes prompts; each row's remaining budget).

    `rows` are rows of the rollout contract whose response is an unbroken prefix (cut rows have no EOS, so
    their `response_mask` is 1 on the first L tokens). Each row's real tokens are moved to the right end and the
    columns padded in every row dropped.
    """
    prompt_width = rows.batch["prompts"].shape[1]
    ids, mask = rows.batch["input_ids"], rows.batch["attention_mask"]
    response_length = ids.shape[1] - prompt_width
    prefix = rows.batch["response_mask"].sum(-1)
    order = torch.argsort(mask, dim=1, stable=True)  # padding first, then the real tokens in their order
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    keep = int(mask.sum(-1).max())
    ids, mask = ids[:, -keep:], mask[:, -keep:]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, dict(rows.non_tensor_batch)
    )
    return prompts, response_length - prefix


def continue_generation(rollout, rows: DataProto, version: int) -> DataProto:
    """Generate the rest of each cut row with `rollout` (an `HFRollout`) and lay prefix + rest out as one response.

    The new tokens carry `version`; the prefix keeps its own versions and log-probs. Returns rows of the rollout
    contract for the original prompts, with `rollout_versions` and the continuation's `stop_reason`.
    """
    params = rollout.sampling_for(rows.meta_info)
    eos_ids, pad_id = rollout.special_tokens_for(rows.meta_info)
    prompts, budgets = continuation_prompts(rows)
    seeds = [int(seed) for seed in rows.non_tensor_batch[SEED_KEY]]
    tokens, lengths, log_probs, stops = rollout.generate_tokens(
        prompts, replace(params, response_length=int(budgets.max())), eos_ids, pad_id, seeds, budgets=budgets
    )
    response_length = params.response_length
    prefix = rows.batch["response_mask"].sum(-1)
    responses = rows.batch["responses"].clone()
    versions = rows.batch[VERSIONS_KEY].clone()
    old_log_probs = rows.batch["rollout_log_probs"].clone() if "rollout_log_probs" in rows.batch_keys else None
    for i, (start, count) in enumerate(zip(prefix.tolist(), lengths.tolist())):
        responses[i, start : start + count] = tokens[i, :count]
        versions[i, start : start + count] = version
        if old_log_probs is not None and log_probs is not None:
            old_log_probs[i, start : start + count] = log_probs[i, :count]
    original = DataProto.from_dict(
        {
            "input_ids": rows.batch["prompts"],
            "attention_mask": rows.batch["attention_mask"][:, : rows.batch["prompts"].shape[1]],
            "position_ids": rows.batch["position_ids"][..., : rows.batch["prompts"].shape[1]],  # [B, (4,) P]
        },
        dict(rows.non_tensor_batch),
    )
    out = build_rollout_output(original, responses, prefix + lengths, response_length, eos_ids, pad_id, old_log_probs)
    return mark_rollout_state(out, stops, versions)
