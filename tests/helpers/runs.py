"""Training runs: the common overrides, launching main_ppo in a subprocess or in this process on a module's Ray,
reading the metrics."""

import json
import os
import subprocess
import sys

from helpers.small_config import SMALL

COMMON = [
    *SMALL,
    "actor_rollout_ref.actor.optim.lr=3e-3",
    "trainer.logger=[jsonl]",
    "trainer.val_before_train=false",
    "trainer.resume_mode=disable",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "data.max_response_length=8",
]


def run_main(overrides, cache_dir, timeout=900, extra_env=None):
    env = {**os.environ, "RLFRAME_CACHE": str(cache_dir), "RAY_DEDUP_LOGS": "0", **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlframe.trainer.main_ppo", *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def run_in_process(overrides: list[str]) -> dict:
    """main_ppo's run in this process, on the module's Ray (`module_ray`, tests/e2e/conftest.py): its last step's
    metrics (a failure raises)."""
    from rlframe.trainer.main_ppo import run_ppo

    return run_ppo(overrides)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
