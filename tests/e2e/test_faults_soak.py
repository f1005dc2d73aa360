"""A 500-step CPU soak: driver and worker memory stay flat and the Ray object store does not grow.

The run is the real trainer (Ray, 2 CPU workers, GRPO on builtin://tiny), in a fresh interpreter of its own
(`soak`, this file run as a script) that samples each step right after it ends: the resident set size of the
driver and of each worker process (/proc/<pid>/status), and the object store's live objects and bytes.

"Flat" (memory): warm-up (allocator pools, lazily built caches) is over by step ~200 on this run,
so the growth is measured between the medians of steps 201-300 and 401-500 (medians, because
glibc hands freed memory back in 256 KiB chunks and single samples jump by that much). The limit,
16 KiB per step, is under a worker's share of one step's batch (checked below): a run that kept each
step's batch on the driver, or its share on a worker, fails. At the limit a 100,000-step run would grow by
1.6 GB; the measured growth is in docs/reliability.md.

"No growth" (object store): everything a step puts in the store is released once the step's calls
return; Ray deletes freed objects asynchronously, so a sample taken right after a step can still
count a few. At steps 100, 300 and 500 the test waits for the store to drain back to what it held
before training (polling; the deletion takes milliseconds).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow

NUM_STEPS = 500
MAX_GROWTH_PER_STEP = 16 * 1024  # bytes; see the module docstring
DRAIN_CHECKS = (100, 300, 500)

OVERRIDES = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.model.path=builtin://tiny",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.model.use_remove_padding=true",
    "data.max_prompt_length=128",  # prompts are left-padded to it: a step's batch is ~55 KiB (see below)
    "data.max_response_length=8",
    "data.filter_overlong_prompts=true",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "trainer.n_gpus_per_node=2",
    "trainer.device=cpu",
    f"trainer.total_training_steps={NUM_STEPS}",
    "trainer.total_epochs=1000",  # the built-in task has fewer prompts than 500 steps take
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.logger=[jsonl]",
]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def object_store_stats() -> tuple[int, int]:
    """(live objects, bytes used) of this node's object store, as `ray memory --stats-only` reads them.

    Ray's public state API needs the dashboard, which rlframe does not start.
    """
    from ray._private.internal_api import get_memory_info_reply

    stats = get_memory_info_reply(_cluster_state()).store_stats
    return stats.num_local_objects, stats.object_store_bytes_used


@functools.cache
def _cluster_state():
    import ray
    from ray._private.internal_api import get_state_from_address

    return get_state_from_address(ray.get_runtime_context().gcs_address)


def wait_for_store(num_objects: int, timeout_s: float = 60.0) -> tuple[int, int]:
    """Poll until the store holds at most `num_objects` objects (or the timeout); the last stats."""
    deadline = time.monotonic() + timeout_s
    stats = object_store_stats()
    while stats[0] > num_objects and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = object_store_stats()
    return stats


def growth_per_step(samples: dict[int, int], early: range, late: range) -> float:
    """Bytes per step between the medians of two windows of steps."""
    distance = statistics.median(late) - statistics.median(early)
    return (statistics.median(samples[s] for s in late) - statistics.median(samples[s] for s in early)) / distance


def soak(out_path: str) -> None:
    """The sampled 500-step run (in a fresh interpreter: see the test); writes the samples to `out_path` (JSON)."""
    import json

    import ray

    from rlframe.trainer.launch import create_worker_groups
    from rlframe.trainer.main_ppo import prepare
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    run = prepare([*OVERRIDES, f"trainer.default_local_dir={os.environ['RLFRAME_CACHE']}/soak_run"])
    assert not ray.is_initialized()
    groups = create_worker_groups(run.cfg, run.plan, run.schedule_steps)
    try:
        children = psutil.Process().children(recursive=True)
        workers = [p.pid for p in children if p.cmdline()[:1] == ["ray::ColocatedWorker"]]
        assert len(workers) == 2, workers
        store_before = wait_for_store(0, timeout_s=5.0)
        rss: dict[str, dict[int, int]] = {"driver": {}, **{f"worker pid {pid}": {} for pid in workers}}
        store: dict[int, tuple[int, int]] = {}
        batch_bytes = []

        class SampledTrainer(RayPPOTrainer):
            def _train_step(self, batch, *args):
                metrics = super()._train_step(batch, *args)
                step = self.global_step
                rss["driver"][step] = rss_bytes(psutil.Process().pid)
                for pid in workers:
                    rss[f"worker pid {pid}"][step] = rss_bytes(pid)
                batch_bytes.append(sum(t.nbytes for t in batch.batch.values()))
                store[step] = wait_for_store(store_before[0]) if step in DRAIN_CHECKS else object_store_stats()
                return metrics

        SampledTrainer(run, groups).fit()
    finally:
        groups.shutdown()
    samples = {"rss": rss, "store": store, "store_before": store_before, "batch_bytes": batch_bytes}
    with open(out_path, "w") as f:
        json.dump(samples, f)


def test_500_steps_keep_driver_and_worker_memory_flat_and_the_object_store_empty(cache_dir, tmp_path):
    """The run goes in a fresh interpreter, which is the driver measured: in this one (pytest, after every earlier
    test of the suite) what earlier tests left running would count as the driver's growth (CI once saw 25 KiB/step
    for pytest's process where the driver alone grows ~2 KiB/step)."""
    import json
    import subprocess

    out_path = tmp_path / "samples.json"
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests_dir)
    env = {
        **os.environ,
        "RLFRAME_CACHE": str(cache_dir),
        "RAY_memory_monitor_refresh_ms": "0",  # other tests' memory must not kill these workers
        "PYTHONPATH": os.pathsep.join([root, tests_dir, os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run([sys.executable, __file__, str(out_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    samples = json.loads(out_path.read_text())
    rss = {name: {int(step): value for step, value in by_step.items()} for name, by_step in samples["rss"].items()}
    store = {int(step): tuple(value) for step, value in samples["store"].items()}
    store_before, batch_bytes = tuple(samples["store_before"]), samples["batch_bytes"]
    workers = [name for name in rss if name != "driver"]

    assert sorted(rss["driver"]) == list(range(1, NUM_STEPS + 1))
    # a driver that kept each step's batch, or a worker that kept its share of it, would fail
    assert min(batch_bytes) / len(workers) > MAX_GROWTH_PER_STEP, batch_bytes[:3]
    early, late = range(201, 301), range(401, 501)
    growth = {name: growth_per_step(samples, early, late) for name, samples in rss.items()}
    print("RSS growth per step (bytes), steps 201-300 -> 401-500:", {k: round(v) for k, v in growth.items()})
    print("RSS at steps 1/250/500 (MiB):", {k: [round(v[s] / 2**20, 1) for s in (1, 250, 500)] for k, v in rss.items()})
    print(f"object store before training {store_before}, after steps {DRAIN_CHECKS}:", [store[s] for s in DRAIN_CHECKS])
    print("one step's batch (bytes):", min(batch_bytes))
    print("object store peak while stepping (objects, bytes):", max(store.values()))
    for name, bytes_per_step in growth.items():
        assert bytes_per_step < MAX_GROWTH_PER_STEP, (name, bytes_per_step)
    for step in DRAIN_CHECKS:  # (objects, bytes): nothing left over from the steps
        assert store[step][0] <= store_before[0] and store[step][1] <= store_before[1], (step, store[step])


if __name__ == "__main__":
    soak(sys.argv[1])
