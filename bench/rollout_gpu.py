"""HF vs vLLM rollout throughput on one GPU for a Qwen2.5-0.5B-shaped model (random weights).

    python bench/rollout_gpu.py                              # batch 256, prompt 256, response 512
    python bench/rollout_gpu.py --engines vllm --batch 1024 --response-length 1024

Needs CUDA and the `gpu` extra (`pip install -e '.[gpu]'`). The model has Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocab 151936, tied embeddings) with random
weights and the tiny offline tokenizer, so nothing is downloaded. Random weights almost never emit
EOS, so responses run to the limit and both engines do the same amount of work. Reported: median
tokens/s over `--repeats` calls after a warm-up, plus the weight-sync time (update_weights of the
full state), the sleep/wake round trip for vLLM, and the attention kernel each engine ran (vLLM's
backend as its layers report it; the HF engine runs transformers' sdpa).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch

from rlframe.config.loader import load_config, resolved
from rlframe.workers.rollout import build_rollout

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def make_model(out_dir: str) -> str:
    """Random-init 0.5B-shaped Qwen2 plus the tiny tokenizer, saved like a real checkpoint."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlframe.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        **QWEN25_05B, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_prompts(batch: int, prompt_length: int, seed: int = 0):
    from rlframe.protocol import DataProto

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (batch, prompt_length), generator=gen)
    lengths = torch.randint(prompt_length // 2, prompt_length + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_length)[None, :] >= prompt_length - lengths[:, None]).long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids * mask, "attention_mask": mask, "position_ids": position_ids}, meta_info={"do_sample": True}
    )


def single_process_world() -> None:
    """vLLM's external launcher expects a torch.distributed env; here a world of one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        os.environ.setdefault(key, value)


def bench_engine(name: str, path: str, args) -> dict:
    from transformers import AutoTokenizer

    cfg = resolved(
        load_config(
            [
                f"data.max_prompt_length={args.prompt_length}",
                f"data.max_response_length={args.response_length}",
                f"actor_rollout_ref.rollout.micro_batch_size={args.hf_micro_batch_size}",
                f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
                "actor_rollout_ref.rollout.enforce_eager=" + str(args.enforce_eager).lower(),
            ]
        )
    )
    rollout = build_rollout(name, cfg.actor_rollout_ref.rollout, path, AutoTokenizer.from_pretrained(path), "cuda")
    prompts = make_prompts(args.batch, args.prompt_length)
    rollout.generate_sequences(make_prompts(8, args.prompt_length, seed=1))  # warm-up
    rates = []
    for repeat in range(args.repeats):
        torch.manual_seed(repeat)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts)
        torch.cuda.synchronize()
        rates.append(int(out.batch["response_mask"].sum()) / (time.perf_counter() - start))
    from safetensors.torch import load_file

    state = load_file(os.path.join(path, "model.safetensors"))
    start = time.perf_counter()
    rollout.release()
    rollout.resume()
    cycle_s = time.perf_counter() - start
    start = time.perf_counter()
    rollout.update_weights(state.items())
    torch.cuda.synchronize()
    sync_s = time.perf_counter() - start
    attention = rollout.attention_backends() if name == "vllm" else ["torch sdpa (transformers)"]
    if hasattr(rollout, "shutdown"):
        rollout.shutdown()
    del rollout
    torch.cuda.empty_cache()
    return {
        "engine": name,
        "attention": ", ".join(attention),
        "tokens_per_s": statistics.median(rates),
        "weight_sync_s": sync_s,
        "release_resume_s": cycle_s,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--hf-micro-batch-size", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="vLLM without CUDA graphs (the trainer default is eager)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/rollout_gpu.py needs a CUDA device; use bench/rollout.py on CPU")
    single_process_world()
    print(
        f"{torch.cuda.get_device_name()}: Qwen2.5-0.5B shape, bf16, batch {args.batch}, prompt "
        f"{args.prompt_length}, response {args.response_length}"
    )
    print(f"{'engine':>6} {'tokens/s':>10} {'weight sync s':>14} {'release+resume s':>17}  attention")
    with tempfile.TemporaryDirectory() as workdir:
        path = make_model(workdir)
        for name in args.engines:
            r = bench_engine(name, path, args)
            print(
                f"{r['engine']:>6} {r['tokens_per_s']:>10.0f} {r['weight_sync_s']:>14.2f} "
                f"{r['release_resume_s']:>17.2f}  {r['attention']}"
            )


if __name__ == "__main__":
    main()
