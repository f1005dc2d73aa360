"""The vLLM CPU engine tests' shared pieces: the rollout config, tolerances, HF greedy decoding and log-probs,
weight updates."""

from __future__ import annotations

import torch

ROLLOUT = "actor_rollout_ref.rollout"


def rollout_cfg(*overrides: str):
    from helpers.rollout import typed_rollout
    from rlframe.config.loader import load_config

    base = [
        "data.max_prompt_length=24",
        "data.max_response_length=16",
        f"{ROLLOUT}.name=vllm",
        f"{ROLLOUT}.mode=sync",
        f"{ROLLOUT}.max_model_len=64",
        f"{ROLLOUT}.max_num_seqs=16",
        f"{ROLLOUT}.enforce_eager=true",
        f"{ROLLOUT}.load_format=dummy",
    ]
    return typed_rollout(load_config([*base, *overrides]))


def updated(model, step: int, scale: float = 0.05) -> None:
    """One 'update' at a high learning rate: every parameter (the tied embedding once) moved by scale x its std."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * param.std() * torch.randn(param.shape, generator=gen))


def hf_token_log_probs(model, out) -> torch.Tensor:
    """The actor's log-probs of the generated tokens (temperature 1), by the rollout contract's layout."""
    from rlframe.workers.model_forward import LOG_PROBS, PaddedLayout, forward_micro_batch

    batch = {k: out.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    with torch.no_grad():
        result = forward_micro_batch(model, batch, batch["responses"].shape[1], LOG_PROBS, PaddedLayout())
    return result["log_probs"].float()


def hf_greedy(model, prompts, max_new_tokens: int, eos_ids: list[int]) -> list[list[int]]:
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    rows = []
    for row, keep in zip(ids, mask.bool()):
        prompt = row[keep][None]
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids)
        rows.append(out[0, prompt.shape[1] :].tolist())
    return rows


def vllm_rows(out) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(out.batch["responses"], out.batch["response_mask"])]


PROB_DIFF_MEAN, PROB_DIFF_MAX = 1e-4, 1e-3
