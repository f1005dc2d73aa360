"""A worker killed by Ray's memory monitor is reported as such, naming its rank, its role's class and the call.

Ray reports the kill as `ray.exceptions.OutOfMemoryError` for the calls the worker was running, and in the death
cause of an `ActorDiedError` for calls sent to it afterwards; both become `WorkerOutOfMemoryError`, a
`WorkerDiedError` (so `trainer.max_restarts` restarts after it, as after any lost worker). Before, the
`OutOfMemoryError` left `wait_all` untranslated: no rank, no role, and no restart. Ray is not started: its `get`
and `wait` are replaced by what they return in that case (a real kill needs a node near its memory limit).
"""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import OutOfMemoryError, RayActorError

from rlframe.single_controller import WorkerDiedError, WorkerOutOfMemoryError
from rlframe.single_controller.ray.wait import wait_all
from rlframe.trainer.main_ppo import lost_worker

# ray 2.60's report of a memory-monitor kill, as the raylet words it
RAY_REPORT = (
    "Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.2, ID: 6f1c) where the "
    "task (actor ID: 9a1b, name=ColocatedWorker.__init__, pid=4242, memory used=6.10GB) was running was 22.9GB / "
    "24.0GB (0.954), which exceeds the memory usage threshold of 0.95. Ray killed this worker (ID: 77e0) because it "
    "was the most recently scheduled task. To adjust the kill threshold, set the environment variable "
    "`RAY_memory_usage_threshold` when starting Ray."
)
METHOD = "ActorRolloutRefWorker.generate_sequences"


def call_where_rank_1_fails_with(monkeypatch, error: Exception):
    """wait_all over two ranks whose rank 1 raises `error` from ray.get (rank 0 answers)."""

    def get(ref, timeout=None):
        if ref == "rank1":
            raise error
        return "answer"

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (refs[::-1][:num_returns], []))
    monkeypatch.setattr(ray, "get", get)
    return wait_all(["rank0", "rank1"], [0, 1], METHOD, timeout_s=None)


@pytest.mark.parametrize(
    "error",
    [
        OutOfMemoryError(RAY_REPORT),
        RayActorError(error_msg=f"The actor died unexpectedly before finishing this task.\n{RAY_REPORT}"),
    ],
    ids=["OutOfMemoryError", "ActorDiedError with the kill as its cause"],
)
def test_a_worker_killed_by_the_memory_monitor_is_reported_as_such_with_its_rank_and_role(monkeypatch, error):
    with pytest.raises(WorkerOutOfMemoryError) as info:
        call_where_rank_1_fails_with(monkeypatch, error)
    message = str(info.value)
    assert message.startswith(
        "worker rank 1 was killed by Ray's memory monitor during ActorRolloutRefWorker.generate_sequences: its node "
        "ran low on memory"
    )
    assert "actor_rollout_ref.rollout.max_num_seqs" in message and "RAY_memory_usage_threshold" in message
    assert "22.9GB / 24.0GB (0.954)" in message  # Ray's own numbers come along
    assert (info.value.rank, info.value.method) == (1, METHOD)
    assert lost_worker(info.value) is info.value  # a lost worker: trainer.max_restarts restarts the run


def test_a_worker_that_died_otherwise_is_not_called_a_memory_kill(monkeypatch):
    crash = RayActorError(error_msg="The actor died unexpectedly before finishing this task.\n\tpid: 4242\nSIGSEGV")
    with pytest.raises(WorkerDiedError) as info:
        call_where_rank_1_fails_with(monkeypatch, crash)
    assert type(info.value) is WorkerDiedError
    assert str(info.value).startswith(f"worker rank 1 died during {METHOD}: The actor died unexpectedly")
