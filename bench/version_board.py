"""What watching the VersionBoard costs while a replica decodes (partial rollout's cut, `versioned_rollout.py`).

    python bench/version_board.py                 # 2 replicas, 10 s of 5 ms decoding steps each
    python bench/version_board.py --replicas 4 --seconds 20 --step-ms 2

A stand-in replica (a Ray actor) runs decoding steps of `--step-ms` of busy work and asks, after each step, whether
newer weights were announced, as the HF and vLLM engines ask `interrupt`. Two ways to know:

- `poll`: the earlier way, kept here as the baseline: a call to the board at most every 20 ms from the decoding
  thread (`ray.get(board.announced.remote())`);
- `listen`: rlframe's `VersionedRollout.watch`: one call held on the board by a thread of the replica
  (`newer_than`), answered when a version is announced; the decoding thread reads a local value.

The driver announces a new version every `--push-every` seconds. Reported per way: the decoding steps done (more is
better: the watch steals less of the cores), the CPU seconds the board actor and the replicas spent, and how long
after an announcement the replicas saw it (median and worst). The ratio row is listen / poll, from the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import ray

from rlframe.workers.versioned_rollout import VersionBoard

POLL_S = 0.02  # the earlier polling interval (BOARD_POLL_S)


class PollingBoard(VersionBoard):
    def announced(self) -> int:
        return self.version


@ray.remote(num_cpus=0)
class Replica:
    def __init__(self, board, way: str):
        self.board, self.way, self.announced, self.asked_at = board, way, 0, 0.0
        self.seen: dict[int, float] = {}  # version -> when this replica first knew of it
        if way == "listen":
            threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        try:
            while True:
                self.announced = ray.get(self.board.newer_than.remote(self.announced))
        except ray.exceptions.RayActorError:  # the board was killed: this way's run is over
            return

    def _moved_on(self) -> int:
        if self.way == "poll" and time.monotonic() - self.asked_at >= POLL_S:
            self.announced, self.asked_at = ray.get(self.board.announced.remote()), time.monotonic()
        return self.announced

    def decode(self, seconds: float, step_s: float) -> dict:
        start_cpu, end, steps = time.process_time(), time.time() + seconds, 0
        while time.time() < end:
            busy = time.perf_counter() + step_s
            while time.perf_counter() < busy:  # the decoding step's work
                pass
            version = self._moved_on()
            self.seen.setdefault(version, time.time())
            steps += 1
        return {"steps": steps, "cpu_s": time.process_time() - start_cpu, "seen": self.seen}

    def pid(self) -> int:
        return os.getpid()


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(way: str, args) -> dict:
    board = ray.remote(num_cpus=0)(PollingBoard).remote()
    board_pid = ray.get(board.__ray_call__.remote(lambda self: os.getpid()))
    replicas = [Replica.remote(board, way) for _ in range(args.replicas)]
    ray.get([r.pid.remote() for r in replicas])
    board_cpu = process_cpu_s(board_pid)
    calls = [r.decode.remote(args.seconds, args.step_ms / 1000) for r in replicas]
    announced_at, version, start = {}, 0, time.time()
    while time.time() - start < args.seconds - args.push_every:
        time.sleep(args.push_every)
        version += 1
        announced_at[version] = time.time()
        board.announce.remote(version)
    results = ray.get(calls)
    board_cpu = process_cpu_s(board_pid) - board_cpu
    lags = [r["seen"][v] - t for r in results for v, t in announced_at.items() if v in r["seen"]]
    for actor in [board, *replicas]:
        ray.kill(actor)
    return {
        "steps": sum(r["steps"] for r in results),
        "board_cpu_s": board_cpu,
        "replica_cpu_s": sum(r["cpu_s"] for r in results),
        "lag_ms_median": 1000 * statistics.median(lags) if lags else float("nan"),
        "lag_ms_max": 1000 * max(lags) if lags else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--push-every", type=float, default=1.0)
    args = parser.parse_args()
    ray.init(num_cpus=args.replicas + 1, include_dashboard=False, logging_level="ERROR")
    out = {way: run(way, args) for way in ("poll", "listen")}
    keys = ["steps", "board_cpu_s", "replica_cpu_s", "lag_ms_median", "lag_ms_max"]
    print(f"{'way':8}" + "".join(f"{k:>16}" for k in keys))
    for way, row in out.items():
        print(f"{way:8}" + "".join(f"{row[k]:>16.2f}" for k in keys))
    ratio = {k: out["listen"][k] / out["poll"][k] if out["poll"][k] else float("nan") for k in keys}
    print(f"{'ratio':8}" + "".join(f"{ratio[k]:>16.2f}" for k in keys))
    ray.shutdown()


if __name__ == "__main__":
    main()
