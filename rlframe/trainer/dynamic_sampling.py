"""DAPO's dynamic sampling (`algorithm.filter_groups`): train only on prompts whose samples disagree.

A group (the n samples of one prompt) whose samples all get the same score has zero advantage under
GRPO and teaches nothing. With `filter_groups.enable`, each training step generates rounds of
`data.gen_batch_size` prompts, drops the groups whose `metric` has zero standard deviation (a group
of one sample is kept), and keeps going until `data.train_batch_size` prompts are kept; the surplus
of the last round is cut off so that the step trains on exactly train_batch_size × n sequences. After
`max_num_gen_batches` rounds (0 = no limit) without enough prompts, the run stops with an error
(DAPO paper, Yu et al. 2025, §3.2; the semantics of verl's DAPO recipe).

The metric of a sample: "reward" and "seq_reward" are its summed token-level scores (before any KL
penalty; verl 0.9.1's "reward" reads the same pre-KL scores), "seq_final_reward" its summed
token-level rewards (the same here: the KL-in-reward combination is refused), any other name a
per-sample field of the reward manager's extra info ("acc", "score", a custom scorer's dict keys).
The keys are declared in `FilterGroupsConfig` (`rlframe/trainer/config.py`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from rlframe.protocol import DataProto

SCORE_METRICS = ("reward", "seq_reward", "seq_final_reward")


def sample_metric(batch: DataProto, metric: str, extra_info: dict) -> np.ndarray:
    """Each sample's value of the filter metric (see the module docstring)."""
    if metric in SCORE_METRICS:
        return batch.batch["token_level_scores"].sum(-1).double().numpy()
    if metric not in extra_info:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} is not a per-sample field of the reward manager's output; "
            f"fields present: {', '.join([*SCORE_METRICS, *sorted(extra_info)])}"
        )
    values = []
    for row, value in enumerate(extra_info[metric]):
        if value is not None and not isinstance(value, (numbers.Real, np.bool_)):
            raise ValueError(
                f"algorithm.filter_groups.metric={metric!r}: sample {row} holds {type(value).__name__} "
                f"{repr(value)[:60]}; the filter metric must be a number per sample (None or NaN: the sample has none)"
            )
        values.append(math.nan if value is None else float(value))
    return np.asarray(values, dtype=float)


def informative_rows(uids: np.ndarray, values: np.ndarray) -> tuple[list[int], int]:
    """(rows of the groups whose values have a non-zero std or a single sample, number of such groups).

    NaN marks a sample without a value (its scorer failed): the spread is that of the group's other samples, so one
    failed sample does not hide a group whose others vary (verl's np.std would be NaN, and the group filtered out).
    """
    rows_of: dict[Any, list[int]] = {}
    for row, uid in enumerate(uids):
        rows_of.setdefault(uid, []).append(row)
    kept = {uid for uid, rows in rows_of.items() if len(rows) == 1 or _spread(values[rows]) > 0}
    return [row for row, uid in enumerate(uids) if uid in kept], len(kept)


def _spread(values: np.ndarray) -> float:
    """The std of the finite values (0 when fewer than two)."""
    finite = values[np.isfinite(values)]
    return float(np.std(finite)) if len(finite) > 1 else 0.0


class DynamicSampler:
    """Collects the informative groups of generation rounds until a training batch is full."""

    @classmethod
    def of(cls, config, plan) -> DynamicSampler | None:
        """The sampler `algorithm.filter_groups` asks for, sized by the batch plan; None when it is off."""
        if not plan.filter_groups:
            return None
        return cls(plan.train_batch_size, plan.n, plan.max_num_gen_batches, config.algorithm.filter_groups.metric)

    def __init__(self, train_batch_size: int, n: int, max_num_gen_batches: int, metric: str):
        self.train_batch_size, self.n = train_batch_size, n
        self.max_num_gen_batches, self.metric = max_num_gen_batches, metric
        self._reset()

    def _reset(self) -> None:
        self.parts: list[DataProto] = []
        self.num_prompts = self.num_gen_batches = self.generated_prompts = 0

    def add(self, batch: DataProto, extra_info: dict) -> bool:
        """Keep `batch`'s informative groups; True when the training batch is full.

        Raises when the round limit is reached without a full batch.
        """
        self.num_gen_batches += 1
        uids = batch.non_tensor_batch["uid"]
        rows, kept = informative_rows(uids, sample_metric(batch, self.metric, extra_info))
        self.generated_prompts += len(set(uids))
        self.num_prompts += kept
        if rows:
            self.parts.append(batch.select_idxs(rows))
        if self.num_prompts >= self.train_batch_size:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise ValueError(
                f"dynamic sampling: after {self.num_gen_batches} generation rounds of data.gen_batch_size prompts "
                f"only {self.num_prompts} of data.train_batch_size={self.train_batch_size} prompts have groups whose "
                f"algorithm.filter_groups.metric={self.metric!r} varies, and "
                f"algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches} is reached. The data may be "
                "too hard or too easy for the model; raise max_num_gen_batches (0 = no limit) or data.gen_batch_size."
            )
        return False

    def report_data_end(self) -> None:
        """The data's epochs ran out before the batch was full: say what is left untrained."""
        if self.num_gen_batches:
            print(
                f"[rlframe] dynamic sampling: the data ran out after {self.num_gen_batches} more generation rounds "
                f"with {self.num_prompts} of data.train_batch_size={self.train_batch_size} prompts kept; that "
                "partial batch is not trained on",
                flush=True,
            )

    def take(self) -> tuple[DataProto, dict[str, float]]:
        """The full training batch (the first train_batch_size kept prompts' groups) and the round metrics."""
        batch = DataProto.concat(self.parts)[: self.train_batch_size * self.n]
        metrics = {
            "train/num_gen_batches": self.num_gen_batches,
            "train/filter_groups/generated_prompts": self.generated_prompts,
            "train/filter_groups/kept_prompts": self.num_prompts,
            "train/filter_groups/dropped_prompts": self.generated_prompts - self.num_prompts,
            "train/filter_groups/kept_fraction": self.num_prompts / self.generated_prompts,
            "train/filter_groups/trimmed_prompts": self.num_prompts - self.train_batch_size,
        }
        self._reset()
        return batch, metrics
