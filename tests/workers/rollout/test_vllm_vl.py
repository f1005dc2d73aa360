"""vLLM serving the tiny Qwen2-VL (builtin://tiny-vl) with images: rlframe's prompts (image tokens expanded, images
as PIL in `multi_modal_data`) give HF's greedy tokens and the actor's probabilities, before and after a weight sync
that moves the vision tower too; through the engine (`mode=sync`) and the async server.

Marked `gpu`: vLLM's Qwen2-VL module imports transformers' torchvision image processor, and PyPI's torchvision does
not import beside the CPU torch that vLLM's CPU build pins (`operator torchvision::nms does not exist`), so vLLM's
CPU build cannot serve the family here (docs/multimodal.md). Not run yet: the GPU check cannot carry vLLM either.
"""

from __future__ import annotations

import pytest
import torch
from helpers.rollout import load_tokenizer
from helpers.vllm_cpu import PROB_DIFF_MAX, PROB_DIFF_MEAN, ROLLOUT, rollout_cfg, updated
from omegaconf import OmegaConf

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]
PROMPT, RESPONSE = 64, 6


@pytest.fixture(scope="module")
def hf_model(tiny_vl_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_vl_path, tmp_path_factory):
    """Four count_vl rows (an 84 x 84 image each: 9 image tokens) as the dataset lays them out."""
    from rlframe.data.builtin_tasks import resolve_data_files
    from rlframe.data.config import DataConfig
    from rlframe.data.dataset import RLHFDataset, collate_fn
    from rlframe.models.vision import load_vision_processor
    from rlframe.protocol import DataProto

    tokenizer = load_tokenizer(tiny_vl_path)
    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = PROMPT
    files = resolve_data_files("builtin://count_vl", str(tmp_path_factory.mktemp("data")), 1, "val")
    dataset = RLHFDataset(files, tokenizer, config, load_vision_processor(tiny_vl_path, tokenizer))
    rows = collate_fn([dataset[i] for i in range(4)])
    keys = ("input_ids", "attention_mask", "position_ids", "multi_modal_inputs", "multi_modal_data")
    return DataProto.from_single_dict({k: rows[k] for k in keys}, meta_info={"do_sample": False})


def _engine(world, tiny_vl_path, mode: str):
    from rlframe.workers.rollout import build_rollout

    cfg = rollout_cfg(
        f"data.max_prompt_length={PROMPT}",
        f"data.max_response_length={RESPONSE}",
        f"{ROLLOUT}.max_model_len=128",
        f"{ROLLOUT}.calculate_log_probs=true",
        f"{ROLLOUT}.mode={mode}",
    )
    return build_rollout("vllm", cfg, tiny_vl_path, load_tokenizer(tiny_vl_path), "cuda")


def _hf_rows(model, prompts) -> list[list[int]]:
    from rlframe.models.vision import VisionSpec, generation_image_inputs

    rows = []
    for i in range(len(prompts)):
        ids, mask = prompts.batch["input_ids"][i : i + 1], prompts.batch["attention_mask"][i : i + 1]
        images = generation_image_inputs(
            prompts.non_tensor_batch["multi_modal_inputs"][i : i + 1], ids, VisionSpec.from_config(model.config)
        )
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=RESPONSE, do_sample=False, **images)
        rows.append(out[0, PROMPT:].tolist())
    return rows


def _actor_log_probs(model, prompts, out) -> torch.Tensor:
    from rlframe.models.vision import concat_image_inputs

    b = out.batch
    images = concat_image_inputs(prompts.non_tensor_batch["multi_modal_inputs"], b["input_ids"].device)
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"].transpose(0, 1),
            **images,
        ).logits[:, PROMPT - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, b["responses"][..., None]).squeeze(-1) * b["response_mask"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_vllm_serves_the_tiny_vl_model_with_images_before_and_after_a_sync(
    world, tiny_vl_path, hf_model, prompts, mode
):
    import copy

    from rlframe.algorithms.rollout_correction import probs_diff_metrics

    model = copy.deepcopy(hf_model)
    engine = _engine(world, tiny_vl_path, mode)
    try:
        for step in range(2):
            if step:
                updated(model, step, scale=0.5)  # the vision tower moves too: a stale tower changes the tokens
            engine.update_weights(iter(model.state_dict().items()))
            out = engine.generate_sequences(prompts)
            rows = [r[m.bool()].tolist() for r, m in zip(out.batch["responses"], out.batch["response_mask"])]
            expected = _hf_rows(model, prompts)
            assert rows == [e[: len(r)] for r, e in zip(rows, expected)], (step, rows, expected)
            metrics = probs_diff_metrics(
                out.batch["rollout_log_probs"], _actor_log_probs(model, prompts, out), out.batch["response_mask"]
            )
            assert metrics["training/rollout_probs_diff_mean"] < PROB_DIFF_MEAN, metrics
            assert metrics["training/rollout_probs_diff_max"] < PROB_DIFF_MAX, metrics
    finally:
        engine.shutdown()
