"""A real run (Ray, 2 CPU workers, one step) with secrets in its config and every tracker on.

No secret reaches stdout, stderr, any file under the run folder (`config.yaml`, `metrics.jsonl`, wandb's offline
run, tensorboard's events), MLflow's store or the HTML report; the trackers' run names and configs hold `***`
where the secret was. The variables' names are the ones a name pattern misses (`OPENAI_KEY`, `DATABASE_URL`).
"""

from __future__ import annotations

import pytest
from helpers.runs import COMMON, run_main

from rlframe.viz import report

pytestmark = pytest.mark.slow
SECRETS = {
    "WANDB_API_KEY": "wandbSECRET0123456789abcdef",
    "OPENAI_KEY": "sk-openai-0123456789",
    "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP",
    "DATABASE_URL": "postgres://trainer:pg-pass-4242@db.internal/runs",
    "RUN_PIN": "73915502",
}


def test_a_run_with_every_tracker_shows_no_secret(tmp_path, cache_dir, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    env = {
        **SECRETS,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": store.as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "RAY_memory_monitor_refresh_ms": "0",  # other processes' memory on a shared machine must not kill these
    }
    overrides = [
        *COMMON,
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=1",
        "trainer.logger=[console,jsonl,wandb,mlflow,tensorboard]",
        "trainer.experiment_name=run-${oc.env:WANDB_API_KEY}",
        "trainer.project_name=${oc.env:AWS_ACCESS_KEY_ID}",
        "data.seed=${oc.env:RUN_PIN}",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.endpoint=${oc.env:OPENAI_KEY}",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.store=${oc.env:DATABASE_URL}",
    ]
    out = run_main([*overrides, "--print-config"], cache_dir, extra_env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert report.main([str(run_dir), "-o", str(tmp_path / "report.html")]) == 0

    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    wandb_runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert wandb_runs and list((run_dir / "tensorboard").glob("events.out.tfevents.*")), files
    shown = [out.stdout.encode(), out.stderr.encode(), *(path.read_bytes() for path in files)]
    for secret in [*SECRETS.values(), "pg-pass-4242"]:
        assert not [text for text in shown if secret.encode() in text], secret
    assert b"run-***" in wandb_runs[0].read_bytes()  # wandb's run name

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the run's store back here
    client = mlflow.tracking.MlflowClient(tracking_uri=store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("***").experiment_id])
    assert run.info.run_name == "run-***"
    params = run.data.params
    assert (params["trainer/experiment_name"], params["trainer/project_name"], params["data/seed"]) == (
        "run-***",
        "***",
        "***",
    )
    assert params["actor_rollout_ref/rollout/engine_kwargs/vllm/store"] == "***"
    assert params["data/prompt_key"] == "prompt" and params["actor_rollout_ref/actor/ppo_max_token_len_per_gpu"]
