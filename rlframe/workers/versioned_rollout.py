"""A rollout engine that generates under a policy version and can be cut: what both asynchronous modes' replicas do.

The replicas are the standalone rollout pool's `RolloutWorker`s (`separate_async`) or the training processes' own
hybrid engines (`ActorRolloutRefWorker`, `colocate_async`). Each holds a `VersionedRollout` over its engine:

- its policy version: the number of training steps behind the weights the engine holds (0 = the initial model).
  Every generated response token is stamped with it (`rollout_versions`, -1 on padding), so the driver can tell
  how stale a sample is when it trains on it.
- the cut (`actor_rollout_ref.rollout.partial_rollout`, `rollout/partial.py`): the driver announces a new version on
  a `VersionBoard` (a Ray actor). Each replica's TP rank 0 keeps one call waiting on the board (`newer_than`, on a
  thread of its own), which returns the moment a newer version is announced; a generation running on older weights
  reads that answer at its next decoding step (no call per step) and stops; the rows it cut come back `Stop.INTERRUPTED`
  (the engine's own stop reason), and `continue_rows` later finishes them under the new weights. A tool agent's
  trajectory is cut inside a turn (the same interrupt) or between turns (its next generation request finds the
  interrupt set and generates nothing); it comes back with its state (`TRAJECTORY_KEY`) and continues from it.
  An OpenAI agent's episode cannot come back (it lives in the agent's coroutine): on the rollout pool the board
  also holds the announced weights (an object-store reference), and the endpoint's server loads them itself
  (`catch_up`) and continues the cut requests in the same call (`RolloutServer.continue_cuts`).
- the sampling seeds: one draw of the process RNG per generate call, then the rows' sample seeds under it, exactly
  as `generate_in_tp_group` draws them with TP 1, so a replica samples the tokens the synchronous hybrid engine
  would for the same sequence of calls. Each row's seed comes back with it (`sample_seed`), for its continuation.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist

from rlframe.protocol import DataProto
from rlframe.utils.faults import DelayPoints
from rlframe.workers.rollout import generate_in_tp_group, run_in_tp_group
from rlframe.workers.rollout.base import (
    TRAJECTORY_KEY,
    VERSIONS_KEY,
    Rollout,
    response_metrics,
)
from rlframe.workers.rollout.partial import continue_generation
from rlframe.workers.rollout.tp import group_rank_and_size
from rlframe.workers.weight_sync import load_rollout_weights


class VersionBoard:
    """The newest policy version the driver has announced to the replicas (an asyncio Ray actor of its own), and on
    the rollout pool its weights: `[ref]`, the object-store reference the push loads (a list, so that Ray passes it
    unresolved). With `keep_previous` it also keeps the version before (`weights_of`), one more copy of the weights
    in the object store: a TP replica's peers load the version their leader caught up to, which a push may already
    have followed."""

    def __init__(self, keep_previous: bool = False):
        self.version, self.weights = 0, None
        self.keep_previous = keep_previous
        self._previous: tuple[int, list | None] = (-1, None)
        self._announced = None  # an asyncio.Event, made in the actor's event loop

    def _event(self):
        import asyncio

        if self._announced is None:
            self._announced = asyncio.Event()
        return self._announced

    async def announce(self, version: int, weights: list | None = None) -> None:
        if int(version) >= self.version:
            if int(version) > self.version and self.keep_previous:
                self._previous = (self.version, self.weights)
            self.version, self.weights = int(version), weights  # no weights: nothing a replica could load
            event, self._announced = self._event(), None
            event.set()  # wakes every `newer_than` waiting

    async def newer_than(self, version: int) -> int:
        """The announced version, once it is newer than `version` (at once if it is already)."""
        while self.version <= int(version):
            await self._event().wait()
        return self.version

    def announced_weights(self) -> tuple[int, list | None]:
        return self.version, self.weights

    def weights_of(self, version: int) -> list | None:
        """The weights announced as `version`, if it is the newest version (or, kept, the one before)."""
        for held, weights in ((self.version, self.weights), self._previous):
            if held == int(version):
                return weights
        return None


class VersionedRollout:
    """One replica's engine with its policy version, the board that cuts it, and its stamped generation."""

    def __init__(self, rollout: Rollout, tp_group=None):
        self.rollout, self.engine = rollout, rollout.unwrapped  # the engine, under rollout.mode=async's agent loops
        self.tp_group = tp_group  # a replica's TP group: its ranks generate, cut and continue together
        self.version = 0
        self.delay_points = DelayPoints()  # tests: RLFRAME_DELAY_AT=rollout.decode:… (utils/faults.py)
        self._board = None
        self._announced = 0  # the newest version the board announced, as the watching thread last heard
        self.caught_up = -1  # the newest version `catch_up` loaded (its push, queued behind the call, is skipped)

    def watch(self, board) -> None:
        """Stop a generation once `board` (a VersionBoard actor) announces a version newer than the engine's. TP rank 0
        listens on a thread of its own; its TP peers get its answer at each question (`_weights_moved_on`)."""
        self._board = board
        self.engine.interrupt = self._weights_moved_on
        if group_rank_and_size(self.tp_group)[0] == 0:
            threading.Thread(target=self._listen, name="version-board", daemon=True).start()

    def _listen(self) -> None:
        """Hold one call on the board at a time; each answer is the newest announced version."""
        import ray

        try:
            while True:
                self._announced = ray.get(self._board.newer_than.remote(self._announced))
        except Exception:  # noqa: BLE001 - the board is gone: the run is ending; nothing more will be announced
            return

    def catch_up(self, version: int | None = None) -> int:
        """Load the newest weights the board announced (a TP peer: `version`'s, the one its leader loaded), if newer
        than the engine's; return the engine's version. The rollout pool's replicas only: there the announcement
        carries the pushed weights."""
        import ray

        if version is None:
            version, weights = ray.get(self._board.announced_weights.remote())
        else:
            weights = ray.get(self._board.weights_of.remote(version))
        if version > self.version:
            if weights is None:
                raise RuntimeError(
                    f"policy version {version}'s weights are not on the board (announced without them, or two pushes "
                    "ago): nothing to catch up"
                )
            load_rollout_weights(self.rollout, ray.get(weights[0]))
            self.version = self.caught_up = version
        return self.version

    def _weights_moved_on(self) -> bool:
        """Whether a version newer than the engine's was announced (as the listening thread last heard).

        With TP the engine asks at the same decoding steps on every TP rank (identical input), and all must stop at
        the same one or the next all-reduce hangs: TP rank 0 answers from what it heard and broadcasts its answer."""
        self.delay_points.hit("rollout.decode")  # tests: a slower decoding step, so that cuts land mid-generation
        _, size = group_rank_and_size(self.tp_group)
        moved_on = torch.tensor([int(self._announced > self.version)])
        if size > 1:
            dist.broadcast(moved_on, group_src=0, group=self.tp_group)
        return bool(moved_on.item())

    def generate(self, prompts: DataProto) -> DataProto:
        """Generate the rows on the CPU side with the engine's policy version (`policy_version`): the rollout stamps
        each response token with it (`rollout_versions`) and reports why each row stopped (`stop_reason`). The seeds
        are `generate_in_tp_group`'s (one per call from TP rank 0, with the replica's index), and each row keeps its
        sample seed for its continuation."""
        prompts.meta_info["policy_version"] = self.version
        return generate_in_tp_group(self.rollout, prompts, self.tp_group, keep_seeds=True).to("cpu")

    @contextlib.contextmanager
    def uncut(self):
        """Generation inside never stops for newer weights: every token comes from the weights loaded now (ReMax's
        greedy baselines, generated whole by their group's admission version; `PooledSource._remax_baselines`)."""
        interrupt, self.engine.interrupt = self.engine.interrupt, None
        try:
            yield
        finally:
            self.engine.interrupt = interrupt

    def _continue(self, rows: DataProto) -> DataProto:
        if self.rollout.runs_trajectories:
            return self.rollout.continue_trajectories(rows, list(rows.non_tensor_batch[TRAJECTORY_KEY]))
        return continue_generation(self.engine, rows, self.version)

    def continue_rows(self, rows: DataProto) -> DataProto:
        """Finish rows a cut stopped: their new tokens carry this engine's version. A single-turn row goes on from its
        tokens (`rollout/partial.py`); a tool agent's trajectory from its state (`TRAJECTORY_KEY`, `multi_turn.py`),
        whose tool calls already ran are never run again. The replica's TP peers continue them too."""
        start = time.perf_counter()
        rows.meta_info["policy_version"] = self.version
        with torch.no_grad():
            _, output = run_in_tp_group(self._continue, rows, self.tp_group)
        output = output.to("cpu")
        elapsed = time.perf_counter() - start
        eos_ids, _ = self.rollout.special_tokens_for(rows.meta_info)
        metrics = {**output.meta_info.get("metrics", {})}
        metrics.update(response_metrics(output.batch["response_mask"], output.batch["responses"], eos_ids))
        new_tokens = int((output.batch[VERSIONS_KEY] == self.version).sum())
        metrics.update({"timing_s/generate": elapsed, "perf/rollout_tokens_per_s": new_tokens / max(elapsed, 1e-9)})
        output.meta_info = {"metrics": metrics}
        return output
