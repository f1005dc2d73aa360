"""`rlframe.train(config)`: the Python entry. A config in, a finished run out.

It takes the command line's path: the config becomes `key=value` overrides of the defaults
(`rlframe.config.loader.overrides_from_config`), which `main_ppo.prepare` composes, types and checks
before Ray starts, and `main_ppo.train` runs (worker restarts included). So a config means the same
run from Python as from `python -m rlframe.trainer.main_ppo`, and fails with the same message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from omegaconf import DictConfig

from rlframe.config.loader import overrides_from_config


@dataclass(frozen=True)
class TrainResult:
    """What `rlframe.train` returns: where the run is and how it ended."""

    run_dir: str  # trainer.default_local_dir, absolute: metrics.jsonl, config.yaml, checkpoints
    metrics: dict  # the last step's metrics (with trainer.val_only: the validation's)
    config: DictConfig  # the resolved, read-only config the run used
    overrides: list  # the key=value overrides the config became (what `rlframe train` would take)

    @property
    def metrics_path(self) -> str:
        """`<run_dir>/metrics.jsonl`: one JSON row per logged step (always written, whatever trainer.logger says)."""
        return os.path.join(self.run_dir, "metrics.jsonl")

    def history(self) -> list[dict]:
        """Every row of metrics.jsonl: validations and training steps, each with its `step`."""
        with open(self.metrics_path) as f:
            return [json.loads(line) for line in f if line.strip()]


def train(
    config: Mapping | DictConfig | Sequence[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    verbose: bool = False,
    print_config: bool = False,
) -> TrainResult:
    """Train PPO/GRPO from Python; returns the run folder and the last step's metrics.

    `config` is what the command line's `key=value` arguments would set, as a mapping (nested sections
    or dotted keys, a dict or an OmegaConf config; a whole composed config works too: only the keys that
    differ from the defaults are taken), or as the `key=value` strings themselves. `overrides` are
    `key=value` strings applied after it. Keys, defaults and checks are the command line's
    (`configs/ppo_trainer.yaml`); a bad config raises `ValueError` before Ray starts. `verbose` and
    `print_config` are the command line's `--verbose` and `--print-config`.

    GRPO on the built-in tiny model and task, two steps on CPU (about 30 s):

    ```python
    import rlframe

    config = {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.model.path": "builtin://tiny",
        "data.train_files": "builtin://countdown_add",
        "data.val_files": "builtin://countdown_add",
        "data.max_prompt_length": 64,
        "data.max_response_length": 16,
        "data.filter_overlong_prompts": True,
        "data.train_batch_size": 8,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.model.enable_gradient_checkpointing": False,
        "trainer": {
            "device": "cpu",
            "n_gpus_per_node": 2,
            "total_training_steps": 2,
            "val_before_train": False,
            "resume_mode": "disable",
            "default_local_dir": "checkpoints/rlframe/tiny_python",
        },
    }
    result = rlframe.train(config)
    print(result.run_dir)  # .../checkpoints/rlframe/tiny_python: metrics.jsonl, config.yaml
    print(result.metrics["critic/score/mean"], result.metrics["actor/pg_loss"])
    print(len(result.history()))  # 2: one row per step
    ```
    """
    from rlframe.trainer import main_ppo

    args = overrides_from_config(config) + [str(item) for item in overrides]
    run = main_ppo.prepare(args)
    metrics = main_ppo.train(run, verbose=verbose, print_config=print_config)
    return TrainResult(
        run_dir=os.path.abspath(run.cfg.trainer.default_local_dir),
        metrics=dict(metrics),
        config=run.cfg,
        overrides=args,
    )
