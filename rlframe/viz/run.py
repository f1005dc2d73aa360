"""A run folder read back: its metrics per step, its resolved config and its rollout dumps."""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
from omegaconf import OmegaConf

from rlframe.config.secrets import find_secrets

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"


@dataclass
class Run:
    """One run folder: `rows[step]` is the merged metrics logged at that step (a resumed run's last write wins)."""

    path: str
    label: str
    rows: dict[int, dict] = field(repr=False)
    config: dict | None = field(repr=False)  # the resolved config, None when config.yaml is missing

    def keys(self) -> list[str]:
        """Every numeric metric name logged by this run, sorted."""
        names = {k for row in self.rows.values() for k, v in row.items() if _is_number(v)}
        return sorted(names - {"step", "time"})

    def matching(self, pattern: str) -> list[str]:
        """The metric names matching a shell-style pattern (`actor/*`, `val-core/*/reward/*`)."""
        return [k for k in self.keys() if fnmatch.fnmatchcase(k, pattern)]

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of one metric over the steps that logged it, in step order."""
        points = [(step, float(row[key])) for step, row in sorted(self.rows.items()) if _is_number(row.get(key))]
        if not points:
            return np.zeros(0, dtype=int), np.zeros(0)
        steps, values = zip(*points)
        return np.asarray(steps, dtype=int), np.asarray(values, dtype=float)

    def has(self, key: str) -> bool:
        """Whether any step logged `key` as a number."""
        return any(_is_number(row.get(key)) for row in self.rows.values())

    def has_any(self, pattern: str) -> bool:
        """Whether any step logged a metric named by `pattern` (a name or a shell-style glob)."""
        return bool(self.matching(pattern)) if "*" in pattern else self.has(pattern)

    def setting(self, dotted: str, default=None):
        """A resolved config value by dotted key (`trainer.rollout_data_dir`), or `default`."""
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def rollout_dir(self) -> str | None:
        """Where this run dumped its rollouts (`trainer.rollout_data_dir`), found from here; None if nowhere."""
        configured = self.setting("trainer.rollout_data_dir")
        if not configured:
            return None
        candidates = [configured]
        if not os.path.isabs(configured):
            # relative to the directory the run was started from: the run folder minus default_local_dir
            local_dir = os.path.normpath(str(self.setting("trainer.default_local_dir", "")))
            here = os.path.normpath(os.path.abspath(self.path))
            if local_dir and not os.path.isabs(local_dir) and here.endswith(os.sep + local_dir):
                candidates.append(os.path.join(here[: -len(local_dir)], configured))
        return next((c for c in candidates if os.path.isdir(c)), None)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number_or_nan(value):
    """jsonl stores non-finite floats as strings ("nan", "inf"); read them back as floats."""
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return value


def read_metrics(path: str) -> dict[int, dict]:
    """`metrics.jsonl` as {step: merged metrics}; a step logged twice (a resumed run) keeps the later values."""
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    rows: dict[int, dict] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):  # a run still writing its last line
                break
            raise ValueError(f"{path}:{number} is not JSON ({err.msg}); is this a metrics.jsonl?") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{number} has no 'step' field; is this a metrics.jsonl?")
        rows.setdefault(int(record["step"]), {}).update({k: _number_or_nan(v) for k, v in record.items()})
    return rows


def load_run(path: str, label: str | None = None) -> Run:
    """Read a run folder (`trainer.default_local_dir`); ValueError naming the folder if it holds no metrics."""
    metrics_path = os.path.join(path, METRICS_FILE)
    if not os.path.isfile(metrics_path):
        what = "no such folder" if not os.path.isdir(path) else f"no {METRICS_FILE} in it"
        raise ValueError(
            f"{path!r} is not a run folder ({what}); give the trainer.default_local_dir of a run, "
            f"the folder holding {METRICS_FILE} and {CONFIG_FILE}"
        )
    config_path = os.path.join(path, CONFIG_FILE)
    config = OmegaConf.to_container(OmegaConf.load(config_path)) if os.path.isfile(config_path) else None
    if config is not None:  # rlframe saves it masked; a copy from elsewhere (an older run) may not be
        config = find_secrets().mask(config)
    return Run(path=path, label=label or run_label(path), rows=read_metrics(metrics_path), config=config)


def run_label(path: str) -> str:
    """A run's default label: its folder's name."""
    return os.path.basename(os.path.normpath(os.path.abspath(path)))


def load_runs(paths: list[str], labels: list[str] | None = None) -> list[Run]:
    """Several runs; labels default to folder names, lengthened with parent folders until they differ."""
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels has {len(labels)} names for {len(paths)} run folders; give one per folder")
    if labels is None:
        labels = _distinct_labels(paths)
    return [load_run(path, label) for path, label in zip(paths, labels)]


def _distinct_labels(paths: list[str]) -> list[str]:
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{label} ({i + 1})" for i, label in enumerate(labels)]  # the same folder given twice


def read_rollouts(folder: str) -> dict[int, list[dict]]:
    """The rollout dumps of `trainer.rollout_data_dir`: {step: rows with prompt, response, score}."""
    out: dict[int, list[dict]] = {}
    for name in os.listdir(folder):
        stem, ext = os.path.splitext(name)
        if ext != ".jsonl" or not stem.isdigit():
            continue
        with open(os.path.join(folder, name)) as f:
            out[int(stem)] = [json.loads(line) for line in f if line.strip()]
    return dict(sorted(out.items()))


def finite(values: np.ndarray) -> np.ndarray:
    """The finite entries of `values`."""
    return values[np.isfinite(values)]


def fmt(value: float) -> str:
    """A metric value in a table: 4 significant digits, nan as 'nan'."""
    if value is None:
        return "—"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return f"{value:.4g}"
