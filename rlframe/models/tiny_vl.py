"""`builtin://tiny-vl`: a tiny random-init vision-language model of the Qwen2-VL family, built offline.

A Qwen2-VL vision tower (one block, 14-pixel patches merged 2 x 2 into one image token) feeds a two-layer
language model with 3-D rotary positions (mrope), exactly the architecture of Qwen2-VL checkpoints, only
small: ~1.3 M parameters. The folder holds what a Hugging Face Qwen2-VL checkpoint holds (config, weights,
tokenizer with the vision tokens and a chat template that renders image parts, `preprocessor_config.json`),
so rlframe loads it as it loads Qwen2-VL and Qwen2.5-VL (`rlframe.models.vision`).

Its tokenizer's vocabulary is learnt from the built-in image tasks' text (as the quickstart model's is from
its task), so that a random policy starts with the right one-digit answer often enough to learn from; text
outside that alphabet is dropped when encoding, so the model is for the built-in tasks and for tests.
"""

from __future__ import annotations

import os

from rlframe.models.tiny import build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template for the parts it renders: text, and an image as <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILTIN_MODEL = "builtin://tiny-vl"
# head_dim 64 (256 / 4): vLLM's CPU attention refuses smaller heads, and the model should run there too
TINY_VL_SHAPE = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 64}
# images are resized to between 56 x 56 (4 x 4 patches: 4 image tokens) and 112 x 112 pixels (16 image tokens)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


# The built-in image tasks' prompts (rlframe.data.image_tasks draws their pictures): the tokenizer learns its
# vocabulary from their text
COLOUR_PROMPT = "<image>Which colour covers the most? 1 red 2 green 3 blue 4 yellow. Answer with the number."
COUNT_PROMPT = "<image>How many squares? Answer with the number."
TASK_TEXT = [
    "user\n" + COLOUR_PROMPT.removeprefix("<image>") + "\nassistant\n1",
    "user\n" + COUNT_PROMPT.removeprefix("<image>") + "\nassistant\n4",
    "12345 67890",
]


def build_vl_tokenizer(vocab_size: int = TINY_VL_SHAPE["vocab_size"]):
    """The tiny byte-level tokenizer plus Qwen2-VL's vision tokens, with a chat template that renders images.

    Its alphabet is the image tasks' characters (others are dropped when encoding), as the quickstart model's is.
    """
    return with_vision_tokens(build_tokenizer(vocab_size, corpus=TASK_TEXT, alphabet=[]))


def with_vision_tokens(tokenizer):
    """`tokenizer` (rlframe.models.tiny's) with Qwen2-VL's vision tokens and a chat template that renders images."""
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_vl_model(out_dir: str, seed: int = 0, tokenizer=None) -> str:
    """Write the tiny Qwen2-VL model, its tokenizer (by default `build_vl_tokenizer()`; tests pass a wider one
    through `with_vision_tokens`) and its image processor's config to `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = tokenizer or build_vl_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    shape = TINY_VL_SHAPE
    head_dim = shape["hidden_size"] // shape["num_heads"]
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": shape["hidden_size"],
            "intermediate_size": 2 * shape["hidden_size"],
            "num_hidden_layers": shape["num_layers"],
            "num_attention_heads": shape["num_heads"],
            "num_key_value_heads": shape["num_kv_heads"],
            "max_position_embeddings": 2048,
            # the rotary half-dimensions (head_dim / 2 = 32) split over time, height and width
            "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0},
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None,
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": shape["hidden_size"],  # the merger projects into the language model's width
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False
    )
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    return out_dir
