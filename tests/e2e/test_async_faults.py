"""separate_async with a rollout-pool process SIGKILLed while it generates (`trainer.max_restarts`).

The driver learns of the death when it waits for that generation; it tears both pools down, recreates them and
resumes from the latest checkpoint, whose prompts in flight it generates again first (docs/async.md,
Checkpoints): the run ends, and every prompt is trained in exactly one of the kept steps.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest
from helpers.runs import COMMON, read_metrics, run_main

from rlframe.utils.faults import ENV, ONCE_ENV

pytestmark = pytest.mark.slow


def test_a_dead_rollout_worker_restarts_both_pools_and_each_prompt_is_trained_once(tmp_path, cache_dir):
    run_dir, once, dumps = tmp_path / "run", tmp_path / "once", tmp_path / "dumps"
    once.mkdir()
    overrides = [
        *COMMON,
        "trainer.n_gpus_per_node=1",
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "trainer.v1.sampler.max_off_policy_threshold=2",  # η = 1: step 3's groups generate while step 2 trains
        "trainer.v1.separate_async.parameter_sync_step=2",
        "trainer.total_training_steps=4",
        "trainer.test_freq=-1",
        "trainer.save_freq=1",
        "trainer.max_restarts=1",
        "trainer.resume_mode=auto",
        f"trainer.rollout_data_dir={dumps}",
        f"trainer.default_local_dir={run_dir}",
    ]
    # the third generate call (step 3's groups, admitted after step 1's push) dies as it starts; Ray's memory monitor
    # off, so the only death is the test's. With partial rollout (the default) a push first collects every call
    # submitted before it, so the driver learns of the death at step 2's push, before step 2's checkpoint. The call
    # it names is the first one on the dead process it waits for: mostly generate #3, but step 1's load_weights when
    # the kill lands before that call's answer has left the process (Ray sends it while the next call starts; CI saw it)
    env = {ENV: "rollout.generate:3", ONCE_ENV: str(once), "RAY_memory_monitor_refresh_ms": "0"}
    out = run_main(overrides, cache_dir, extra_env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert os.listdir(once) == ["killed-rollout.generate-3"]
    assert re.search(r"worker rank 0 died during RolloutWorker\.(generate_sequences|load_weights)", log), log[-4000:]
    assert "restart 1 of trainer.max_restarts=1" in log
    assert f"[rlframe] resuming from {run_dir / 'global_step_1'}" in log
    steps = {m["training/global_step"]: m["training/num_restarts"] for m in read_metrics(run_dir)}
    assert steps == {1: 0, 2: 1, 3: 1, 4: 1}
    trained = Counter()
    for step in (1, 2, 3, 4):  # the dumps of the kept steps (2 to 4 written by the resumed run)
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        assert len({row["index"] for row in rows}) == 4
        trained.update({row["index"] for row in rows})
    assert len(trained) == 16 and set(trained.values()) == {1}
