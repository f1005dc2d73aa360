"""Padded vs remove-padding forward passes: the tiny model, an RL batch, a run, the tolerance check."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from rlframe.distributed.padding import (
    position_ids_from_mask,
)
from rlframe.workers.model_forward import ScoringSpec, forward_micro_batch, layout_for

PROMPT_LEN, RESPONSE_LEN = 6, 5


def make_rl_batch(prompt_lens, response_lens, vocab_size, seed=0):
    """Left-padded prompts + right-padded responses, like a rollout batch."""
    g = torch.Generator().manual_seed(seed)
    batch_size = len(prompt_lens)
    mask = torch.zeros(batch_size, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, PROMPT_LEN - p : PROMPT_LEN + r] = 1
    input_ids = torch.randint(3, vocab_size, mask.shape, generator=g) * mask
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask),
        "responses": input_ids[:, PROMPT_LEN:],
    }


def assert_rel_close(actual, expected, rel=1e-5):
    """Max abs error within `rel` of the expected tensor's scale."""
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max()
    assert err <= rel * scale, f"max abs err {err:.3e} > {rel} * {scale:.3e}"


def load(path, attn, value_head=False):
    if value_head:
        torch.manual_seed(0)  # the score head is new: same seed, same head in every model
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # Qwen2Config has no such field; the token-classification head reads it
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, attn_implementation=attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    return model.float()


def run(model, batch, use_remove_padding=True, **scoring):
    """Forward + backward of a masked sum; returns the outputs and the parameter gradients."""
    model.zero_grad()
    out = forward_micro_batch(model, batch, RESPONSE_LEN, ScoringSpec(**scoring), layout_for(use_remove_padding))
    mask = batch["attention_mask"][:, -RESPONSE_LEN:]
    loss = sum((x * mask * (i + 1)).sum() for i, x in enumerate(out.values()))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, grads
