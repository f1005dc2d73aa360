"""Experiment tracking: console, jsonl (always on), tensorboard, wandb — one `log(metrics, step)` call."""

from __future__ import annotations

import json
import math
import os
import time

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


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
        self._tb = self._wandb = None
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

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: _plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if "console" in self.backends:
            print(format_console(clean, step), flush=True)
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def finish(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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
