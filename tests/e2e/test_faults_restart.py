"""A real run (Ray, 2 CPU workers) whose worker processes are SIGKILLed while generating, updating and saving.

Run A (`trainer.max_restarts=0`): worker rank 0 dies in its second update; the run stops with that
rank as the root cause, and the latest checkpoint (step 1) is complete. Run B resumes from it with
`trainer.max_restarts=3`: worker rank 1 dies while the workers build their models, then while
generating (step 2), then rank 0 dies between the shard files of step 2's checkpoint; each time the
driver tears the workers down, recreates them and resumes from step 1 (the newest complete
checkpoint), and the run finishes step 4 with `training/num_restarts` counting the three restarts.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.runs import COMMON, read_metrics, run_main

from rlframe.utils.faults import ENV, ONCE_ENV
from rlframe.utils.manifest import verify_manifest

pytestmark = pytest.mark.slow
SECRET = "wandb-secret-0123456789"


def test_killed_workers_stop_the_run_or_restart_it_from_the_latest_complete_checkpoint(tmp_path, cache_dir):
    run_dir, once = tmp_path / "run", tmp_path / "once"
    once.mkdir()
    overrides = [*COMMON, f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=auto"]
    overrides += ["trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=null"]

    # never printed or saved (docs/reliability.md); and Ray's memory monitor off: on a shared test machine it
    # would kill these workers for other processes' memory, and the deaths counted must be the test's own
    base_env = {"WANDB_API_KEY": SECRET, "RAY_memory_monitor_refresh_ms": "0"}
    overrides.append("trainer.experiment_name=run-${oc.env:WANDB_API_KEY}")
    out = run_main(overrides, cache_dir, extra_env={ENV: "worker.update:2:0", ONCE_ENV: str(once), **base_env})
    assert SECRET not in out.stdout + out.stderr + (run_dir / "config.yaml").read_text()
    assert "experiment_name: run-***" in (run_dir / "config.yaml").read_text()
    assert out.returncode != 0
    assert "worker rank 0 died during ActorRolloutRefWorker.update_actor" in out.stderr, out.stderr[-3000:]
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1"]
    verify_manifest(str(run_dir / "global_step_1"))

    # rank 1 while building its models; step 2's generation; rank 0's first shard file of step 2
    kills = "worker.init:1:1,worker.generate:1:1,checkpoint.file:1:0"
    env = {ENV: kills, ONCE_ENV: str(once), **base_env}
    out = run_main([*overrides, "trainer.max_restarts=3"], cache_dir, extra_env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert sorted(os.listdir(once)) == [
        "killed-checkpoint.file-1",
        "killed-worker.generate-1",
        "killed-worker.init-1",
        "killed-worker.update-2",
    ]
    log = out.stdout + out.stderr
    assert "worker rank 1 died during ActorRolloutRefWorker.init_model" in log
    assert "worker rank 1 died during ActorRolloutRefWorker.generate_sequences" in log
    assert all(f"restart {n} of trainer.max_restarts=3" in log for n in (1, 2, 3))
    # no resume at the first start (its workers died building their models), one after each restart
    assert log.count(f"[rlframe] resuming from {run_dir / 'global_step_1'}") == 3
    steps = [m for m in read_metrics(run_dir) if "training/num_restarts" in m]
    by_step = {m["training/global_step"]: m["training/num_restarts"] for m in steps}
    assert by_step == {1: 0, 2: 3, 3: 3, 4: 3}
    for step in (1, 2, 3, 4):
        verify_manifest(str(run_dir / f"global_step_{step}"))
    assert json.loads((run_dir / "latest_checkpointed_iteration.txt").read_text()) == 4
    assert SECRET not in out.stdout + out.stderr + (run_dir / "metrics.jsonl").read_text()
