"""The rollout stage: where each step's training batch comes from, the same contract for every trainer mode.

The trainer's one `fit` loop asks its `BatchSource` for the next step's scored batch, trains on it, and tells the
source that the update is done. A source composes the same stages whatever generates:

    prompts → groups (uid; ReMax's greedy baseline; n samples each) → generate → score (`Scorer`)
            → DAPO's dynamic sampling (collect informative groups until the batch is full)

`ColocatedSource` (`trainer.v1.trainer_mode=sync`) generates on the training processes' own engine, one loader
batch at a time; `PooledSource` (`separate_async`, `rlframe/trainer/pooled_source.py`) streams groups through a
rollout pool of its own. What a source has handed out and not had trained goes into the trainer's checkpoint, so a
run resumes under either mode without losing a prompt: the groups finished (`finished_groups`, trained as they are
by an asynchronous resume, generated again by a synchronous one) and the prompts (`untrained_prompts`).
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlframe.algorithms.advantage import gdpo_component_scores
from rlframe.models.vision import MULTIMODAL_KEYS
from rlframe.protocol import DataProto
from rlframe.reward.manager import drop_failed_samples, extra_info_metrics
from rlframe.trainer.dynamic_sampling import DynamicSampler
from rlframe.trainer.finished_groups import FinishedGroup
from rlframe.trainer.metrics import reduce_metrics
from rlframe.trainer.pending_prompts import PendingPrompts
from rlframe.workers.rollout.base import PROMPT_KEYS, drop_rollout_state
from rlframe.workers.rollout.config import uses_tool_agent
from rlframe.workers.rollout.multi_turn import AGENT_INPUT_KEYS, check_agent_rows
from rlframe.workers.rollout.openai_agent import SAMPLE_KEYS as OPENAI_SAMPLE_KEYS

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlframe.batch_plan import BatchPlan
    from rlframe.reward.manager import RewardManager
    from rlframe.single_controller.ray import RayWorkerGroup


@contextmanager
def timer(name: str, timings: dict):
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class SourceInputs:
    """What every source reads: the run's config and plan, the training loader, the prompts a checkpoint left
    untrained (`PendingPrompts`, restored before the first step), and the reward stage."""

    config: DictConfig
    plan: BatchPlan
    loader: Any
    pending: PendingPrompts
    scorer: Scorer


@dataclass
class StepBatch:
    """One step's scored batch, with what its rollout measured and when the step started."""

    batch: DataProto
    metrics: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)


class BatchSource(ABC):
    """Where the fit loop's training batches come from (`docs/trainer.md`, "The rollout stage")."""

    pending: PendingPrompts  # the prompts it takes before the loader's next ones (`SourceInputs.pending`)

    def start(self, step: int) -> None:
        """Called once before the first step, after a resume has restored the trainer at `step`."""

    @abstractmethod
    def next_batch(self, step: int) -> StepBatch | None:
        """The scored batch step `step` trains on; None when the data has run out first."""

    def after_update(self, step: int, metrics: dict) -> None:
        """Step `step`'s update is done (its metrics may gain the source's own timings)."""

    @abstractmethod
    def untrained_prompts(self) -> list[DataProto]:
        """Every prompt handed out and not trained yet, oldest first (one row each), but those of `finished_groups`:
        the checkpoint keeps them."""

    def finished_groups(self) -> list[FinishedGroup]:
        """The groups generated and not trained yet, oldest first: the checkpoint keeps them whole."""
        return []

    def check_resumable(self, driver_state: dict) -> None:
        """Refuse a checkpoint's driver state this source cannot resume from (before the workers load it)."""

    def restore_finished(self, groups: list[FinishedGroup]) -> None:
        """A checkpoint's finished groups (called once, before `start`); this source generates their prompts again
        (before the other pending prompts: they are older)."""
        self.pending.rows.extendleft(reversed([group.prompt for group in groups]))

    def close(self) -> None:
        """The run is over: wait for what is still under way."""


# ---------------------------------------------------------------- the stages every source composes
def assign_uids(prompts: DataProto) -> None:
    """Each prompt a group with a uid of its own (its n samples, repeated side by side later, share it)."""
    prompts.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)


def generation_inputs(batch: DataProto, rollout_cfg, **meta_info) -> tuple[DataProto, DataProto]:
    """(the batch without its prompts, what the rollout receives: the prompts and an agent's inputs)."""
    gen_batch = batch.pop(batch_keys=list(PROMPT_KEYS))
    check_agent_rows(batch.non_tensor_batch.get("agent_name"), rollout_cfg)
    if uses_tool_agent(rollout_cfg):  # the agent reads the chat and tool arguments
        gen_batch.non_tensor_batch = {k: v for k, v in batch.non_tensor_batch.items() if k in AGENT_INPUT_KEYS}
    if rollout_cfg.agent.default_agent_loop == "openai_agent":  # the user's agent gets the row's sample
        keys = (*OPENAI_SAMPLE_KEYS, "agent_name")
        gen_batch.non_tensor_batch = {k: v for k, v in batch.non_tensor_batch.items() if k in keys}
    # a vision-language model's images: the engine reads them, and the batch keeps them for training
    gen_batch.non_tensor_batch.update({k: v for k, v in batch.non_tensor_batch.items() if k in MULTIMODAL_KEYS})
    gen_batch.meta_info = meta_info
    return batch, gen_batch


def greedy_inputs(prompts: DataProto, rollout_cfg) -> tuple[DataProto, DataProto]:
    """ReMax's baseline call: `generation_inputs` of a copy of the prompts (one row each), sampled greedily."""
    return generation_inputs(prompts.select(deepcopy=True), rollout_cfg, validate=False, do_sample=False)


def merge_generated(batch: DataProto, output: DataProto) -> tuple[DataProto, dict]:
    """The batch with the rollout's output joined back; (it, the rollout's metrics, lists by name)."""
    metrics = output.meta_info.pop("metrics", {})
    output.meta_info = {}
    return batch.union(drop_rollout_state(output)), metrics


def merged_metrics(metric_dicts: list[dict]) -> dict:
    """Several rollout calls' metric dicts as one dict of lists, for reduce_metrics (one call: unchanged)."""
    merged: dict[str, list] = {}
    for metrics in metric_dicts:
        for key, value in metrics.items():
            merged.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return merged


def generate(wg: RayWorkerGroup, batch: DataProto, rollout_cfg, **meta_info) -> tuple[DataProto, dict]:
    """Send the batch's prompts to the worker group's rollout; merge the responses back. (batch, raw metrics)."""
    batch, gen_batch = generation_inputs(batch, rollout_cfg, **meta_info)
    return merge_generated(batch, wg.generate_sequences(gen_batch))  # dispatch pads


class Scorer:
    """The reward stage: rule-based scores; with a reward model enabled, its scores are the reward (as in verl)."""

    def __init__(self, config: DictConfig, reward_fn: RewardManager, reward_model_wg: RayWorkerGroup | None):
        self.reward_fn, self.reward_model_wg = reward_fn, reward_model_wg
        self.gdpo_keys = list(config.algorithm.gdpo_reward_keys) if config.algorithm.adv_estimator == "gdpo" else None

    def baseline_scores(self, greedy: DataProto) -> torch.Tensor:
        """ReMax: each greedy response's summed rule-based score, the baseline (`reward_baselines`) of its prompt's
        samples."""
        return self.reward_fn(greedy, return_dict=True)["reward_tensor"].sum(-1)

    def score(self, batch: DataProto, metrics: dict) -> dict:
        """Set `token_level_scores` (and GDPO's components); returns the reward manager's per-sample extra info."""
        result = self.reward_fn(batch, return_dict=True)
        batch.batch["token_level_scores"] = result["reward_tensor"]
        if self.reward_model_wg is not None:
            rm_scores = self.reward_model_wg.compute_rm_score(batch).batch["rm_scores"]
            batch.batch["token_level_scores"] = rm_scores
            metrics["reward/rule_score/mean"] = float(result["reward_tensor"].sum(-1).mean())
        elif result["dropped"].any():  # custom_reward_function.on_scorer_error=drop
            drop_failed_samples(batch, result["dropped"])
        metrics.update(result.get("metrics", {}))
        extra_info = result.get("reward_extra_info", {})
        metrics.update(extra_info_metrics(extra_info))
        if self.gdpo_keys is not None:  # the components travel with their samples
            batch.batch["gdpo_scores"] = gdpo_component_scores(extra_info, self.gdpo_keys, len(batch))
        return extra_info


# ---------------------------------------------------------------- the synchronous source
class ColocatedSource(BatchSource):
    """`trainer_mode=sync`: each loader batch is generated on the training processes' engine, then scored.

    Without dynamic sampling every loader batch is a training batch. With it, the informative groups of successive
    rounds are collected until train_batch_size prompts (`DynamicSampler`); the data's epochs then end the run
    first, since a step spends several loader batches.
    """

    def __init__(self, inputs: SourceInputs, actor_rollout_wg: RayWorkerGroup):
        config, plan = inputs.config, inputs.plan
        self.rollout_cfg, self.plan, self.wg = config.actor_rollout_ref.rollout, plan, actor_rollout_wg
        self.loader, self.pending, self.scorer = inputs.loader, inputs.pending, inputs.scorer
        self.remax = config.algorithm.adv_estimator == "remax"
        self.total_epochs = int(config.trainer.total_epochs)
        self.sampler = DynamicSampler.of(config, plan)  # DAPO's: None without algorithm.filter_groups
        self._batches: Iterator[DataProto] | None = None

    def next_batch(self, step: int) -> StepBatch | None:
        if self._batches is None:  # after a resume restored the loader and the pending prompts
            self._batches = self._loader_batches()
        ready, rounds = StepBatch(DataProto()), []
        for prompts in self._batches:
            batch = self._rollout(prompts, step, ready, rounds)
            if batch is not None:
                ready.batch = batch
                ready.metrics.update(reduce_metrics(merged_metrics(rounds)))  # every round's generation
                return ready
        return None

    def _loader_batches(self) -> Iterator[DataProto]:
        """The pending prompts, then the loader's batches, pass after pass (dynamic sampling: total_epochs passes)."""
        passes, empty_before = 0, False
        while True:
            empty = True
            for batch in self.pending.batches(self.loader, self.loader.batch_size):
                empty = False
                yield batch
            passes += 1
            if empty and empty_before:  # a run resumed at an epoch's end first reads that epoch's empty rest
                return
            empty_before = empty
            if self.sampler is not None and passes >= self.total_epochs:
                self.sampler.report_data_end()
                return

    def _rollout(self, prompts: DataProto, step: int, ready: StepBatch, rounds: list[dict]) -> DataProto | None:
        """Generate and score one loader batch; the training batch once one is full (dynamic sampling: else None)."""
        metrics, timings = ready.metrics, ready.timings
        assign_uids(prompts)
        if self.remax:
            with timer("gen_max", timings):
                prompts.batch["reward_baselines"] = self._remax_baselines(prompts)
        batch = prompts.repeat(self.plan.n, interleave=True)
        with timer("gen", timings):
            # the weights have had step - 1 updates: the OpenAI endpoint records it with each sampled turn
            batch, gen_metrics = generate(self.wg, batch, self.rollout_cfg, validate=False, policy_version=step - 1)
            rounds.append(gen_metrics)
        with timer("reward", timings):
            extra_info = self.scorer.score(batch, metrics)
        if self.sampler is None:
            return batch
        with timer("filter_groups", timings):
            if not self.sampler.add(batch, extra_info):
                return None
            batch, sampling_metrics = self.sampler.take()
        metrics.update(sampling_metrics)
        return batch

    def _remax_baselines(self, prompts: DataProto) -> torch.Tensor:
        """ReMax: the score of one greedy response per prompt, the baseline of that prompt's samples."""
        greedy, gen_batch = greedy_inputs(prompts, self.rollout_cfg)
        greedy, _ = merge_generated(greedy, self.wg.generate_sequences(gen_batch))
        return self.scorer.baseline_scores(greedy)

    def untrained_prompts(self) -> list[DataProto]:
        return list(self.pending.rows)
