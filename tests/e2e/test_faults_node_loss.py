"""A whole node lost under a real 2-node run (Ray's `Cluster`: a head without CPUs, two 1-CPU nodes, a worker on each).

The driver (GRPO, builtin://tiny, `trainer.nnodes=2 trainer.n_gpus_per_node=1`, `trainer.max_restarts=1`,
`trainer.save_freq=1`) stops in the reward function of step 2, after step 1's checkpoint is complete, until the
test has removed the node that hosts worker rank 0 (its raylet and every process on it). Then:

- a replacement node joins only once the restart is waiting for one (`trainer.restart_node_wait_s`): the run
  restarts onto the surviving and the new node, resumes from step 1's checkpoint and finishes;
- no node joins, and the node died abruptly (its raylet and workers SIGKILLed, so Ray counts it alive until its
  health checks give up): the restart fails within a bounded time, naming the trainer keys and the nodes left.

Each worker records the node it runs on through `actor_rollout_ref.model.external_lib` (a module every worker
imports before loading its model), so the test sees where the recreated workers ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.runs import COMMON, read_metrics
from ray._private import ray_constants

from rlframe.utils.manifest import verify_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SAMPLES_PER_STEP = 8  # COMMON: 4 prompts × rollout.n=2

# Scores 0; at the first sample of step 2 it says so (gate/waiting) and waits for gate/released.
GATE_SCORER = """
import os, time
calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls[0] += 1
    gate = os.environ["NODE_LOSS_GATE"]
    if calls[0] == {first_of_step_2} and not os.path.exists(os.path.join(gate, "released")):
        open(os.path.join(gate, "waiting"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(gate, "released")) and time.monotonic() < deadline:
            time.sleep(0.05)
    return 0.0
"""

# Imported by every worker process before it loads its model: one file per process, naming its node and rank.
NODE_MARKER = """
import os, pathlib, ray
node = ray.get_runtime_context().get_node_id()
pathlib.Path(os.environ["NODE_LOSS_MARKERS"], f"{node}-{os.environ['RANK']}-{os.getpid()}").touch()
"""


@pytest.fixture
def two_worker_nodes(tmp_path, monkeypatch):
    """(cluster, {node id: node}, folder of the marker and scorer files); the nodes' processes get this environment."""
    from ray.cluster_utils import Cluster

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "node_loss_marker.py").write_text(NODE_MARKER)
    (lib / "gate_scorer.py").write_text(GATE_SCORER.replace("{first_of_step_2}", str(SAMPLES_PER_STEP + 1)))
    (tmp_path / "markers").mkdir()
    (tmp_path / "gate").mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{lib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # workers: the marker
    monkeypatch.setenv("NODE_LOSS_MARKERS", str(tmp_path / "markers"))
    # Ray's memory monitor off: on a shared test machine it would kill these workers for other processes' memory
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    # the head hosts Ray's control plane and the driver, never a worker, so it is never the node lost
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        yield cluster, {node.node_id: node for node in nodes}, tmp_path
    finally:
        cluster.shutdown()


def start_driver(cluster, folder: Path, cache_dir, *extra) -> tuple[subprocess.Popen, Path]:
    run_dir = folder / "run"
    overrides = [
        *COMMON,
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        "trainer.max_restarts=1",
        f"trainer.ray_init.address={cluster.address}",
        f"custom_reward_function.path={folder / 'lib' / 'gate_scorer.py'}",
        "actor_rollout_ref.model.external_lib=node_loss_marker",
        *extra,
    ]
    env = {**os.environ, "RLFRAME_CACHE": str(cache_dir), "RAY_DEDUP_LOGS": "0", "NODE_LOSS_GATE": str(folder / "gate")}
    with open(folder / "stdout.txt", "w") as stdout, open(folder / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlframe.trainer.main_ppo", *overrides], stdout=stdout, stderr=stderr, env=env
        )
    return proc, run_dir


def wait_for(condition, proc: subprocess.Popen, folder: Path, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{stderr_of(folder)[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout_s:g}s:\n{stderr_of(folder)[-4000:]}")
        time.sleep(0.1)


def stderr_of(folder: Path) -> str:
    return (folder / "stderr.txt").read_text()


def started_workers(folder: Path) -> set[tuple[int, str, int]]:
    """(rank, node id, pid) of every worker process started so far."""
    out = set()
    for marker in (folder / "markers").iterdir():
        node, rank, pid = marker.name.rsplit("-", 2)
        out.add((int(rank), node, int(pid)))
    return out


def lose_rank0_node_at_step_2(cluster, nodes: dict, folder: Path, proc, run_dir: Path, graceful: bool) -> set:
    """Wait for the run to stop in step 2's scoring, remove the node of worker rank 0, let the run go on.

    Returns the first attempt's workers, as `started_workers`."""
    wait_for(lambda: (folder / "gate" / "waiting").exists(), proc, folder, "step 2's scoring")
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1"]
    verify_manifest(str(run_dir / "global_step_1"))
    workers = started_workers(folder)
    first = {rank: node for rank, node, _pid in workers}
    assert len(workers) == 2 and set(first) == {0, 1}
    assert set(first.values()) == set(nodes)  # one worker on each node
    node = nodes[first[0]]
    if graceful:  # the raylet is stopped (SIGTERM) and tells Ray its node is gone; its workers die with it
        cluster.remove_node(node)
    else:  # as a machine that dies: the raylet and every process it started (the workers), SIGKILLed at once
        raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        doomed = [raylet, *raylet.children(recursive=True)]
        for process in doomed:
            process.kill()
        psutil.wait_procs(doomed, timeout=30)
        cluster.remove_node(node, allow_graceful=False)  # the node's other processes
    (folder / "gate" / "released").touch()
    return workers


def test_a_lost_node_is_replaced_and_the_run_resumes_on_the_new_node(two_worker_nodes, cache_dir):
    cluster, nodes, folder = two_worker_nodes
    proc, run_dir = start_driver(cluster, folder, cache_dir)
    try:
        first_workers = lose_rank0_node_at_step_2(cluster, nodes, folder, proc, run_dir, graceful=True)
        # the restart waits for the cluster to hold 2 workers again; only then does the replacement join
        wait_for(lambda: "Waiting up to 300s for nodes to join" in stderr_of(folder), proc, folder, "wait for nodes")
        replacement = cluster.add_node(num_cpus=1).node_id
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (folder / "stdout.txt").read_text() + stderr_of(folder)
    assert proc.returncode == 0, log[-4000:]
    first = {rank: node for rank, node, _pid in first_workers}
    assert re.search(r"worker rank 0 died during ActorRolloutRefWorker\.\w+", log)
    assert "The actor died because its node has died" in log
    resumed = run_dir / "global_step_1"
    assert f"restart 1 of trainer.max_restarts=1: recreating the workers and resuming from {resumed}" in log
    assert log.count(f"[rlframe] resuming from {resumed}") == 1  # the first attempt started fresh
    # what the restart saw while it waited: the head and the surviving node
    (waited,) = [line for line in log.splitlines() if "Waiting up to 300s for nodes to join" in line]
    assert "asks for 2 node(s) × [1, 1] processes with {'CPU': 1.0} each" in waited
    assert "the Ray cluster has 2 alive node(s)" in waited and "CPU=0 (room for 0 processes)" in waited
    assert f"(node {first[1][:8]}): CPU=1 (room for 1 processes)" in waited and first[0][:8] not in waited

    # the steps after the restart continue from the checkpoint's step: step 2 again, then 3
    metrics = [m for m in read_metrics(run_dir) if "training/num_restarts" in m]
    assert [(m["training/global_step"], m["training/num_restarts"]) for m in metrics] == [(1, 0), (2, 1), (3, 1)]
    for step in (1, 2, 3):
        verify_manifest(str(run_dir / f"global_step_{step}"))

    # the recreated workers ran on the surviving node and on the replacement, one each
    recreated = started_workers(folder) - first_workers
    assert len(recreated) == 2 and {rank for rank, _node, _pid in recreated} == {0, 1}
    assert {node for _rank, node, _pid in recreated} == {first[1], replacement}


def test_a_lost_node_not_replaced_fails_the_restart_in_bounded_time_naming_the_nodes_left(two_worker_nodes, cache_dir):
    cluster, nodes, folder = two_worker_nodes
    proc, run_dir = start_driver(cluster, folder, cache_dir, "trainer.restart_node_wait_s=5")
    try:
        # SIGKILL: Ray counts the node alive until its health checks give up (about 15 s), so the restart may place
        # one placement group on the survivor and leave the other pending on the dead node. (A raylet SIGKILLed
        # alone leaves its workers running for a while: the run then finished step 2 before noticing.)
        first_workers = lose_rank0_node_at_step_2(cluster, nodes, folder, proc, run_dir, graceful=False)
        lost_at = time.monotonic()
        proc.wait(timeout=300)
        failed_after = time.monotonic() - lost_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (folder / "stdout.txt").read_text() + stderr_of(folder)
    assert proc.returncode != 0
    first = {rank: node for rank, node, _pid in first_workers}
    print(f"the run exited {failed_after:.1f}s after the node was lost")
    assert failed_after < 90, f"the restart took {failed_after:.0f}s to fail"
    assert (
        f"restart 1 of trainer.max_restarts=1: recreating the workers and resuming from {run_dir / 'global_step_1'}"
        in log
    )
    (error,) = [line for line in log.splitlines() if line.startswith("rlframe.single_controller.ray.resource_pool.")]
    assert error.startswith(
        "rlframe.single_controller.ray.resource_pool.ClusterTooSmallError: the run needs trainer.nnodes=2 × "
        "trainer.n_gpus_per_node=1 worker processes (trainer.device=cpu), which the Ray cluster cannot hold "
        "(trainer.restart_node_wait_s=5): RayResourcePool(process_on_nodes=[1, 1]"
    ), error
    assert (
        "asks for 2 node(s) × [1, 1] processes with {'CPU': 1.0} each, but the Ray cluster has 2 alive node(s)" in error
    )
    assert f"(node {first[1][:8]}): CPU=1 (room for 1 processes)" in error and first[0][:8] not in error
    assert error.endswith("(waited 5s for nodes to join)"), error
    assert [m["training/global_step"] for m in read_metrics(run_dir) if "training/num_restarts" in m] == [1]
    assert started_workers(folder) == first_workers  # no worker was started after the loss
