"""Dispatch overhead: round-trip of a DP_COMPUTE_PROTO no-op over CPU Ray workers.

    python bench/dispatch.py                      # 1k, 8k, 32k sequences x 1024 tokens, 4 workers
    python bench/dispatch.py --sizes 1024 --torch-pickle

Each batch holds int64 `input_ids` and `attention_mask` (16 bytes per token). Two methods:
`noop` returns one int per sample (one-way traffic), `echo` returns its shard (both ways).
Reported per call: wall time split into dispatch (pad/split/pack/put/submit), worker wait,
collect (get/unpack/concat); MB/s of payload moved; and the share of the wall time spent
pickling (the in-band pickle of everything that crosses the object store, both directions;
tensors themselves travel out-of-band). `--torch-pickle` also times the same call with the
inputs pickled the plain way (torch.save per tensor), for comparison.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch

from rlframe.protocol import DataProto
from rlframe.single_controller import Dispatch, Worker, register
from rlframe.single_controller.transport import pack


class NoopWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def noop(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"ok": torch.ones(len(data), dtype=torch.int64)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data


def make_batch(num_seqs: int, seq_len: int) -> DataProto:
    return DataProto.from_dict(
        {
            "input_ids": torch.randint(0, 32000, (num_seqs, seq_len)),
            "attention_mask": torch.ones(num_seqs, seq_len, dtype=torch.int64),
        }
    )


def pickle_seconds(data: DataProto, parts: int, packed: bool = True) -> float:
    """Time to pickle `data`'s `parts` shards as they cross the object store (shards made beforehand)."""
    shards = data.chunk(parts)
    start = time.perf_counter()
    for shard in shards:
        if packed:  # what the library sends: tensors as out-of-band buffers, the rest in-band
            pickle.dumps(pack(shard), protocol=5, buffer_callback=lambda buffer: None)
        else:
            pickle.dumps(shard, protocol=5)
    return time.perf_counter() - start


def time_call(method, data: DataProto) -> dict:
    """One blocking call, split where the group starts waiting for the workers and they have all answered."""
    import ray

    import rlframe.single_controller.ray.base as ray_base

    marks = {}
    library_wait_all = ray_base.wait_all

    def timed_wait_all(refs, *args, **kwargs):
        marks["dispatched"] = time.perf_counter()
        ray.wait(refs, num_returns=len(refs), fetch_local=False)
        marks["answered"] = time.perf_counter()
        return library_wait_all(refs, *args, **kwargs)

    ray_base.wait_all = timed_wait_all
    try:
        start = time.perf_counter()
        out = method(data)
        done = time.perf_counter()
    finally:
        ray_base.wait_all = library_wait_all
    assert len(out) == len(data)
    dispatched, answered = marks["dispatched"], marks["answered"]
    return {
        "wall": done - start,
        "dispatch": dispatched - start,
        "wait": answered - dispatched,
        "collect": done - answered,
    }


def run(sizes: list[int], seq_len: int, num_workers: int, repeats: int, torch_pickle: bool) -> None:
    import ray

    import rlframe.single_controller.ray.base as ray_base
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, init_ray

    init_ray(num_cpus=num_workers, include_dashboard=False)
    pool = RayResourcePool([num_workers], num_cpus_per_process=1.0)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NoopWorker))
    library_pack = ray_base.pack_value
    # Baseline: shards copied out (as DataProto.chunk does) and pickled through torch.save.
    torch_pack = lambda value: value.select(deepcopy=True) if isinstance(value, DataProto) else value  # noqa: E731
    print(
        f"{num_workers} CPU workers, {seq_len} tokens/seq, int64 input_ids + attention_mask, "
        f"median of {repeats} calls (after one warm-up)\n"
    )
    print("| call | seqs | MB moved | wall s | dispatch s | wait s | collect s | MB/s | pickling |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for num_seqs in sizes:
            data = make_batch(num_seqs, seq_len)
            megabytes = 16 * num_seqs * seq_len / 1e6
            rows = [("noop", wg.noop, megabytes, library_pack), ("echo", wg.echo, 2 * megabytes, library_pack)]
            if torch_pickle:
                rows.append(("noop, torch pickle", wg.noop, megabytes, torch_pack))
            for name, method, moved, packer in rows:
                ray_base.pack_value = packer
                try:
                    time_call(method, make_batch(min(num_seqs, 64), seq_len))  # warm-up
                    timings = [time_call(method, data) for _ in range(repeats)]
                finally:
                    ray_base.pack_value = library_pack
                med = {k: statistics.median(t[k] for t in timings) for k in timings[0]}
                pickled = pickle_seconds(data, num_workers, packed=packer is library_pack)
                if name == "echo":
                    pickled *= 2  # the shards come back the same way
                print(
                    f"| {name} | {num_seqs} | {moved:.0f} | {med['wall']:.3f} | {med['dispatch']:.3f} | "
                    f"{med['wait']:.3f} | {med['collect']:.3f} | {moved / med['wall']:.0f} | "
                    f"{100 * pickled / med['wall']:.1f}% |",
                    flush=True,
                )
            del data
    finally:
        wg.shutdown()
        pool.remove()
        ray.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-pickle", action="store_true", help="also time inputs pickled via torch.save")
    args = parser.parse_args()
    run(args.sizes, args.seq_len, args.workers, args.repeats, args.torch_pickle)
