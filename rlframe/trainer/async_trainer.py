"""AsyncRayPPOTrainer: `trainer.v1.trainer_mode=separate_async` at batch granularity (one-step-off for η = 1).

A rollout pool of its own (`WorkerGroups.rollout`, `RolloutWorker`s) generates while the training pool trains.
The driver keeps up to 1 + L loader batches submitted to the rollout pool, where L = min(num_warmup_batches, η)
and η = max_off_policy_threshold - 1, and trains them in submission order with the sync trainer's own
`_train_step`. After each update it exports the actor's weights and queues them on the rollout pool as version
`global_step`; Ray runs an actor's calls in submission order, so a generation already queued finishes with the
weights it started with and the next one starts with the new ones.

A batch submitted while version v is published and trained in step s has staleness s - 1 - v; submitting at most
L batches ahead keeps it <= L <= η, and each step checks it. With η = 0 the schedule is the sync loop's, with
generation moved to the other pool (docs/async.md draws both timelines).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlframe.protocol import DataProto
from rlframe.trainer.config import lookahead, staleness_bound
from rlframe.trainer.metrics import compute_staleness_metrics
from rlframe.trainer.ray_trainer import PreparedRun, RayPPOTrainer, timer
from rlframe.workers.rollout_worker import VERSIONS_KEY

if TYPE_CHECKING:  # Ray is imported only when the groups are created
    from rlframe.single_controller.ray import PendingCall
    from rlframe.trainer.launch import WorkerGroups


@dataclass
class InFlight:
    """One loader batch on the rollout pool: its generation call, the batch without prompts, its admission version."""

    call: PendingCall
    batch: DataProto
    admitted_version: int


class AsyncRayPPOTrainer(RayPPOTrainer):
    """separate_async: generation of the next batches on the rollout pool overlaps the training of this one."""

    def __init__(self, run: PreparedRun, groups: WorkerGroups):
        super().__init__(run, groups)
        if groups.rollout is None:
            raise ValueError("trainer.v1.trainer_mode=separate_async needs the rollout pool's worker group")
        self.rollout_wg = groups.rollout
        v1 = self.config.trainer.v1
        self.max_staleness, self.lookahead = staleness_bound(v1), lookahead(v1)  # η, L
        self.published_version = 0  # the weights the rollout pool generates with once its queued calls have run
        self._push: PendingCall | None = None

    def fit(self) -> dict:
        """Train until total_training_steps, generating up to `lookahead` batches ahead; returns the last metrics."""
        progress, validation = self._start()
        if validation is not None:
            return validation
        if self.global_step > 0:  # resumed: the rollout pool starts from the checkpoint's weights
            self._push_weights()
        loader = self._loader_batches()
        in_flight: deque[InFlight] = deque()
        last_metrics: dict = {}
        while self.global_step < self.total_training_steps:
            self._admit(loader, in_flight)
            if not in_flight:  # the data ran out
                break
            self.step_profiler.begin(self.global_step + 1)
            metrics, timings, start = {}, {}, time.perf_counter()
            oldest = in_flight.popleft()
            with timer("gen", timings):  # verl's meaning here: how long training waited for the samples
                batch, gen_metrics = self._merge_generated(oldest.batch, oldest.call.result())
            metrics.update(gen_metrics)
            metrics["async/in_flight_batches"] = len(in_flight)  # generating on the rollout pool while this trains
            self.global_step += 1
            metrics.update(self._staleness(batch, oldest.admitted_version))
            with timer("reward", timings):
                self._compute_reward(batch, metrics)
            last_metrics = self._train_step(batch, metrics, timings, start)
            with timer("update_weights", timings):
                self._push_weights()
            last_metrics["timing_s/update_weights"] = timings["update_weights"]
            self._admit(loader, in_flight)  # before validation: the rollout pool generates while it runs
            is_last = self.global_step >= self.total_training_steps
            self._end_step(last_metrics, progress, is_last)
        if self._push is not None:
            self._push.result()
        progress.close()
        self.tracker.finish()
        return last_metrics

    def _loader_batches(self) -> Iterator[DataProto]:
        """Loader batches over at most trainer.total_epochs passes (the sync loop's order)."""
        for _ in range(self.config.trainer.total_epochs):
            for batch_dict in self.train_dataloader:
                yield DataProto.from_single_dict(batch_dict)

    def _admit(self, loader: Iterator[DataProto], in_flight: deque[InFlight]) -> None:
        """Submit batches until 1 + lookahead are in flight, never more than the steps left to train."""
        while len(in_flight) <= self.lookahead and self.global_step + len(in_flight) < self.total_training_steps:
            batch = next(loader, None)
            if batch is None:
                return
            batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
            batch, gen_batch = self._generation_inputs(batch.repeat(self.plan.n, interleave=True), validate=False)
            call = self.rollout_wg.submit("generate_sequences", gen_batch)
            in_flight.append(InFlight(call, batch, self.published_version))

    def _staleness(self, batch: DataProto, admitted_version: int) -> dict:
        """The trained samples' staleness metrics; the versions leave the batch, which then is the sync loop's."""
        versions = batch.pop(batch_keys=[VERSIONS_KEY]).batch[VERSIONS_KEY]
        metrics = compute_staleness_metrics(versions, admitted_version, self.global_step)
        if metrics["training/off_policy/trajectory_staleness/max"] > self.max_staleness:
            raise AssertionError(
                f"step {self.global_step} trains samples of staleness "
                f"{metrics['training/off_policy/trajectory_staleness/max']:g} > η={self.max_staleness}"
            )
        return metrics

    def _push_weights(self) -> None:
        """Queue the actor's weights on the rollout pool as version global_step (after the calls queued there)."""
        if self._push is not None:  # the previous push ran before the generation this step trained on
            self._push.result()
        weights = self.actor_rollout_wg.export_weights()
        self._push = self.rollout_wg.submit("load_weights", self.global_step, weights)
        self.published_version = self.global_step
