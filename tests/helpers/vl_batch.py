"""A vision-language RL batch for the equivalence tests: rows with different numbers and sizes of images.

Laid out as the dataset and rollout lay one out (`rlframe.models.vision`): each image's `<|image_pad|>` repeated
for its grid between `<|vision_start|>` and `<|vision_end|>`, left-padded prompts, right-padded responses,
positions [4, seqlen] from `mrope_position_ids` over the whole row, and `multi_modal_inputs` from the checkpoint's
own image processor. The pixels are noise: the tests compare layouts, not what the model sees.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from helpers.fsdp_harness import RESPONSE_LEN
from rlframe.protocol import DataProto

# (height, width) of each row's images: none, one, two, of the sizes the tiny model's processor keeps
# (56 x 56 is 4 image tokens, 112 x 112 is 16)
ROW_IMAGES = [
    [],
    [(56, 56)],
    [(56, 84), (112, 112)],
    [(84, 84)],
    [(112, 56)],
    [],
    [(56, 56), (56, 56)],
    [(112, 84)],
]


def make_vl_batch(model_path: str, seed: int = 0) -> DataProto:
    """len(ROW_IMAGES) rows of text around images plus a response, with PPO inputs, in verl's VLM batch format."""
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from rlframe.models.vision import VisionProcessor, mrope_position_ids

    config = AutoConfig.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    processor = VisionProcessor(model_path, tokenizer, config)
    spec, start, end = processor.spec, config.vision_start_token_id, config.vision_end_token_id
    text_ids = [i for i in range(3, config.text_config.vocab_size) if i not in tokenizer.all_special_ids]
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def text(n: int) -> list[int]:
        return [text_ids[i] for i in torch.randint(len(text_ids), (n,), generator=gen).tolist()]

    prompts, responses, inputs = [], [], []
    for sizes in ROW_IMAGES:
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        row_inputs = processor.images(images)
        ids = text(int(torch.randint(1, 4, (1,), generator=gen)))
        for _ in range(len(sizes)):
            ids += [start, spec.image_token_id, end]
            ids += text(int(torch.randint(0, 3, (1,), generator=gen)))
        prompts.append(spec.expand(ids, row_inputs.get("image_grid_thw")))
        responses.append(text(int(torch.randint(1, RESPONSE_LEN + 1, (1,), generator=gen))))
        inputs.append(row_inputs)
    prompt_len = max(len(p) for p in prompts)
    num_seqs = len(prompts)
    ids = torch.zeros(num_seqs, prompt_len + RESPONSE_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        ids[i, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        ids[i, prompt_len : prompt_len + len(response)] = torch.tensor(response)
        mask[i, prompt_len - len(prompt) : prompt_len + len(response)] = 1
    positions = torch.stack(
        [mrope_position_ids(ids[i], mask[i], inputs[i].get("image_grid_thw"), spec) for i in range(num_seqs)]
    )
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions,
        "responses": ids[:, prompt_len:],
        "old_log_probs": -5.0 + 0.3 * torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
        "ref_log_prob": -5.0 + 0.3 * torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
        "advantages": torch.randn(num_seqs, RESPONSE_LEN, generator=gen),
    }
    return DataProto.from_dict(tensors, {"multi_modal_inputs": inputs})


def make_tiny_qwen25_vl(out_dir: str, tiny_vl_path: str) -> str:
    """A tiny random-init Qwen2.5-VL beside builtin://tiny-vl: its tokenizer and image processor, Qwen2.5-VL's
    tower (window attention in its first block, full attention in the second) and the same language model shape."""
    import shutil

    from transformers import AutoConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vl = AutoConfig.from_pretrained(tiny_vl_path)
    text = vl.text_config.to_dict()
    config = Qwen2_5_VLConfig(
        text_config={k: text[k] for k in Qwen2_5_VLConfig().text_config.to_dict() if k in text},
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": vl.text_config.hidden_size,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        image_token_id=vl.image_token_id,
        video_token_id=vl.video_token_id,
        vision_start_token_id=vl.vision_start_token_id,
        vision_end_token_id=vl.vision_end_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    for name in os.listdir(tiny_vl_path):  # the tokenizer and the image processor
        if name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(os.path.join(tiny_vl_path, name), out_dir)
    return out_dir
