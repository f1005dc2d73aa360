"""LoRA vs full fine-tuning: trainable parameters, gradient and AdamW optimizer-state bytes.

    python bench/lora_memory.py            # builtin://tiny and a larger random Qwen2 shape (~20 s on 2 cores)
    python bench/lora_memory.py --quick    # builtin://tiny only

For each model, the actor is built as the worker builds it (`apply_lora` with verl's defaults
`target_modules: all-linear`, `lora_alpha: 16`; `build_optimizer` = AdamW over the trainable
parameters), one forward/backward and one optimizer step run, and then the bytes are counted: the
gradients that exist and every tensor in the optimizer's state (AdamW: exp_avg, exp_avg_sq and a
0-dim step per parameter). Parameter bytes are printed for scale: with LoRA the frozen base stays in
memory (fp32 here; FSDP shards it the same way in both cases). Single process, no FSDP: under FSDP
every number divides by the shard count alike.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _common import add_thread_flag, print_table, tiny_causal_lm
from omegaconf import OmegaConf

from rlframe.workers.lora import LoraSpec, apply_lora
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.optimizer import build_optimizer

LARGER = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, vocab_size=4096, intermediate_size=1536)
OPTIM = OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01})


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure(model: torch.nn.Module) -> dict:
    """One AdamW step on a fixed batch; the trainable parameters and the bytes of grads and optimizer state."""
    optimizer = build_optimizer(model, OPTIM)
    ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
    optimizer.step()
    return {
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total": sum(p.numel() for p in model.parameters()),
        "param_bytes": tensor_bytes(model.parameters()),
        "grad_bytes": tensor_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optim_bytes": sum(tensor_bytes(state.values()) for state in optimizer.state.values()),
    }


def models():
    """(name, builder) pairs: builtin://tiny from its files, and a larger random shape."""
    folder = tempfile.mkdtemp()

    def tiny():
        from rlframe.models.tiny import make_tiny_model

        path = make_tiny_model(folder)
        return load_hf_model(ModelSpec(path=path, role="actor", dtype=torch.float32, use_remove_padding=False))

    def larger():
        return tiny_causal_lm(**LARGER, use_remove_padding=False)

    return [("builtin://tiny", tiny), ("qwen2 h512 x8 layers", larger)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8, help="lora_rank (default 8)")
    parser.add_argument("--quick", action="store_true", help="builtin://tiny only")
    add_thread_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = LoraSpec(rank=args.rank, alpha=16, target_modules="all-linear", exclude_modules=None)
    rows = []
    for name, build in models()[:1] if args.quick else models():
        for mode in ("full", f"lora r={args.rank}"):
            torch.manual_seed(0)
            model = build() if mode == "full" else apply_lora(build(), spec)
            m = measure(model)
            rows.append(
                [
                    name,
                    mode,
                    f"{m['trainable']:,}",
                    f"{m['trainable'] / m['total']:.2%}",
                    f"{m['param_bytes'] / 2**20:.2f}",
                    f"{m['grad_bytes'] / 2**20:.3f}",
                    f"{m['optim_bytes'] / 2**20:.3f}",
                ]
            )
    print_table(["model", "mode", "trainable params", "of all", "param MiB", "grad MiB", "optimizer MiB"], rows)


if __name__ == "__main__":
    main()
