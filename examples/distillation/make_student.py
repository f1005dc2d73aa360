"""Build the distillation example's student: SmolLM2-135M-Instruct without one of its middle layers.

    python examples/distillation/make_student.py OUT_DIR [--drop 15:16]

The student keeps the teacher's tokenizer and every other weight, so the teacher can score its tokens
(`docs/distillation.md`). Dropping layer 15 of 30 leaves a model that still writes sentences but has lost the task:
on `gsm8k_arith` its greedy answers score 0 on the 64 validation prompts (0.004 on 256; 14% end with the `#### n`
line the scorer reads), where the teacher's score 0.109 (0.141 on 256; 53% with the line). Dropping layers 12-15
also scores 0; dropping ten layers, or late ones, leaves gibberish (checked on 12 prompts: no sentence at all),
which no teacher signal on 32-token samples repairs in a few steps.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlframe.models import smollm2
from rlframe.models.builtin import resolve_model_path

TEACHER = f"builtin://{smollm2.NAME}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--drop", default="15:16", help="the layers dropped, START:END (end excluded)")
    args = parser.parse_args()
    start, end = (int(x) for x in args.drop.split(":"))
    if (args.out_dir / "config.json").exists():
        print(f"[student] {args.out_dir} exists: kept as it is")
        return
    path = resolve_model_path(TEACHER)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_layers = model.config.num_hidden_layers
    if not 0 <= start < end <= n_layers:
        parser.error(f"--drop {args.drop}: the teacher has layers 0..{n_layers - 1}")
    keep = [i for i in range(n_layers) if not start <= i < end]
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in keep)
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = index  # the KV cache is indexed by position in the stack
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    model.save_pretrained(args.out_dir)
    AutoTokenizer.from_pretrained(path).save_pretrained(args.out_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"[student] {args.out_dir}: layers {start}-{end - 1} of {n_layers} dropped, {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
