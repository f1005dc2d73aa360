"""trainer.logger=mlflow: verl 0.9.1's conventions, and a clear launch error when mlflow is not installed."""

import sys

import pytest
from helpers.small_config import SMALL

from rlframe.trainer.config import compose, typed
from rlframe.trainer.mlflow_tracking import flatten_params, sanitize_key
from rlframe.trainer.tracking import Tracking


def test_mlflow_without_the_package_is_refused_before_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # find_spec then reports it missing, installed or not
    refusal = r"trainer.logger=\['console', 'mlflow'\]: the mlflow package is not installed"
    with pytest.raises(ValueError, match=refusal):
        typed(compose([*SMALL, "trainer.logger=[console,mlflow]"]))


def test_metric_keys_and_params_follow_verls_mlflow_conventions():
    assert sanitize_key("val-core/gsm8k/acc@1") == "val-core/gsm8k/acc_at_1"
    assert sanitize_key("timing_s//gen (s)%") == "timing_s/gen _s__"
    params = flatten_params({"trainer": {"logger": ["console", "mlflow"], "nnodes": 1}})
    assert params == {
        "trainer/logger/list_len": 2,
        "trainer/logger/0": "console",
        "trainer/logger/1": "mlflow",
        "trainer/nnodes": 1,
    }


def test_mlflow_backend_logs_metrics_and_config(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()  # a file store: no server, and mlflow-skinny reads it too
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    tracker = Tracking("proj", "run-1", ["mlflow"], str(tmp_path / "logs"), config={"data": {"seed": 7}})
    tracker.log({"critic/score/mean": 0.25, "val-core/t/acc@1": 0.5, "note": "text"}, step=1)
    tracker.log({"critic/score/mean": 0.75}, step=2)
    tracker.finish()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "run-1" and run.data.params == {"data/seed": "7"}
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert run.data.metrics["val-core/t/acc_at_1"] == 0.5 and "note" not in run.data.metrics
