"""End to end: a training step whose rows come from an agent written only with the `openai` package."""

import os

import pytest
from helpers.runs import COMMON, read_metrics, run_main

pytestmark = pytest.mark.slow

AGENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "agents", "two_turns.py")


def test_a_training_step_through_the_openai_endpoint(tmp_path, cache_dir):
    out = run_main(
        COMMON
        + [
            f"trainer.default_local_dir={tmp_path}",
            "trainer.total_training_steps=1",
            "data.max_response_length=64",
            "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
            f"actor_rollout_ref.rollout.agent.openai_agent.path={AGENT}",
            "actor_rollout_ref.rollout.agent.openai_agent.name=agent",
        ],
        cache_dir,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (step,) = [m for m in read_metrics(tmp_path) if "actor/pg_loss" in m]
    assert step["openai_agent/failed_ratio"] == 0
    assert step["openai_agent/requests_per_episode"] == 2  # two chat turns (GET /models is not a request counted)
    assert step["openai_agent/trajectories_per_episode"] == 1  # the second request extended the first
