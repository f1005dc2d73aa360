"""Experiment tracking: console, jsonl (always on), tensorboard, wandb, mlflow — one `log(metrics, step)` call.

Also the console a person watches: one progress bar (step, reward, step time, ETA) and one line per
validation (`ProgressBar`).
"""

from __future__ import annotations

import json
import math
import os
import time

from rlframe.utils.safe_files import write_file_atomically

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def check_backends(backends: list) -> None:
    """`trainer.logger`'s launch check: known names, and mlflow (an optional extra) installed."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown entries {unknown}; valid: {', '.join(BACKENDS)}")
    if "mlflow" in backends:
        from rlframe.trainer.mlflow_tracking import check_installed

        check_installed()


class Tracking:
    """Fan one metrics dict out to every configured backend."""

    def __init__(self, project_name: str, experiment_name: str, backends, log_dir: str, config: dict | None = None):
        backends = [backends] if isinstance(backends, str) else list(backends)
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger has unknown backends {unknown}; valid: {', '.join(BACKENDS)}")
        if "jsonl" not in backends:
            backends.append("jsonl")  # the run's own record, always written
        self.backends = backends
        os.makedirs(log_dir, exist_ok=True)
        self.jsonl_path = os.path.join(log_dir, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a", buffering=1)
        self._tb = self._wandb = self._mlflow = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
        if "wandb" in backends:
            import wandb  # offline-capable: WANDB_MODE=offline

            self._wandb = wandb.init(
                project=project_name,
                name=experiment_name,
                config=config,
                dir=log_dir,
                mode=os.environ.get("WANDB_MODE"),
            )
        if "mlflow" in backends:
            from rlframe.trainer.mlflow_tracking import MlflowRun

            self._mlflow = MlflowRun(project_name, experiment_name, config)

    def drop_steps_after(self, step: int) -> int:
        """Remove metrics.jsonl's lines of steps after `step` (a run resumed at `step`, or started afresh at 0, logs
        them again); the file is replaced whole. Returns how many lines went."""
        self._jsonl.close()
        with open(self.jsonl_path) as f:
            lines = f.readlines()
        kept = [line for line in lines if _step_of(line) <= step]
        if len(kept) != len(lines):
            write_file_atomically(self.jsonl_path, lambda f: f.write("".join(kept).encode()))
        self._jsonl = open(self.jsonl_path, "a", buffering=1)
        return len(lines) - len(kept)

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: _plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if "console" in self.backends:
            from tqdm import tqdm

            tqdm.write(format_console(clean, step))  # above the progress bar, not through it
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            self._mlflow.log(clean, step)

    def finish(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.finish()


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def format_console(metrics: dict, step: int) -> str:
    """One line: `step:3 - critic/score/mean:0.250 - ...` sorted by key."""
    parts = [f"step:{step}"]
    for key in sorted(metrics):
        value = metrics[key]
        parts.append(f"{key}:{value:.4g}" if isinstance(value, float) else f"{key}:{value}")
    return " - ".join(parts)


VAL_PREFIX = "val-core/"


def format_validation(metrics: dict, step: int, first: dict | None = None) -> str | None:
    """One line for a validation's `val-core/*` metrics, with each one's first value for comparison."""
    scores = {k: v for k, v in metrics.items() if k.startswith(VAL_PREFIX) and isinstance(v, (int, float))}
    if not scores:
        return None
    parts = []
    for key in sorted(scores):
        text = f"{key[len(VAL_PREFIX) :]} {scores[key]:.3f}"
        if first and key in first and first[key][0] != step:
            start_step, start_value = first[key]
            text += f" (step {start_step}: {start_value:.3f})"
        parts.append(text)
    return f"validation at step {step}: " + ", ".join(parts)


class ProgressBar:
    """The training bar on stderr: steps done, reward, step time and ETA; validation lines above it."""

    # tqdm puts ", " before a postfix: at the end of the bracket it reads "[…, ETA 00:12, reward 0.250, step 0.41s]"
    FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| [{elapsed} elapsed, ETA {remaining}{postfix}]"

    def __init__(self, total: int, initial: int):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=initial, desc="training", unit="step", dynamic_ncols=True, bar_format=self.FORMAT
        )
        self.first_validation: dict[str, tuple[int, float]] = {}

    def update(self, metrics: dict) -> None:
        """Advance one step, showing its mean training score and step time."""
        reward = metrics.get("critic/score/mean", float("nan"))
        step_s = metrics.get("timing_s/step", float("nan"))
        self.bar.set_postfix_str(f"reward {reward:.3f}, step {step_s:.2f}s", refresh=False)
        self.bar.update(1)

    def validation(self, metrics: dict, step: int) -> None:
        """Print the one-line summary of a validation above the bar."""
        line = format_validation(metrics, step, self.first_validation)
        if line is not None:
            self.bar.write(line)
        for key, value in metrics.items():
            if key.startswith(VAL_PREFIX) and isinstance(value, (int, float)):
                self.first_validation.setdefault(key, (step, value))

    def close(self) -> None:
        """Leave the finished bar on screen."""
        self.bar.close()


def _step_of(line: str) -> int:
    """A metrics.jsonl line's step; a line that cannot be read (cut by a kill) counts as after every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62
