"""Remove-padding vs padded actor forward+backward: real tokens per second on the bimodal length mix.

    python bench/remove_padding.py            # 32 sequences, micro-batch 8, 7 timed passes per mode
    python bench/remove_padding.py --quick    # 16 sequences, 2 timed passes

Both modes run `forward_micro_batch` (log-probs of the response tokens) and a backward of their
sum on the same batch, cut into the same static micro-batches, with the same random-init weights.
Padded mode feeds [micro, prompt_width + response_width] with an attention mask (`sdpa`);
remove-padding packs each micro-batch's valid tokens into one row (`rlframe_varlen`). Tokens/s
counts real (valid) tokens only, so the two rates are directly comparable. padded/real tokens is
the speedup ceiling of the per-token work (projections, MLP, logits); attention is quadratic in
the padded width, so a padded forward wastes even more there and the measured speedup can exceed
that ratio. Lengths: see `bench/_common.py` (long responses 200–512 = the GPU mix's 800–2048 / 4).
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    CPU_MIX,
    add_thread_flag,
    make_rl_batch,
    median,
    padding_stats,
    print_table,
    sample_lengths,
    timed,
    tiny_causal_lm,
)

from rlframe.workers.model_forward import LOG_PROBS, forward_micro_batch, layout_for

MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512)


def forward_backward(model, micro_batches, response_width: int, use_remove_padding: bool) -> None:
    """One pass over all micro-batches: log-probs, then backward of their masked sum."""
    model.zero_grad(set_to_none=True)
    for micro in micro_batches:
        out = forward_micro_batch(model, micro, response_width, LOG_PROBS, layout_for(use_remove_padding))
        out["log_probs"].sum().backward()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sequences and repeats (a smoke run)")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    add_thread_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_seqs, args.repeats = 16, 2
    torch.set_num_threads(args.threads)

    prompt_lens, response_lens = sample_lengths(CPU_MIX, args.num_seqs, args.seed)
    batch = make_rl_batch(
        prompt_lens, response_lens, CPU_MIX.prompt_width, CPU_MIX.response_width, MODEL["vocab_size"], args.seed
    )
    real, padded = padding_stats(batch)
    inputs = batch.batch.select("input_ids", "attention_mask", "position_ids", "responses")
    micro_batches = list(inputs.split(args.micro_batch_size))

    padded_model = tiny_causal_lm(**MODEL, use_remove_padding=False)
    rmpad_model = tiny_causal_lm(**MODEL, use_remove_padding=True)
    rmpad_model.load_state_dict(padded_model.state_dict())
    params_m = sum(p.numel() for p in padded_model.parameters()) / 1e6

    print(
        f"actor forward+backward on CPU ({torch.get_num_threads()} threads), Qwen2 {params_m:.2f}M params "
        f"(hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, vocab {MODEL['vocab_size']})"
    )
    print(
        f"{args.num_seqs} sequences, {CPU_MIX.describe()}; micro-batch {args.micro_batch_size}; "
        f"median of {args.repeats} passes after 1 warm-up"
    )
    # Interleave the two modes pass by pass so background load on the shared machine hits both alike.
    times = {False: [], True: []}
    for mode, model in ((False, padded_model), (True, rmpad_model)):
        forward_backward(model, micro_batches, CPU_MIX.response_width, mode)  # warm-up
    for _ in range(args.repeats):
        for mode, model in ((False, padded_model), (True, rmpad_model)):
            times[mode].append(timed(lambda: forward_backward(model, micro_batches, CPU_MIX.response_width, mode)))
    padded_s, rmpad_s = median(times[False]), median(times[True])
    rows = [
        ["padded", f"{padded_s:.2f}", f"{real / padded_s:.0f}", "1.00"],
        ["remove-padding", f"{rmpad_s:.2f}", f"{real / rmpad_s:.0f}", f"{padded_s / rmpad_s:.2f}"],
    ]
    print()
    print_table(["mode", "s/pass", "real tokens/s", "speedup"], rows)
    print(f"\nreal tokens {real}, padded tokens {padded}: padded/real = {padded / real:.2f} (the speedup ceiling)")


if __name__ == "__main__":
    main()
