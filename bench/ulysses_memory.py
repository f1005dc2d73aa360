"""Ulysses sequence parallelism: peak activation memory per worker for one long sequence, sp = 1, 2, 4.

    python bench/ulysses_memory.py            # one 4096-token sequence, sp 1 2 4 (~1.5 min on 2 cores)
    python bench/ulysses_memory.py --quick    # 2048 tokens

For each sp, `sp` gloo processes (dp = 1, the whole world is the SP group) run `forward_micro_batch`
with remove-padding on one packed sequence and a backward of its log-probs' sum. Each worker
reports two numbers:

- peak RSS growth during forward+backward: `/proc/self/status` VmHWM after the step minus VmRSS
  before it, with the high-water mark reset (`/proc/self/clear_refs` = 5) right before the step.
  `MALLOC_MMAP_THRESHOLD_` is pinned so freed tensors go back to the OS and RSS follows live
  memory (glibc would otherwise raise the threshold and keep freed blocks in its heap).
  Gradient buffers exist before the step (a warm-up step filled them), so this is activations and
  temporaries: the part Ulysses divides.
- bytes saved for backward (a `saved_tensors_hooks` count of distinct storages, parameters
  excluded): deterministic, independent of the allocator and of other load on the machine.

Weights, gradients and optimizer state are not sharded here (no FSDP) and do not change with sp;
in a real run FSDP over the dp x sp mesh divides them as well. Times are printed for completeness
only: sp = 4 on 2 cores oversubscribes them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from _common import add_thread_flag, free_port, median, print_table, timed, tiny_causal_lm

MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=512, intermediate_size=768)
PROMPT_LEN = 64


def read_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class SavedTensorBytes:
    """Counts the distinct non-parameter storages autograd saves for backward."""

    def __init__(self, model: torch.nn.Module):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        return tensor


def make_sequence(num_tokens: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """One unpadded sequence: a prompt of PROMPT_LEN tokens and a response filling the rest."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (1, num_tokens), generator=gen)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(num_tokens)[None],
        "responses": ids[:, PROMPT_LEN:],
    }


def _worker(rank: int, world: int, port: int, num_tokens: int, threads: int, out_dir: str) -> None:
    from rlframe.workers.model_forward import LOG_PROBS, PackedLayout, forward_micro_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD if world > 1 else None
        model = tiny_causal_lm(**MODEL, use_remove_padding=True)

        def step(micro, counter=None):
            pack = counter.pack if counter is not None else (lambda t: t)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward_micro_batch(model, micro, micro["responses"].shape[-1], LOG_PROBS, PackedLayout(group))
            out["log_probs"].sum().backward()

        step(make_sequence(4 * PROMPT_LEN, MODEL["vocab_size"]))  # warm-up; allocates the gradient buffers
        model.zero_grad(set_to_none=False)
        micro = make_sequence(num_tokens, MODEL["vocab_size"])
        counter = SavedTensorBytes(model)
        dist.barrier()
        rss_before = read_status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        seconds = timed(lambda: step(micro, counter))
        peak_growth = read_status_kib("VmHWM") - rss_before
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(
                {"peak_growth_mib": peak_growth / 1024, "saved_mib": counter.bytes / 2**20, "seconds": seconds}, f
            )
    finally:
        dist.destroy_process_group()


def run_sp(sp: int, num_tokens: int, threads: int) -> list[dict]:
    """Spawn `sp` workers; return each rank's measurements."""
    with tempfile.TemporaryDirectory() as out_dir:
        torch.multiprocessing.spawn(_worker, args=(sp, free_port(), num_tokens, threads, out_dir), nprocs=sp, join=True)
        results = []
        for rank in range(sp):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2048-token sequence (a smoke run)")
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    add_thread_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_tokens = 2048
    # Fixed threshold: every tensor above 64 KiB is its own mmap, returned to the OS when freed.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned workers' C library at start

    print(
        f"Ulysses SP forward+backward of one {args.num_tokens}-token sequence (remove-padding), Qwen2 hidden "
        f"{MODEL['hidden_size']}, {MODEL['num_layers']} layers, {MODEL['num_heads']} heads "
        f"({MODEL['num_kv_heads']} kv), vocab {MODEL['vocab_size']}; gloo, {args.threads} thread(s) per worker\n"
    )
    rows, base = [], None
    for sp in args.sp:
        results = run_sp(sp, args.num_tokens, args.threads)
        peak = max(r["peak_growth_mib"] for r in results)
        saved = max(r["saved_mib"] for r in results)
        base = base or (peak, saved)
        rows.append(
            [
                sp,
                args.num_tokens // sp,
                f"{peak:.0f}",
                f"{peak / base[0]:.2f}",
                f"{saved:.0f}",
                f"{saved / base[1]:.2f}",
                f"{median([r['seconds'] for r in results]):.1f}",
            ]
        )
    print_table(
        ["sp", "tokens/worker", "peak RSS growth MiB", "vs sp=1", "saved for bwd MiB", "vs sp=1", "step s"], rows
    )
    print("\n(max over the workers of each sp; 1/sp would be perfect scaling)")


if __name__ == "__main__":
    main()
