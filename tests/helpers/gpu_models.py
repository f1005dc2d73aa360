"""The model the GPU checks run: SmolLM2-135M-Instruct when it is at hand, else a random one of its shape.

SmolLM2's attention (head size 64, 9 query and 3 key/value heads) runs the kernels production runs
(vLLM's FlashAttention backend, flash-attn's varlen kernel), unlike the tiny test model's head size 16.
`builtin://smollm2-135m-instruct` is used when its converted folder is already in the cache or its
source is named by $RLFRAME_SMOLLM2_SOURCE; nothing is downloaded here (the lent GPU machines have no
network). The stand-in is random-init with SmolLM2's config and the tiny offline tokenizer.
"""

from __future__ import annotations

import os

import torch

# SmolLM2-135M-Instruct's architecture (its config.json)
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def cached_smollm2() -> str | None:
    """The converted SmolLM2 folder when it is in the cache or its source is given, else None."""
    from rlframe.models import smollm2
    from rlframe.models.builtin import prepare_builtin
    from rlframe.utils.cache import cache_dir

    if os.path.isfile(os.path.join(cache_dir(), "models", smollm2.FOLDER, "config.json")) or os.environ.get(
        smollm2.SOURCE_ENV
    ):
        return prepare_builtin(smollm2.NAME)
    return None


def smollm2_stand_in(out_dir: str, seed: int = 0) -> str:
    """A random-init model of SmolLM2's shape with the tiny tokenizer, saved as a checkpoint folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlframe.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        **SMOLLM2_SHAPE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def smollm2_or_stand_in(out_dir: str) -> tuple[str, str]:
    """(folder, which): the real model when at hand, else the stand-in written to `out_dir`."""
    path = cached_smollm2()
    if path is not None:
        return path, "SmolLM2-135M-Instruct"
    return smollm2_stand_in(out_dir), "random-init SmolLM2 shape"


def tp2_stand_in(out_dir: str) -> str:
    """SmolLM2's head size (64) with heads that split over 2 TP ranks (8 query, 2 key/value), 4 layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlframe.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    shape = dict(SMOLLM2_SHAPE, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    config = LlamaConfig(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
