"""Packed attention on CPU: the per-sequence SDPA fallback against FlexAttention with a document mask.

    python bench/packed_attention_cpu.py                 # three row shapes, fp32, 1 thread, eager and compiled flex
    python bench/packed_attention_cpu.py --no-compile    # eager FlexAttention only
    python bench/packed_attention_cpu.py --quick         # the short row, one repeat (a smoke run)
    python bench/packed_attention_cpu.py --repeats 3 --threads 2

A packed row is 16 sequences on SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head dim 64), fp32.
Each repeat times the candidates back to back on the same row, so the ratio printed (flex time / SDPA time,
below 1 means FlexAttention is faster) is measured under the same machine load. FlexAttention's time includes
building the block mask, as a micro-batch with new lengths would. "exact" compares FlexAttention's output and
input gradients with the SDPA fallback's: the largest absolute difference, and whether they are bitwise equal
(the golden runs, tests/e2e/test_golden_run.py, pack their rows on CPU, so a CPU kernel that is not bitwise the
fallback changes their recorded numbers).
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import add_thread_flag, median, print_table, timed

from rlframe.distributed.attention import varlen_causal_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
ROWS = {  # name -> (min, max) sequence length of the 16 sequences in the row
    "short 32-128": (32, 128),
    "mixed 32-512": (32, 512),
    "long 256-512": (256, 512),
}
NUM_SEQS = 16


def make_row(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [T, heads, dim], k/v [T, kv_heads, dim], grad [T, heads, dim] and cu_seqlens of one packed row."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    grad = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, grad, cu


def sdpa_attention(q, k, v, cu):
    """rlframe's CPU path: torch SDPA one sequence at a time."""
    return varlen_causal_attention(q, k, v, cu, None, HEAD_DIM**-0.5)


def flex_attention_fn(compiled: bool):
    """FlexAttention over the whole row with a block-diagonal causal (document) mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    kernel = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def run(q, k, v, cu):
        total = q.shape[0]
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(document_causal, None, None, total, total, device="cpu")
        out = kernel(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=mask,
            scale=HEAD_DIM**-0.5,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    return run


def forward_only(fn, q, k, v, grad, cu):
    """Output of one forward without autograd (log-prob passes: old and reference log-probs)."""
    with torch.no_grad():
        return (fn(q, k, v, cu),)


def forward_backward(fn, q, k, v, grad, cu):
    """Output and q/k/v gradients of one forward+backward."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, cu)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def compare(reference: tuple, got: tuple) -> str:
    """Largest absolute difference over output and gradients, and whether all are bitwise equal."""
    diff = max(float((a - b).abs().max()) for a, b in zip(reference, got))
    bitwise = all(torch.equal(a, b) for a, b in zip(reference, got))
    return f"{diff:.1e}{' bitwise' if bitwise else ''}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short row only, one repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per candidate (median reported)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile'd FlexAttention")
    add_thread_flag(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows_measured = dict(list(ROWS.items())[:1]) if args.quick else ROWS
    if args.quick:
        args.repeats = 1

    print(
        f"torch {torch.__version__}, {args.threads} thread(s), fp32, {NUM_SEQS} sequences per row, "
        f"{HEADS} heads / {KV_HEADS} kv heads x {HEAD_DIM}; median of {args.repeats}\n"
    )
    rows = []
    for row_name, (low, high) in rows_measured.items():
        gen = torch.Generator().manual_seed(1)
        lengths = torch.randint(low, high + 1, (NUM_SEQS,), generator=gen).tolist()
        q, k, v, grad, cu = make_row(lengths)
        reference = forward_backward(sdpa_attention, q, k, v, grad, cu)
        torch._dynamo.reset()  # a fresh compile per row shape: dynamo's recompile limit would fall back to eager
        candidates = {"flex eager": flex_attention_fn(False)}
        if not args.no_compile:
            candidates["flex compiled"] = flex_attention_fn(True)
        for mode in ("forward", "forward+backward"):
            passes = {"forward": forward_only, "forward+backward": forward_backward}[mode]
            exact, first_call = {}, {}
            for name, fn in candidates.items():  # first call: compiles (timed apart), checked against SDPA
                start = time.perf_counter()
                try:
                    got = passes(fn, q, k, v, grad, cu)
                    exact[name] = compare(reference[: len(got)], got)
                except Exception as err:  # noqa: BLE001 - a candidate that cannot run is a result, not a crash
                    exact[name] = f"fails: {type(err).__name__}: {str(err).splitlines()[0][:60]}"
                first_call[name] = time.perf_counter() - start
            runnable = {n: fn for n, fn in candidates.items() if not exact[n].startswith("fails")}
            times = {"sdpa": [], **{n: [] for n in runnable}}
            for _ in range(args.repeats):
                for name, fn in (("sdpa", sdpa_attention), *runnable.items()):
                    times[name].append(timed(lambda fn=fn: passes(fn, q, k, v, grad, cu)))
            sdpa_s = median(times["sdpa"])
            for name in candidates:
                flex_s = median(times[name]) if name in runnable else None
                rows.append(
                    [
                        row_name,
                        sum(lengths),
                        mode,
                        f"{sdpa_s * 1e3:.1f}",
                        name,
                        "-" if flex_s is None else f"{flex_s * 1e3:.1f}",
                        "-" if flex_s is None else f"{flex_s / sdpa_s:.2f}",
                        f"{first_call[name]:.1f}",
                        exact[name],
                    ]
                )
    print_table(
        ["row", "tokens", "pass", "SDPA ms", "candidate", "cand. ms", "cand./SDPA", "1st call s", "vs SDPA (max abs)"],
        rows,
    )


if __name__ == "__main__":
    main()
