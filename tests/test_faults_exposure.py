"""Exposure: no secret in what a run prints or saves; no Ray dashboard on a local cluster.

A real run's config dump, console and metrics are checked with a wandb key in the environment in
tests/test_faults_restart.py; here the rules themselves, and the listening sockets of a local Ray.
"""

from __future__ import annotations

import pytest

from rlframe.trainer.redact import MASK, redact


def test_secret_keys_and_secret_env_values_are_masked():
    env = {"WANDB_API_KEY": "wandb-0123456789abcdef", "HF_TOKEN": "hf_abcdefghijkl", "WANDB_MODE": "offline-mode"}
    config = {
        "trainer": {"experiment_name": "run-wandb-0123456789abcdef", "project_name": "p", "logger": ["wandb"]},
        "actor_rollout_ref": {
            "model": {"path": "/models/x", "override_config": {"api_key": "k" * 12}},
            "rollout": {"engine_kwargs": {"vllm": {"hf_token": "anything", "max_num_batched_tokens": 8192}}},
        },
        "data": {"tokenizer": None, "max_prompt_length": 512, "urls": ["https://u:hf_abcdefghijkl@host/x"]},
        "critic": {"ppo_max_token_len_per_gpu": 100, "token": ""},
    }
    shown = redact(config, env)
    assert shown["trainer"]["experiment_name"] == f"run-{MASK}"  # interpolated from the environment
    assert shown["actor_rollout_ref"]["model"]["override_config"]["api_key"] == MASK
    vllm = shown["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]
    assert vllm == {"hf_token": MASK, "max_num_batched_tokens": 8192}  # *_tokens is not a secret
    assert shown["data"] == {"tokenizer": None, "max_prompt_length": 512, "urls": [f"https://u:{MASK}@host/x"]}
    assert shown["critic"] == {"ppo_max_token_len_per_gpu": 100, "token": ""}  # nothing to hide
    assert shown["trainer"]["logger"] == ["wandb"] and config["trainer"]["experiment_name"].startswith("run-wandb")


@pytest.mark.slow
def test_a_local_cluster_starts_no_dashboard():
    import psutil
    import ray

    from rlframe.single_controller.ray import init_ray

    assert not ray.is_initialized()
    init_ray(num_cpus=1)
    try:
        listening = [
            (proc.name(), conn.laddr.port)
            for proc in psutil.Process().children(recursive=True)
            for conn in _listening(proc)
        ]
        assert listening, "no Ray process found listening at all: the check would be vacuous"
        assert not [entry for entry in listening if entry[1] == 8265], listening  # the dashboard's port
        assert not [name for name, _ in listening if name.startswith("ray::Dashboard") and "Agent" not in name]
    finally:
        ray.shutdown()


def _listening(proc):
    import psutil

    try:
        return [c for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []
