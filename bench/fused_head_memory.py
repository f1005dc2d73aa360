"""Peak memory of one actor forward+backward with and without the fused head (model.use_fused_kernels).

    python bench/fused_head_memory.py                  # 4 x 512 tokens, vocab 32768, hidden 256, CPU
    python bench/fused_head_memory.py --device cuda    # the same on a GPU (peak allocated bytes)

Both modes run `forward_micro_batch` (log-probs and entropy of every response token, packed row) and a
backward of `sum(log_probs) + 0.01 * sum(entropy)`, on the same random-init Qwen2 and the same batch. Each
mode runs in its own child process of this run, one after the other. The peak is measured from just before
the forward to the end of the backward: on CPU as the rise of the process's resident high-water mark
(`ru_maxrss`), on CUDA as `max_memory_allocated` above the memory in use before the forward. The plain path
holds the [tokens, vocab] fp32 logits (and their gradient); the fused head holds one chunk's (512 tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
from _common import make_rl_batch, tiny_causal_lm


def measure(fused: bool, args) -> dict:
    torch.manual_seed(0)
    model = tiny_causal_lm(args.hidden, 2, 4, 2, args.vocab, use_remove_padding=True).to(args.device)
    seqs = args.sequences
    lens = torch.full((seqs,), args.tokens // 2)
    batch = make_rl_batch(lens, lens, args.tokens // 2, args.tokens // 2, args.vocab, seed=0)
    micro = {k: batch.batch[k].to(args.device) for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    from rlframe.workers.model_forward import ScoringSpec, forward_micro_batch

    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = forward_micro_batch(
        model, micro, args.tokens // 2, ScoringSpec(calculate_entropy=True, use_fused_kernels=fused)
    )
    (out["log_probs"].sum() + 0.01 * out["entropy"].sum()).backward()
    if args.device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"fused": fused, "peak_bytes": peak, "tokens": int(micro["attention_mask"].sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="prompt + response tokens per sequence")
    parser.add_argument("--child", choices=("plain", "fused"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "fused", args)))
        return
    results = {}
    for mode in ("plain", "fused"):
        child = [sys.executable, __file__, "--child", mode] + sys.argv[1:]
        results[mode] = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
    tokens, logits_mib = results["plain"]["tokens"], results["plain"]["tokens"] * args.vocab * 4 / 2**20
    print(f"{tokens} tokens x vocab {args.vocab}: fp32 logits {logits_mib:.0f} MiB; device {args.device}")
    for mode, result in results.items():
        print(f"  {mode:5s} peak {result['peak_bytes'] / 2**20:8.1f} MiB")
    print(f"  fused / plain = {results['fused']['peak_bytes'] / results['plain']['peak_bytes']:.3f}")


if __name__ == "__main__":
    main()
