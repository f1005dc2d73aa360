"""Profiling (global_profiler.*, each role's profiler.*): files appear for the configured steps and ranks only.

The worker side is driven directly (a role's Profiler, as a worker holds it); one real CPU run checks the
whole path: trainer -> start_profile/stop_profile on the workers -> a torch trace per profiled step and rank.
"""

import gzip
import json
import os
import subprocess
import sys

import pytest
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.trainer.config import compose, typed
from rlframe.trainer.profiling import StepProfiler, nsight_runtime_env
from rlframe.workers.profiler import Profiler, ProfileSession, profiled


def _config(tmp_path, *overrides):
    return OmegaConf.to_object(compose([*SMALL, f"global_profiler.save_path={tmp_path}", *overrides]))


def _files(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names)


def _run_step(profiler: Profiler, step: int, stages=("actor_update",)) -> None:
    profiler.start(step)
    for stage in stages:
        with profiler.stage(stage):
            sum(i * i for i in range(1000))
    profiler.stop()


def test_torch_trace_per_profiled_step_on_the_chosen_ranks_only(tmp_path):
    cfg = _config(tmp_path, "global_profiler.tool=torch", "actor_rollout_ref.actor.profiler.enable=true")
    role = cfg.actor_rollout_ref.actor.profiler
    on, off = (Profiler(cfg.global_profiler, role, "actor", rank, 2, "cpu") for rank in (0, 1))  # ranks=[]: rank 0
    _run_step(on, 3)
    _run_step(off, 3)
    (name,) = _files(tmp_path)
    assert name == f"actor_step3_rank0-of-2_pid{os.getpid()}.json.gz"
    with gzip.open(tmp_path / name) as f:
        events = json.load(f)["traceEvents"]
    assert any(event.get("name") == "actor_update" for event in events)  # the stage is a named range


def test_ranks_and_all_ranks_select_the_profiled_ranks(tmp_path):
    def selected(*overrides) -> list[int]:
        cfg = _config(tmp_path, "global_profiler.tool=torch", "critic.profiler.enable=true", *overrides)
        profilers = [Profiler(cfg.global_profiler, cfg.critic.profiler, "critic", r, 4, "cpu") for r in range(4)]
        return [rank for rank, profiler in enumerate(profilers) if profiler.tool is not None]

    assert selected() == [0]
    assert selected("critic.profiler.ranks=[1,3]") == [1, 3]
    assert selected("critic.profiler.all_ranks=true", "critic.profiler.ranks=[1]") == [0, 1, 2, 3]
    cfg = _config(tmp_path, "global_profiler.tool=torch")  # enable=false: no rank
    assert Profiler(cfg.global_profiler, cfg.critic.profiler, "critic", 0, 4, "cpu").tool is None


def test_discrete_mode_writes_one_trace_per_stage(tmp_path):
    cfg = _config(
        tmp_path,
        "global_profiler.tool=torch",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true",
    )
    profiler = Profiler(cfg.global_profiler, cfg.actor_rollout_ref.actor.profiler, "actor", 0, 1, "cpu")
    _run_step(profiler, 2, stages=("rollout_generate", "actor_update"))
    with profiler.stage("actor_update"):  # outside a profiled step: nothing
        pass
    pid = os.getpid()
    assert _files(tmp_path) == [
        f"actor_actor_update_step2_rank0-of-1_pid{pid}.json.gz",
        f"actor_rollout_generate_step2_rank0-of-1_pid{pid}.json.gz",
    ]


def test_two_roles_of_one_process_share_one_trace(tmp_path):
    cfg = _config(
        tmp_path,
        "algorithm.adv_estimator=gae",
        "global_profiler.tool=torch",
        "actor_rollout_ref.actor.profiler.enable=true",
        "critic.profiler.enable=true",
    )
    session = ProfileSession()  # the process's (a worker's Worker.process_state)
    actor = Profiler(cfg.global_profiler, cfg.actor_rollout_ref.actor.profiler, "actor", 0, 1, "cpu", session=session)
    critic = Profiler(cfg.global_profiler, cfg.critic.profiler, "critic", 0, 1, "cpu", session=session)
    actor.start(1)
    critic.start(1)
    with critic.stage("critic_update"):
        pass
    critic.stop()
    actor.stop()
    assert _files(tmp_path) == [f"actor+critic_step1_rank0-of-1_pid{os.getpid()}.json.gz"]


def test_torch_memory_on_cpu_records_resident_memory_per_window(tmp_path):
    cfg = _config(
        tmp_path,
        "global_profiler.tool=torch_memory",
        "global_profiler.global_tool_config.torch_memory.memory_snapshot_num_steps=2",
        "actor_rollout_ref.actor.profiler.enable=true",
    )
    profiler = Profiler(cfg.global_profiler, cfg.actor_rollout_ref.actor.profiler, "actor", 0, 1, "cpu")
    _run_step(profiler, 2)
    assert _files(tmp_path) == []  # a window of 2 profiled steps is not complete yet
    _run_step(profiler, 5)
    (name,) = _files(tmp_path)
    assert name == os.path.join("steps2-5", f"torch_memory_actor_rank0_pid{os.getpid()}.json")
    record = json.loads((tmp_path / name).read_text())
    assert record["device"] == "cpu" and record["steps"] == [2, 5]
    assert record["peak_rss_bytes_of_process"] >= record["rss_bytes_at_window_end"] > 0


def test_profiled_decorator_names_the_stage(tmp_path):
    cfg = _config(
        tmp_path,
        "global_profiler.tool=torch",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true",
    )

    class Worker:
        profiler = Profiler(cfg.global_profiler, cfg.actor_rollout_ref.actor.profiler, "actor", 0, 1, "cpu")

        @profiled("actor_update")
        def update_actor(self, x):
            """Docstring kept."""
            return x + 1

    worker = Worker()
    worker.profiler.start(4)
    assert worker.update_actor(1) == 2 and Worker.update_actor.__doc__ == "Docstring kept."
    worker.profiler.stop()
    assert _files(tmp_path) == [f"actor_actor_update_step4_rank0-of-1_pid{os.getpid()}.json.gz"]


class _Group:
    def __init__(self, calls):
        self.calls = calls

    def start_profile(self, step):
        self.calls.append(("start", step))

    def stop_profile(self):
        self.calls.append(("stop",))


class _QueuedGroup:
    """A rollout pool's group: its calls are submitted, and run when `result()` is asked (here)."""

    def __init__(self, calls):
        self.calls = calls

    def submit(self, method, *args):
        group = self

        class Call:
            def result(self):
                group.calls.append((method, *args))

        return Call()


def test_step_profiler_queues_the_rollout_pools_start_and_stop_and_waits_for_them_at_close(tmp_path):
    cfg = _config(tmp_path, "global_profiler.tool=torch", "global_profiler.steps=[2]")
    calls, queued = [], []
    steps = StepProfiler(cfg.global_profiler, [_Group(calls)], queued_groups=[_QueuedGroup(queued), None])
    for step in range(1, 4):
        steps.begin(step)
        steps.end(step, is_last=step == 3)
    assert calls == [("start", 2), ("stop",)] and queued == []  # sent, not waited for
    steps.close()
    assert queued == [("start_profile", 2), ("stop_profile",)]


@pytest.mark.parametrize(
    "continuous, expected",
    [
        (False, [("start", 2), ("stop",), ("start", 3), ("stop",), ("start", 5), ("stop",)]),
        (True, [("start", 2), ("stop",), ("start", 5), ("stop",)]),  # steps 2-3 are one window
    ],
)
def test_step_profiler_starts_and_stops_the_listed_steps(tmp_path, continuous, expected):
    cfg = _config(
        tmp_path,
        "global_profiler.tool=torch",
        "global_profiler.steps=[2,3,5]",
        f"global_profiler.profile_continuous_steps={continuous}",
    )
    calls = []
    steps = StepProfiler(cfg.global_profiler, [_Group(calls), None])
    for step in range(1, 7):
        steps.begin(step)
        steps.begin(step)  # dynamic sampling: several generation rounds for one step
        steps.end(step, is_last=step == 6)
    assert calls == expected


def test_refusals_name_the_key_before_ray(monkeypatch):
    with pytest.raises(ValueError, match=r"global_profiler.tool='npu': Ascend NPU profiling needs Ascend NPUs"):
        typed(compose([*SMALL, "global_profiler.tool=npu"]))
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ValueError, match=r"global_profiler.tool=nsys: nsys is not installed"):
        typed(compose([*SMALL, "global_profiler.tool=nsys", "global_profiler.steps=[1]"]))
    with pytest.raises(ValueError, match=r"rollout.trace.backend=mlflow: tracing rollouts .* is not implemented"):
        compose([*SMALL, "actor_rollout_ref.rollout.trace.backend=mlflow"])
    with pytest.raises(ValueError, match=r"profiler.tool_config.torch.schedule.active=1: torch.profiler schedules"):
        compose([*SMALL, "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.active=1"])


def test_nsys_workers_run_under_nsight_with_verls_capture_range_end():
    cfg = OmegaConf.create({"global_profiler": OmegaConf.to_container(compose(SMALL).global_profiler)})
    assert nsight_runtime_env(cfg) == {}
    cfg.global_profiler.tool, cfg.global_profiler.steps = "nsys", [1, 2, 5]
    options = nsight_runtime_env(cfg)["nsight"]
    assert options["capture-range"] == "cudaProfilerApi" and options["capture-range-end"] == "repeat-shutdown:18"


@pytest.mark.slow
def test_a_cpu_run_writes_traces_for_the_profiled_steps_and_ranks(tmp_path, cache_dir):
    """A real run on 2 workers and 3 steps: one trace, of step 2 on rank 1 (global_profiler.steps, profiler.ranks)."""
    overrides = [
        *SMALL,
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=3",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "data.max_response_length=8",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        f"global_profiler.save_path={tmp_path / 'profile'}",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[1]",
    ]
    env = {**os.environ, "RLFRAME_CACHE": str(cache_dir)}
    out = subprocess.run(
        [sys.executable, "-m", "rlframe.trainer.main_ppo", *overrides], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (name,) = _files(tmp_path / "profile")
    assert name.startswith("actor_rollout_ref_step2_rank1-of-2_pid") and name.endswith(".json.gz")
    with gzip.open(tmp_path / "profile" / name) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"rollout_generate", "actor_update"} <= names
