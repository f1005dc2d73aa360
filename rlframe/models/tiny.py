"""Build a tiny random-init Qwen2-style causal LM and a locally trained tokenizer.

Nothing here touches a model hub: the tokenizer is trained with the `tokenizers`
library on a small synthetic corpus, the model is random-init from a config, and
both are written with `save_pretrained` so every other part of rlframe loads them
exactly like a real checkpoint.
"""

from __future__ import annotations

import argparse
import os
import random

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

_WORDS = (
    "what is the sum of and plus minus times answer count how many letters in word "
    "please solve compute result number question think step user assistant system "
    "you are a helpful the final #### boxed equals"
).split()


def _corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(f"{words} {a} + {b} = {a + b}. {rng.choice(_WORDS)}?")
    return lines


def build_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None, alphabet: list[str] | None = None):
    """Train a byte-level BPE tokenizer with chat template and pad/eos.

    By default its alphabet is all 256 bytes (no unknown tokens) and it learns merges from a small
    arithmetic corpus. `corpus` and `alphabet` (byte-level characters) give a task vocabulary
    instead: characters outside the alphabet are dropped when encoding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are split one by one so arithmetic answers are spelled digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet is None else alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, padding_side="left"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_model_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    pad_token_id: int = 0,
    eos_token_id: int = 2,
):
    """Qwen2 config with GQA (num_kv_heads < num_heads)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )


BUILTIN_MODEL = "builtin://tiny"  # the model path that names this model in configs
# The tiny model's shape, one place for make_tiny_model, its CLI and the batch plan's head checks.
TINY_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}


def make_tiny_model(out_dir: str, seed: int = 0, tokenizer=None, **shape: int) -> str:
    """Write a tiny random-init Qwen2 causal LM plus tokenizer (by default `build_tokenizer(vocab_size)`).

    `shape` overrides entries of `TINY_SHAPE` (hidden_size, num_layers, num_heads, num_kv_heads, vocab_size).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    unknown = set(shape) - set(TINY_SHAPE)
    if unknown:
        raise TypeError(f"make_tiny_model: unknown shape {sorted(unknown)}; it takes {sorted(TINY_SHAPE)}")
    shape = {**TINY_SHAPE, **shape}
    tokenizer = tokenizer or build_tokenizer(shape["vocab_size"])
    config = build_model_config(
        **{**shape, "vocab_size": len(tokenizer)},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


QUICKSTART_MODEL = "builtin://tiny-quickstart"  # the quickstart's model: a task vocabulary, wider layers
QUICKSTART_SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 64}


def _quickstart_corpus() -> list[str]:
    """The quickstart task's text ("3+4=" -> "7") and the chat template's roles: its whole alphabet."""
    lines = [f"user\n{a}+{b}=\nassistant\n{a + b}" for a in range(10) for b in range(10)]
    return lines + ["system\nWhat is 1 + 2? Answer with the number only."]


def make_quickstart_model(out_dir: str, seed: int = 0) -> str:
    """The quickstart's random-init model: 64 tokens, so a random policy starts with a digit 16% of the time.

    The vocabulary holds only the characters of the quickstart task and the chat template
    (others are dropped when encoding): a random policy over the ~400 tokens of `builtin://tiny`
    rarely starts with the right digit, and reinforcement learning from there found too little
    signal for *which* digit in a few minutes (docs/learning_baseline.md).
    """
    tokenizer = build_tokenizer(QUICKSTART_SHAPE["vocab_size"], corpus=_quickstart_corpus(), alphabet=[])
    return make_tiny_model(out_dir, seed, tokenizer, **QUICKSTART_SHAPE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    for name, default in TINY_SHAPE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out_dir, args.seed, **{name: getattr(args, name) for name in TINY_SHAPE})
    print(f"tiny model written to {path}")


if __name__ == "__main__":
    main()
