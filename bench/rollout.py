"""HF rollout throughput on CPU: generated tokens per second at batch 64.

    python bench/rollout.py                            # tiny (~0.1M) and ~50M Qwen2, batch 64
    python bench/rollout.py --models 50m --micro-batch-size 16 --response-length 128

Models are random-init Qwen2 shapes written locally (no hub). Random weights rarely emit EOS, so
almost every response runs to `--response-length`; tokens/s counts only tokens inside
`response_mask`. Each configuration is generated `--repeats` times after one warm-up call and the
median is reported. Wall time includes prefill, decode, and building the output tensors.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from rlframe.config.loader import load_config, resolved
from rlframe.models.tiny import make_tiny_model
from rlframe.protocol import DataProto
from rlframe.workers.rollout import build_rollout

# name -> make_tiny_model kwargs (hidden, layers, heads, kv heads); intermediate = 2 * hidden
MODELS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    "50m": dict(hidden_size=768, num_layers=10, num_heads=12, num_kv_heads=4),
}


def make_prompts(batch: int, prompt_length: int, seed: int = 0) -> DataProto:
    """Left-padded prompts whose real lengths are spread between half and full width."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (batch, prompt_length), generator=gen)
    lengths = torch.randint(prompt_length // 2, prompt_length + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_length)[None, :] >= prompt_length - lengths[:, None]).long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids * mask, "attention_mask": mask, "position_ids": position_ids})


def bench_model(name: str, args, workdir: str) -> dict:
    from transformers import AutoTokenizer

    path = make_tiny_model(f"{workdir}/{name}", **MODELS[name])
    cfg = resolved(
        load_config(
            [
                f"data.max_prompt_length={args.prompt_length}",
                f"data.max_response_length={args.response_length}",
                f"actor_rollout_ref.rollout.micro_batch_size={args.micro_batch_size}",
            ]
        )
    )
    rollout = build_rollout("hf", cfg.actor_rollout_ref.rollout, path, AutoTokenizer.from_pretrained(path), "cpu")
    num_params = sum(p.numel() for p in rollout.model.parameters())
    prompts = make_prompts(args.batch, args.prompt_length)
    rollout.generate_sequences(make_prompts(args.micro_batch_size, args.prompt_length, seed=1))  # warm-up
    rates, times, lengths = [], [], []
    for repeat in range(args.repeats):
        torch.manual_seed(repeat)
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts)
        elapsed = time.perf_counter() - start
        tokens = int(out.batch["response_mask"].sum())
        rates.append(tokens / elapsed)
        times.append(elapsed)
        lengths.append(out.meta_info["metrics"]["response_length/mean"])
    return {
        "model": name,
        "params_m": num_params / 1e6,
        "batch": args.batch,
        "tokens_per_s": statistics.median(rates),
        "seconds": statistics.median(times),
        "mean_response_length": statistics.mean(lengths),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"hf rollout on CPU ({torch.get_num_threads()} threads): batch {args.batch}, micro-batch "
        f"{args.micro_batch_size}, prompt {args.prompt_length}, response {args.response_length}"
    )
    print(f"{'model':>6} {'params':>9} {'seconds':>8} {'tokens/s':>9} {'mean len':>9}")
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models:
            r = bench_model(name, args, workdir)
            print(
                f"{r['model']:>6} {r['params_m']:>8.1f}M {r['seconds']:>8.2f} {r['tokens_per_s']:>9.0f} "
                f"{r['mean_response_length']:>9.1f}"
            )


if __name__ == "__main__":
    main()
