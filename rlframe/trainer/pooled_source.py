"""PooledSource: the asynchronous trainer modes, streaming groups through rollout replicas.

Where the replicas are, how weights reach them and when their generation is cut is `Replicas`' (`replicas.py`):
the rollout pool of `separate_async`, or the training processes' own engines under `colocate_async`. Below, the
rollout pool's case (`WorkerGroups.rollout`, `RolloutWorker`s), which generates while the training pool trains.
The driver admits prompt groups as the staleness core allows (`GroupLedger`: AReaL's rule, at most (L + 1) · B groups
generating or finished-but-untrained, L = min(num_warmup_batches, η), η = max_off_policy_threshold - 1) and sends
them in chunks of ⌈B / replicas⌉ groups to the replica with the fewest calls queued. A step starts when the ledger
says `Take`: the B finished groups with the oldest admission version. Finished groups older than η are evicted
(`drop`, or `regenerate` their prompts) and `wait` holds the step for older running groups instead. The trainer's
loop trains the step as any other (`rollout_stage.py`), then the source exports the actor's weights and queues them
on every replica as version `global_step`; Ray runs an actor's calls in submission order, so a generation already
queued finishes with the weights it started with and the next one starts with the new ones.

With `actor_rollout_ref.rollout.partial_rollout` (the default), a push first announces the new version on a
`VersionBoard`: the generations running on older weights stop at their next decoding step, and the rows they cut
are sent again as continuations (`rollout/partial.py`), which run after the new weights on every replica. A group is
finished when all its rows are; its admission version still bounds its staleness, so every token of a trained
sample is at most η versions old.

Under `colocate_async` the same schedule runs on the hybrid engines: a step's batch taken, the version is
announced at once (verl's abort at the sample's end), so what runs ahead is cut before the step trains on the same
devices; the push is the hybrid weight sync, and the cut rows continue after it.

With η = 0 the schedule is the sync loop's, with generation moved to the other pool (docs/async.md draws the
timelines).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlframe.protocol import DataProto
from rlframe.trainer.config import lookahead, staleness_bound
from rlframe.trainer.dynamic_sampling import DynamicSampler
from rlframe.trainer.finished_groups import FinishedGroup, check_rollout_n
from rlframe.trainer.metrics import compute_staleness_metrics, reduce_metrics
from rlframe.trainer.replicas import Replicas
from rlframe.trainer.rollout_stage import (
    BatchSource,
    SourceInputs,
    StepBatch,
    assign_uids,
    generation_inputs,
    greedy_inputs,
    merged_metrics,
    timer,
)
from rlframe.trainer.staleness import Evict, GroupLedger, Take
from rlframe.workers.rollout.base import SEED_KEY, STOP_KEY, TRAJECTORY_KEY, VERSIONS_KEY
from rlframe.workers.rollout.partial import interrupted

ADMITTED_KEY = "admitted_version"  # each row's group's admission version, from its take until its step's metrics

if TYPE_CHECKING:  # Ray is imported only when the groups are created
    from collections.abc import Iterator

    from rlframe.single_controller.ray import PendingCall


@dataclass
class Chunk:
    """Rows generating in one call on one replica: the call, the rows' fields the rollout does not see (their
    batch without prompts), and each row's slot: (group id, sample index in the group)."""

    call: PendingCall
    replica: int
    batch: DataProto
    slots: list[tuple[int, int]]
    meta_info: dict  # the call's sampling settings, which a continuation of its rows keeps
    baseline: bool = False  # ReMax: the greedy baseline rows of its groups (slots (group id, 0)), never cut


class PooledSource(BatchSource):
    """The asynchronous modes: the next groups generate on `replicas` ahead of the steps that train them."""

    def __init__(self, inputs: SourceInputs, replicas: Replicas, total_steps: int):
        config, plan = inputs.config, inputs.plan
        self.rollout_cfg, self.plan, self.total_steps = config.actor_rollout_ref.rollout, plan, total_steps
        self.config_mode = f"trainer.v1.trainer_mode={config.trainer.v1.trainer_mode}"
        self.loader, self.pending, self.scorer = inputs.loader, inputs.pending, inputs.scorer
        self.sampler = DynamicSampler.of(config, plan)  # DAPO's: a round is one take of B finished groups
        self.remax = config.algorithm.adv_estimator == "remax"
        self.total_epochs = int(config.trainer.total_epochs)
        self.replicas = replicas
        v1 = config.trainer.v1
        batch_groups = plan.train_batch_size
        self.ledger = GroupLedger(batch_groups, staleness_bound(v1), lookahead(v1), v1.sampler.max_off_policy_strategy)
        self.groups_per_call = math.ceil(batch_groups / len(replicas.views))
        self.published_version = 0  # the weights the rollout pool generates with once its queued calls have run
        self._push: PendingCall | None = None
        self._prompt_of: dict[int, DataProto] = {}  # group id -> its prompt (to regenerate it)
        self._rows: dict[int, DataProto] = {}  # group id -> its n generated rows, once finished
        self._samples: dict[int, dict[int, DataProto]] = {}  # group id -> its rows finished so far, by sample index
        self._greedy: dict[int, DataProto] = {}  # ReMax: group id -> its greedy baseline row, until its step
        self._chunks: list[Chunk] = []
        self._take: list[int] = []  # the groups the step under way trains
        self._batches: Iterator[DataProto] | None = None
        if replicas.partial_rollout:  # a push announces its version first on a VersionBoard actor
            import ray

            from rlframe.workers.versioned_rollout import VersionBoard

            # an OpenAI agent's cut request continues in its call: a TP replica's peers load their leader's version
            tp_catch_up = self.rollout_cfg.agent.default_agent_loop == "openai_agent" and (
                self.rollout_cfg.tensor_model_parallel_size > 1
            )
            replicas.watch(ray.remote(num_cpus=0)(VersionBoard).remote(keep_previous=tp_catch_up))
        self._interrupted = 0  # rows cut by a push since the last step's metrics
        self._gen_metrics: list[dict] = []  # the rollout's metrics of the calls returned since the last step
        self._evicted = {"groups": 0, "spans": [], "tokens": 0}  # since the last step's metrics
        self._rollout_idle_s = 0.0  # reported by the generate calls returned since the last step's metrics
        self._restored_taken = 0  # groups a checkpoint carried finished, in the step's batch

    def check_resumable(self, driver_state: dict) -> None:
        check_rollout_n(driver_state, self.plan.n, self.config_mode)

    def restore_finished(self, groups: list[FinishedGroup]) -> None:
        """The checkpoint's finished groups go back into the ledger, oldest first, with their admission versions:
        the first steps take them as they are (or evict them, past η). ReMax needs each group's greedy baseline,
        which a checkpoint does not keep: its prompts are generated again first."""
        if self.remax:
            self.pending.rows.extendleft(reversed([group.prompt for group in groups]))
            return
        for group in groups:
            gid = self.ledger.restore(group.version)
            self._prompt_of[gid], self._rows[gid] = group.prompt, group.rows

    def start(self, step: int) -> None:
        # an engine started from dummy weights (vLLM's load_format=dummy) takes the actor's before it generates: the
        # first push brings them (with a LoRA adapter engine, the base weights, which later pushes leave out)
        if step > 0 or self.replicas.start_from_dummy_weights():  # resumed: the replicas start from the checkpoint's
            self._push_weights(step)
        self._batches = self._loader_batches()

    def next_batch(self, step: int) -> StepBatch | None:
        """The B finished groups the ledger takes, scored; with dynamic sampling, the informative groups of as many
        takes as fill the batch (the groups of a take that does not fill it leave the ledger at once, so the pool
        keeps generating; no weights change until this step's update, so what is kept grows no staler)."""
        ready = StepBatch(DataProto())
        while True:
            with timer("gen", ready.timings):  # verl's meaning here: how long training waited for the samples
                take = self._wait_for_batch(step)
            if take is None and self.sampler is not None:  # the data's epochs ran out first, as in the sync loop
                self.sampler.report_data_end()
                return None
            if take is None:  # only an empty pass over the loader leaves nothing to admit and nothing generating
                raise RuntimeError(
                    f"{self.config_mode}: the training loader gave no batch in a whole pass (step {step - 1} of "
                    f"{self.total_steps}); data.train_files holds fewer than data.train_batch_size="
                    f"{self.plan.train_batch_size} prompts?"
                )
            batch = DataProto.concat([self._rows.pop(gid) for gid in take])
            self._restored_taken += len(self.ledger.restored.intersection(take))
            admitted = torch.tensor([self.ledger.finished[gid] for gid in take])
            batch.batch[ADMITTED_KEY] = admitted.repeat_interleave(self.plan.n)
            with timer("reward", ready.timings):
                if self.remax:
                    batch.batch["reward_baselines"] = self._remax_baselines(take, step, ready.metrics)
                extra_info = self.scorer.score(batch, ready.metrics)
            if self.sampler is None:
                break
            with timer("filter_groups", ready.timings):
                full = self.sampler.add(batch, extra_info)
            if full:
                batch, sampling_metrics = self.sampler.take()
                ready.metrics.update(sampling_metrics)
                break
            self._trained(take)  # consumed: its informative groups wait in the sampler, the others are dropped
        self.replicas.sample_end(step)
        self._take = take
        ready.batch = batch
        ready.metrics.update(self._step_async_metrics(batch, step))
        return ready

    def _trained(self, take: list[int]) -> None:
        """These groups leave the ledger (trained, or filtered out): room for new ones."""
        self.ledger.remove(take)
        for gid in take:
            self._prompt_of.pop(gid)

    def after_update(self, step: int, metrics: dict) -> None:
        """The step's groups are trained: push the new weights, then admit (the pool generates during validation)."""
        self._trained(self._take)
        self._take = []
        start = time.perf_counter()
        self._push_weights(step)
        metrics["timing_s/update_weights"] = time.perf_counter() - start
        metrics.update(self.replicas.push_metrics())
        self._admit(step)

    def close(self) -> None:
        if self._push is not None:
            self._push.result()

    def _loader_batches(self) -> Iterator[DataProto]:
        """The loader's batches, pass after pass while steps remain (as the sync loop reads it; a resumed run
        continues the pass it was in). Dynamic sampling reads trainer.total_epochs passes, as the sync loop does."""
        passes, empty_before = 0, False
        while True:
            empty = True
            for batch_dict in self.loader:
                empty = False
                yield DataProto.from_single_dict(batch_dict)
            passes += 1
            # a run resumed at an epoch's end first reads that epoch's empty rest
            if (empty and empty_before) or (self.sampler is not None and passes >= self.total_epochs):
                return
            empty_before = empty

    def _wait_for_batch(self, step: int) -> list[int] | None:
        """Admit, evict and collect generations until the ledger gives the next step's groups (None: the loader
        is empty)."""
        while True:
            self._admit(step - 1)
            decision = self.ledger.decide(step)
            if isinstance(decision, Take):
                return decision.groups
            if isinstance(decision, Evict):
                self._evict(decision.groups, step)
            elif self._chunks:
                self._collect()
            else:  # nothing generating, nothing left to admit
                return None

    def _admit(self, trained_steps: int) -> None:
        """Start as many groups as the ledger has room for and the remaining steps need, a chunk per call."""
        steps_left = self.total_steps - trained_steps
        while True:
            wanted = min(self.ledger.room(), steps_left * self.plan.train_batch_size - self.ledger.in_flight)
            prompts = self._next_prompts(min(wanted, self.groups_per_call))
            if not prompts:
                return
            gids = [self.ledger.admit(self.published_version) for _ in prompts]
            self._prompt_of.update(zip(gids, prompts))
            batch = DataProto.concat(prompts)
            assign_uids(batch)
            replica = None
            if self.remax:  # the greedy baselines first, on the replica of the samples (`_remax_baselines`)
                greedy, gen_greedy = greedy_inputs(batch, self.rollout_cfg)
                replica = self._submit("generate_whole", gen_greedy, greedy, [(gid, 0) for gid in gids], baseline=True)
            batch, gen_batch = generation_inputs(
                batch.repeat(self.plan.n, interleave=True), self.rollout_cfg, validate=False
            )
            slots = [(gid, j) for gid in gids for j in range(self.plan.n)]
            self._submit("generate_sequences", gen_batch, batch, slots, replica=replica)

    def _submit(
        self,
        method: str,
        rollout_rows: DataProto,
        batch: DataProto,
        slots: list[tuple[int, int]],
        replica: int | None = None,
        baseline: bool = False,
    ) -> int:
        """Send rows to `replica` (default: the one with the fewest calls queued); returns the replica."""
        if replica is None:
            replica = min(range(len(self.replicas.views)), key=lambda r: sum(c.replica == r for c in self._chunks))
        call = self.replicas.views[replica].submit(method, rollout_rows)
        self._chunks.append(Chunk(call, replica, batch, slots, dict(rollout_rows.meta_info), baseline))
        return replica

    def _next_prompts(self, count: int) -> list[DataProto]:
        """Up to `count` prompts: the waiting ones first (regenerated, or restored from a checkpoint), then the
        loader's, a whole loader batch taken into the queue at a time."""
        while len(self.pending.rows) < count:
            batch = next(self._batches, None)
            if batch is None:
                break
            self.pending.rows.extend(batch.split(1))
        return [self.pending.rows.popleft() for _ in range(min(count, len(self.pending.rows)))]

    def _collect(self, chunk: Chunk | None = None) -> None:
        """Wait for `chunk` (default: the first call to come back): its cut rows go out again as continuations, and
        a group whose n rows are all back becomes finished."""
        from rlframe.single_controller.ray import wait_any

        if chunk is None:
            call = wait_any([chunk.call for chunk in self._chunks])
            chunk = next(c for c in self._chunks if c.call is call)
        self._chunks.remove(chunk)
        output = chunk.call.result()
        metrics = output.meta_info.pop("metrics", {})
        self._rollout_idle_s += output.meta_info.pop("idle_s", 0.0)  # a rollout pool's processes report it
        output.meta_info = {}
        if chunk.baseline:  # ReMax's greedy rows wait for their step; their metrics are not the step's (as in sync)
            rows = chunk.batch.union(output)
            self._greedy.update((gid, rows.select_idxs([i])) for i, (gid, _) in enumerate(chunk.slots))
            return
        self._gen_metrics.append(metrics)
        cut = interrupted(output)  # the engine's own stop reasons: only interrupted rows go on
        output.pop(batch_keys=[STOP_KEY])
        again = torch.nonzero(cut).flatten()
        fields = chunk.batch.select_idxs(again)  # before the union below adds the generated keys to chunk.batch
        rows = chunk.batch.union(output)
        if len(again):
            self._interrupted += len(again)
            resend = rows.select_idxs(again)
            resend.meta_info = dict(chunk.meta_info)
            self._submit("continue_sequences", resend, fields, [chunk.slots[i] for i in again])
        rows.pop(non_tensor_batch_keys=[SEED_KEY])
        rows.non_tensor_batch.pop(TRAJECTORY_KEY, None)  # a tool agent's: only a cut row's state is kept (resent)
        returned: dict[int, list[tuple[int, int]]] = {}  # group id -> (sample index, row) of its rows back now
        for i in torch.nonzero(~cut).flatten().tolist():
            gid, j = chunk.slots[i]
            returned.setdefault(gid, []).append((j, i))
        for gid, members in returned.items():
            members.sort()
            if len(members) == self.plan.n:  # the whole group came back in this call: one selection
                self._finish(gid, rows.select_idxs([i for _, i in members]))
                continue
            samples = self._samples.setdefault(gid, {})
            samples.update(zip((j for j, _ in members), rows.select_idxs([i for _, i in members]).split(1)))
            if len(samples) == self.plan.n:
                self._finish(gid, DataProto.concat([samples[k] for k in range(self.plan.n)]))

    def _finish(self, gid: int, rows: DataProto) -> None:
        """Group `gid`'s n rows, in sample order, are all generated."""
        self._samples.pop(gid, None)
        self._rows[gid] = rows
        self.ledger.finish(gid)

    def _evict(self, groups: list[int], step: int) -> None:
        """Finished groups past η: never trained; under `regenerate` their prompts are admitted again first."""
        self._evicted["groups"] += len(groups)
        self._evicted["spans"] += [self.ledger.staleness(gid, step) + 1 for gid in groups]  # verl's span
        for gid in groups:
            self._evicted["tokens"] += int(self._rows.pop(gid).batch["response_mask"].sum())
            self._greedy.pop(gid, None)
        self.ledger.remove(groups)
        prompts = [self._prompt_of.pop(gid) for gid in groups]
        if self.ledger.strategy != "drop":  # under wait, only restored groups are evicted: regenerated
            self.pending.rows.extendleft(reversed(prompts))

    def _remax_baselines(self, take: list[int], step: int, metrics: dict) -> torch.Tensor:
        """ReMax: the scores of the taken groups' greedy rows, repeated over each group's n samples.

        The rule: a group's baseline is generated whole by the weights of its admission version, the version its
        samples start from and that bounds their staleness. Its greedy call goes to the samples' replica just before
        them (`generate_whole`: a push never cuts it, and the pushed weights load after it), so its rows carry that
        version; with partial rollout a sample cut by a push continues on newer weights, its baseline does not.
        """
        greedy = DataProto.concat([self._greedy.pop(gid) for gid in take])
        greedy.pop(non_tensor_batch_keys=[SEED_KEY])
        greedy.non_tensor_batch.pop(TRAJECTORY_KEY, None)
        versions = greedy.pop(batch_keys=[VERSIONS_KEY, STOP_KEY]).batch[VERSIONS_KEY].max(-1).values
        admitted = torch.tensor([self.ledger.finished[gid] for gid in take], dtype=versions.dtype)
        versions = torch.where(versions < 0, admitted, versions)  # a response with no token: its call's version
        if not torch.equal(versions, admitted):
            raise AssertionError(f"step {step}: ReMax baselines of versions {versions.tolist()}, admitted {admitted}")
        staleness = (step - 1 - versions).float()
        metrics["async/remax_baseline_staleness/max"] = float(staleness.max())
        metrics["async/remax_baseline_staleness/min"] = float(staleness.min())
        return self.scorer.baseline_scores(greedy).repeat_interleave(self.plan.n)

    def _step_async_metrics(self, batch: DataProto, step: int) -> dict:
        """The step's staleness (checked against η), evictions, occupancy and rollout metrics; the versions
        leave the batch, which then is the sync loop's."""
        versions = batch.pop(batch_keys=[VERSIONS_KEY, ADMITTED_KEY]).batch
        metrics = compute_staleness_metrics(versions[VERSIONS_KEY], versions[ADMITTED_KEY], step)
        worst = metrics["training/off_policy/trajectory_staleness_worst/max"]  # from each sample's oldest token
        if worst > self.ledger.max_staleness:
            raise AssertionError(f"step {step} trains tokens of staleness {worst:g} > η={self.ledger.max_staleness}")
        metrics.update(reduce_metrics(merged_metrics(self._gen_metrics)))
        self._gen_metrics.clear()
        evicted = self._evicted
        metrics["training/off_policy/evicted_samples"] = evicted["groups"]
        if evicted["spans"]:
            metrics["training/off_policy/evicted_samples_staleness/mean"] = float(np.mean(evicted["spans"]))
            metrics["training/off_policy/evicted_samples_staleness/max"] = float(max(evicted["spans"]))
        metrics["async/tokens_never_trained"] = evicted["tokens"]
        self._evicted = {"groups": 0, "spans": [], "tokens": 0}
        # generating or finished on the rollout pool's side while this step trains, and the most at any time
        metrics["async/in_flight_groups"] = self.ledger.in_flight - len(self._take)
        metrics["async/in_flight_groups/max"] = self.ledger.peak_in_flight
        self.ledger.peak_in_flight = self.ledger.in_flight
        if self.replicas.own_processes:  # colocate_async's engines are the training processes: never idle
            metrics["async/rollout_pool/idle_s"] = self._rollout_idle_s
        self._rollout_idle_s = 0.0
        metrics["async/interrupted_samples"] = self._interrupted  # cut by a push and continued, since the last step
        self._interrupted = 0
        metrics["async/restored_groups"] = self._restored_taken  # a checkpoint's finished groups, not generated again
        self._restored_taken = 0
        return metrics

    def finished_groups(self) -> list[FinishedGroup]:
        """The groups finished and not trained, oldest first: the checkpoint keeps them whole. ReMax's are not kept
        (their greedy baselines are not saved): their prompts are generated again."""
        if self.remax:
            return []
        return [FinishedGroup(self.ledger.finished[g], self._prompt_of[g], self._rows[g]) for g in self._kept()]

    def untrained_prompts(self) -> list[DataProto]:
        """The groups generating (their rows are not saved: a resumed run generates them again, at its own version),
        then the prompts waiting for room. The loader's own state is past all of them."""
        kept = set(self._kept()) if not self.remax else set()
        return [self._prompt_of[g] for g in sorted(self._prompt_of) if g not in kept] + list(self.pending.rows)

    def _kept(self) -> list[int]:
        """The finished groups not trained yet (between steps, the step's take has left the ledger)."""
        return sorted(g for g in self.ledger.finished if g not in self._take)

    def _push_weights(self, step: int) -> None:
        """Queue the actor's weights on the replicas as version `step` (after the calls queued there). With
        partial rollout the version is announced first, and the calls submitted before it are collected after."""
        if self._push is not None:  # the previous push ran before the generation this step trained on
            self._push.result()
        self._push = self.replicas.publish(step)
        self.published_version = step
        if self.replicas.partial_rollout and step < self.total_steps:
            # every call queued before the weights returns at its next decoding step (or at once, not started), so
            # the cut rows are sent again now: their continuations run first on the new weights, before any group
            # admitted after this push, which would otherwise overtake them and leave them to go stale
            for chunk in list(self._chunks):
                self._collect(chunk)
