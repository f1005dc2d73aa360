"""LoRA on the real vLLM engine (its CPU build): the base weights once, then each adapter version as a LoRA request.

SmolLM2 in fp32 (vLLM's CPU LoRA kernels take fp32; its CUDA ones do not) with a rank-8 adapter on every linear
layer: vLLM's log-probs of its own greedy tokens are the PEFT model's, not the base model's, after the first sync
(base weights through the reload, then the adapter), after a new adapter, and after a second sync of both (the
reload drops vLLM's loaded adapters; the next request loads the served one again).
"""

from __future__ import annotations

import pytest
import torch
from helpers.lora import _scores, base_model, randomize_b
from helpers.rollout import load_tokenizer, make_prompts
from helpers.vllm_cpu import rollout_cfg

from rlframe.workers import lora
from rlframe.workers.weight_sync import sync_lora_to_rollout

pytestmark = pytest.mark.vllm


def test_vllm_cpu_serves_the_adapter_across_updates(world, smollm2_path):  # noqa: F811
    from rlframe.workers.rollout import ServedModel, build_rollout

    torch.manual_seed(0)
    model = lora.apply_lora(
        base_model(smollm2_path), lora.LoraSpec(rank=8, alpha=16, target_modules="all-linear", exclude_modules=None)
    )
    randomize_b(model, seed=1)
    base = base_model(smollm2_path)
    engine = build_rollout(
        "vllm", rollout_cfg(), ServedModel(smollm2_path, lora_rank=8), load_tokenizer(smollm2_path), "cpu"
    )
    try:
        assert engine.takes_lora_adapter and engine.needs_base_weights  # load_format=dummy: the base comes by sync
        prompts = make_prompts(seed=5, do_sample=False)
        for update in range(3):
            if update == 1:
                randomize_b(model, seed=7)  # a new adapter version
            if update == 2:
                engine.needs_base_weights = True  # the base again: vLLM's reload drops its loaded adapters
            sync_lora_to_rollout(engine, model, adapter=True)
            assert not engine.needs_base_weights
            out = engine.generate_sequences(prompts)
            served, tokens = out.batch["rollout_log_probs"], out.batch["response_mask"].sum()
            to_adapted = float((served - _scores(model, out)).abs().sum() / tokens)
            to_base = float((served - _scores(base, out)).abs().sum() / tokens)
            print(f"update {update}: |vLLM - PEFT| {to_adapted:.1e}, |vLLM - base| {to_base:.1e} per token")
            assert to_adapted < 1e-4 and to_base > 1e-2, (update, to_adapted, to_base)
    finally:
        engine.shutdown()
