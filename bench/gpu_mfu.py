"""Actor forward+backward tokens/s and MFU on one GPU: a Qwen2.5-0.5B-shaped model with remove-padding.

    python bench/gpu_mfu.py                              # bf16, 64 sequences of the GPU bimodal mix
    python bench/gpu_mfu.py --quick                      # 16 sequences, 2 timed steps
    RLFRAME_PEAK_TFLOPS=400 python bench/gpu_mfu.py      # a device missing from PEAK_BF16_TFLOPS
    python bench/gpu_mfu.py --smoke                      # tiny model on CPU: checks the code path only

The model is random-init from a Qwen2Config with Qwen2.5-0.5B's shape (no download): hidden 896,
24 layers, 14 heads (2 kv), intermediate 4864, vocab 151936, tied embeddings. One step is what the
actor does per mini-batch minus the optimizer: dynamic micro-batches of at most `--max-token-len`
tokens, each packed into one row (`forward_micro_batch`, `rlframe_varlen` attention: flash-attn's
varlen kernel when installed, else torch's own `varlen_attn`, else torch SDPA per sequence; the
output names the one that ran) and a backward of its log-probs.
Lengths are the GPU mix of `bench/_common.py` (30% responses 800–2048 tokens, the rest 50–200).

MFU = model FLOPs per second / the device's dense bf16 peak, with model FLOPs counted as below
(recomputation from gradient checkpointing is not counted, by the usual MFU convention).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _common import CPU_MIX, GPU_MIX, make_rl_batch, median, padding_stats, print_table, sample_lengths, timed

from rlframe.batch_plan import ForwardPlan
from rlframe.utils.flops import PEAK_ENV, device_peak_tflops, matmul_params, train_flops
from rlframe.workers.batching import split_micro_batches
from rlframe.workers.model_forward import forward_micro_batch

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)
SMOKE = dict(
    QWEN25_05B,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
)


def attention_kernel(device: str, dtype: torch.dtype) -> str:
    """The packed-attention kernel that runs: the same decision `varlen_causal_attention` makes per call."""
    from rlframe.distributed.attention import SDPA_PER_SEQUENCE, varlen_kernel

    kernel = varlen_kernel(device, dtype)
    if device == "cuda" and kernel == SDPA_PER_SEQUENCE:
        kernel += " (neither flash-attn nor torch's varlen_attn runs here: attention is slower than it should be)"
    return kernel


def build_model(shape: dict, device: str, dtype: torch.dtype, gradient_checkpointing: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlframe.distributed.attention import register_varlen_attention

    config = Qwen2Config(**shape, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=register_varlen_attention())
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def timed_on(device: str, fn) -> float:
    """Seconds of one call of `fn`, measured with CUDA events on a GPU (queued work included)."""
    if device != "cuda":
        return timed(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 sequences, 2 timed steps")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model and CPU lengths, fp32 on CPU: runs the code path, measures nothing",
    )
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-token-len", type=int, default=16384, help="tokens per micro-batch (dynamic)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help=f"overrides the table and ${PEAK_ENV}")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    mix = GPU_MIX
    if args.quick:
        args.num_seqs, args.steps = 16, 2
    if args.smoke:
        device, dtype, shape, mix = "cpu", torch.float32, SMOKE, CPU_MIX
        args.num_seqs, args.steps = 8, 1
    elif torch.cuda.is_available():
        device, dtype, shape = "cuda", torch.bfloat16, QWEN25_05B
    else:
        sys.exit(
            "bench/gpu_mfu.py needs a CUDA GPU (none visible); nothing was measured. "
            "Use --smoke to check the code path on CPU."
        )

    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"
    model = build_model(shape, device, dtype, args.gradient_checkpointing)
    num_matmul = matmul_params(model)
    num_params = sum(p.numel() for p in model.parameters())

    prompt_lens, response_lens = sample_lengths(mix, args.num_seqs)
    data = make_rl_batch(prompt_lens, response_lens, mix.prompt_width, mix.response_width, shape["vocab_size"])
    real, padded = padding_stats(data)
    seqlens = data.batch["attention_mask"].sum(-1).tolist()
    batch = data.batch.select("input_ids", "attention_mask", "position_ids", "responses").to(device)
    cut = ForwardPlan(1, 1, len(batch), len(batch), True, None, None, args.max_token_len, args.max_token_len, "kk")
    micro_batches, _ = split_micro_batches(batch, cut)
    flops = train_flops(num_matmul, shape["num_hidden_layers"], shape["hidden_size"], seqlens)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for micro in micro_batches:
            out = forward_micro_batch(model, micro, mix.response_width)
            (out["log_probs"].sum() / real).backward()

    step()  # warm-up: kernels, allocator
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [timed_on(device, step) for _ in range(args.steps)]
    step_s = median(times)

    peak, peak_source = device_peak_tflops(device_name, args.peak_tflops)
    achieved = flops / step_s / 1e12
    attn_share = 1 - 6.0 * num_matmul * real / flops
    print(
        f"{device_name}: {num_params / 1e6:.1f}M params ({num_matmul / 1e6:.1f}M in matmuls), {dtype}, "
        f"attention: {attention_kernel(device, dtype)}"
        f"{', gradient checkpointing' if args.gradient_checkpointing else ''}"
    )
    print(
        f"{args.num_seqs} sequences, {mix.describe()}: {real} real tokens ({padded / real:.2f}x padded), "
        f"{len(micro_batches)} micro-batches of <= {args.max_token_len} tokens; median of {args.steps} steps\n"
    )
    rows = [
        ["step s", f"{step_s:.3f}"],
        ["tokens/s", f"{real / step_s:,.0f}"],
        ["model TFLOPs/step", f"{flops / 1e12:.1f} (attention {attn_share:.0%})"],
        ["achieved TFLOP/s", f"{achieved:.1f}"],
        ["peak bf16 TFLOP/s", f"{peak:.0f} [{peak_source}]" if peak else peak_source],
        ["MFU", f"{achieved / peak:.1%}" if peak and device == "cuda" else "n/a"],
    ]
    if device == "cuda":
        rows.append(["peak memory GiB", f"{torch.cuda.max_memory_allocated() / 2**30:.1f}"])
    print_table(["metric", "value"], rows)
    if args.json:
        figures = {
            "device": device_name,
            "attention": attention_kernel(device, dtype),
            "step_s": step_s,
            "tokens_per_s": real / step_s,
            "achieved_tflops": achieved,
            "mfu": achieved / peak if peak and device == "cuda" else None,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
