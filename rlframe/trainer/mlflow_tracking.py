"""The `mlflow` backend of `trainer.logger`, with verl 0.9.1's conventions.

- The tracking server is `$MLFLOW_TRACKING_URI`, else `sqlite:////tmp/mlruns.db` (verl's default).
- `trainer.project_name` is the MLflow experiment and `trainer.experiment_name` the run's name; with
  `$MLFLOW_RUN_ID` set (Azure ML, Databricks) metrics go to that existing run instead.
- The config is logged as params, flattened with `/` (a list `[a, b]` becomes `list_len`, `0`, `1`).
- Metric keys are sanitized as MLflow requires (`@` -> `_at_`, repeated `/` collapsed, any character
  but letters, digits, `_ . - : /` and space -> `_`), so `val-core/gsm8k/acc@1` stays readable.

mlflow is an optional extra (`pip install 'rlframe[mlflow]'`); `check_installed` refuses the backend
at launch, before Ray starts, when it is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re

DEFAULT_TRACKING_URI = "sqlite:////tmp/mlruns.db"
_INVALID = re.compile(r"[^/\w.\- :]")
_SLASHES = re.compile(r"/+")


def check_installed() -> None:
    """Raise the launch error for `trainer.logger` naming mlflow when the package is missing."""
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError("the mlflow package is not installed; pip install 'rlframe[mlflow]' or drop mlflow")


def sanitize_key(key: str) -> str:
    """A metric name MLflow accepts."""
    return _INVALID.sub("_", _SLASHES.sub("/", key.replace("@", "_at_")))


def flatten_params(config, prefix: str = "") -> dict:
    """Nested config -> {"a/b/c": value}; lists as {"list_len": n, "0": ..., ...} (as verl logs them)."""
    if isinstance(config, list):
        config = {"list_len": len(config), **{str(i): value for i, value in enumerate(config)}}
    if not isinstance(config, dict):
        return {prefix: config}
    out = {}
    for name, value in config.items():
        out.update(flatten_params(value, f"{prefix}/{name}" if prefix else str(name)))
    return out


class MlflowRun:
    """One MLflow run: started at construction, one `log_metrics` per step, ended by `finish`."""

    def __init__(self, project_name: str, experiment_name: str, config: dict | None):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI))
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            mlflow.start_run(run_id=run_id)
        else:
            experiment = mlflow.set_experiment(project_name)
            mlflow.start_run(experiment_id=experiment.experiment_id, run_name=experiment_name)
        if config:
            mlflow.log_params(flatten_params(config))

    def log(self, metrics: dict, step: int) -> None:
        numbers = {sanitize_key(k): v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.mlflow.log_metrics(numbers, step=step)

    def finish(self) -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run()
