"""Ulysses collectives: rlframe's autograd all-to-all and gather against torch's differentiable ones.

    python bench/ulysses_collectives.py            # ~1 min on 2 cores
    python bench/ulysses_collectives.py --quick    # fewer rounds

Three implementations of the two collectives Ulysses needs, each run forward + backward:

- `rlframe`: `rlframe.distributed.ulysses` (`all_to_all`, `gather_outputs`): `dist.all_to_all_single`
  in an autograd function whose backward is the same all-to-all; the gather's backward is an
  all-to-all of the gradient chunks and a sum (a reduce-scatter that gloo can run).
- `nn.functional`: `torch.distributed.nn.functional.all_to_all_single` / `all_gather` (+ `cat`).
- `_functional_collectives`: `torch.distributed._functional_collectives.all_to_all_single_autograd`
  / `all_gather_single_autograd`, where torch's deprecation warnings point.

Part 1 (4 gloo processes, SP groups {0, 1} and {2, 3} as a dp=2 x sp=2 mesh makes them): does each
implementation run on both SP groups, do its outputs and gradients equal rlframe's bit for bit,
and does it warn. Part 2 (2 gloo processes, the whole world is the SP group): time per
forward+backward of each (median and minimum over rounds), as a ratio to rlframe's measured in the
same run. Blocks of iterations alternate between implementations round by round, so machine load
hits all of them alike.

Sizes: the all-to-all moves one of q/k/v of a 4096-token row with 16 heads of dim 64 (fp32, 8 MiB
per rank); the gather collects one fp32 score per token of that row.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from _common import free_port, median, print_table

SEQ, HEADS, HEAD_DIM = 4096, 16, 64


def _rlframe_ops():
    from rlframe.distributed.ulysses import all_to_all, gather_outputs

    return all_to_all, lambda x, group: gather_outputs(x, group, dim=0)


def _nn_functional_ops():
    import torch.distributed.nn.functional as dnf

    def a2a(x, group):
        x = x.contiguous()
        return dnf.all_to_all_single(torch.empty_like(x), x, group=group)

    return a2a, lambda x, group: torch.cat(dnf.all_gather(x, group=group), dim=0)


def _functional_collectives_ops():
    import torch.distributed._functional_collectives as fc

    def a2a(x, group):
        return fc.all_to_all_single_autograd(x.contiguous(), None, None, group).wait()

    # recent torch renamed all_gather_tensor_autograd to all_gather_single_autograd (2.13: old name deprecated)
    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return a2a, lambda x, group: gather(x, 0, group).wait()


IMPLEMENTATIONS = {
    "rlframe": _rlframe_ops,
    "nn.functional": _nn_functional_ops,
    "_functional_collectives": _functional_collectives_ops,
}


def _inputs(rank: int, sp: int, seed: int = 0):
    """This rank's q-like shard laid out for the all-to-all, per-token scores, and upstream gradients."""
    gen = torch.Generator().manual_seed(seed + rank)
    seq_local = SEQ // sp
    shard = torch.randn(seq_local, HEADS, HEAD_DIM, generator=gen)
    # the layout seq_to_head_shard hands to the all-to-all: a transposed (non-contiguous) view
    a2a_in = shard.reshape(seq_local, sp, HEADS // sp, HEAD_DIM).transpose(0, 1)
    a2a_up = torch.randn(sp, seq_local, HEADS // sp, HEAD_DIM, generator=gen)
    tokens = torch.randn(seq_local, generator=gen)
    gather_up = torch.randn(SEQ, generator=gen)  # differs per rank: each rank's loss weights differ
    return a2a_in, a2a_up, tokens, gather_up


def _step_all_to_all(ops, group, a2a_in, a2a_up, tokens, gather_up):
    """Forward + backward of the all-to-all; returns (output, input gradient)."""
    x = a2a_in.detach().requires_grad_()
    y = ops[0](x, group)
    (y * a2a_up).sum().backward()
    return y.detach(), x.grad


def _step_gather(ops, group, a2a_in, a2a_up, tokens, gather_up):
    """Forward + backward of the gather; returns (gathered, input gradient)."""
    t = tokens.detach().requires_grad_()
    g = ops[1](t, group)
    (g * gather_up).sum().backward()
    return g.detach(), t.grad


STEPS = {"all-to-all": _step_all_to_all, "gather": _step_gather}


def _check_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Part 1: run every implementation on this rank's SP group and compare with rlframe's."""
    _init(rank, world, port)
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        group = groups[rank // 2]
        inputs = _inputs(rank, sp=2)
        lines = []
        for name, make_ops in list(IMPLEMENTATIONS.items())[1:]:
            for step_name, step in STEPS.items():
                lines.append(
                    f"rank {rank} (SP group {rank // 2}) {name} {step_name}: "
                    f"{_compare(step, make_ops(), _rlframe_ops(), group, inputs)}"
                )
        with open(os.path.join(out_dir, f"check{rank}.txt"), "w") as f:
            f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


def _compare(step, ops, reference_ops, group, inputs) -> str:
    """Run `step` with `ops` and with rlframe's; say whether outputs and gradients agree, and what warned."""
    reference = step(reference_ops, group, *inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = step(ops, group, *inputs)
            diff = max(float((a - b).abs().max()) for a, b in zip(got, reference))
            verdict = "output and gradient bitwise equal" if diff == 0 else f"max abs diff {diff:.3g}"
        except (RuntimeError, ValueError) as e:  # which implementation fails, and why, is the result
            verdict = f"FAILS: {type(e).__name__}: {str(e).split(chr(10))[0][:60]}"
    if any("deprecated" in str(w.message) for w in caught):
        verdict += "; warns: deprecated"
    return verdict


def _time_worker(rank: int, world: int, port: int, rounds: int, iters: int, out_dir: str) -> None:
    """Part 2: seconds per forward+backward of each implementation, `rounds` blocks of `iters` each."""
    _init(rank, world, port)
    warnings.simplefilter("ignore", FutureWarning)  # nn.functional warns on every call; timed without it
    try:
        group = dist.group.WORLD
        inputs = _inputs(rank, sp=world)
        ops = {name: make() for name, make in IMPLEMENTATIONS.items()}
        times = {(step_name, name): [] for step_name in STEPS for name in ops}
        for step_name, name in times:  # warm-up
            STEPS[step_name](ops[name], group, *inputs)
        keys = list(times)
        for r in range(rounds):
            for step_name, name in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotate who goes first
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    STEPS[step_name](ops[name], group, *inputs)
                dist.barrier()
                times[step_name, name].append((time.perf_counter() - start) / iters)
        if rank == 0:
            torch.save(times, os.path.join(out_dir, "times.pt"))
    finally:
        dist.destroy_process_group()


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 5 iterations")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.iters = 3, 5
    print(f"torch {torch.__version__}, gloo, 1 thread per process\n")
    with tempfile.TemporaryDirectory() as out_dir:
        torch.multiprocessing.spawn(_check_worker, args=(4, free_port(), out_dir), nprocs=4, join=True)
        print("Part 1: 4 processes, SP groups {0,1} and {2,3}; forward + backward compared with rlframe's")
        for rank in range(4):
            with open(os.path.join(out_dir, f"check{rank}.txt")) as f:
                print(" ", f.read().replace("\n", "\n  "))

        torch.multiprocessing.spawn(
            _time_worker, args=(2, free_port(), args.rounds, args.iters, out_dir), nprocs=2, join=True
        )
        times = torch.load(os.path.join(out_dir, "times.pt"))
    print(
        f"\nPart 2: 2 processes (sp=2), forward + backward; median of {args.rounds} rounds x {args.iters} "
        f"iterations; all-to-all of [{SEQ // 2}, {HEADS}, {HEAD_DIM}] fp32 per rank, gather of {SEQ // 2} "
        f"fp32 scores per rank"
    )
    rows = []
    for (step_name, name), t in times.items():
        base = times[step_name, "rlframe"]
        rows.append(
            [
                step_name,
                name,
                f"{median(t) * 1e3:.3f}",
                f"{median(t) / median(base):.2f}",
                f"{min(t) * 1e3:.3f}",
                f"{min(t) / min(base):.2f}",
            ]
        )
    print_table(["collective", "implementation", "median ms", "vs rlframe", "min ms", "vs rlframe"], rows)
    print("\n(the minimum is the least disturbed by other load on the machine)")


if __name__ == "__main__":
    main()
