"""Where the pooled source's groups generate, how new weights reach them, and when running generation is cut.

`PooledSource` (`rlframe/trainer/pooled_source.py`) runs one schedule for both asynchronous trainer modes: the
ledger admits groups, sends them in chunks to the replicas, takes a step's batch, evicts what went stale, and
continues the rows a cut stopped. What differs between the modes is here:

- `PoolReplicas`, `separate_async`: a rollout pool of its own, one replica per TP group of processes. Each step's
  weights are exported by the training pool and pushed through the driver (`checkpoint_engine.backend=naive`), or
  broadcast from the training pool's rank 0 over a process group of their own (`nccl`); with
  `actor_rollout_ref.rollout.partial_rollout` the push cuts what is running (the training pool trained meanwhile, so
  generation overlaps training).
- `HybridReplicas`, `colocate_async`: the training processes' own engines, the whole group one replica (each call
  splits its rows over the ranks). The engines take the actor's weights in place (the hybrid sync, no export),
  and partial rollout is always on: once a step's batch is sampled the generation running ahead is cut at once,
  so the step trains on the same devices without waiting for it, and the cut rows continue on the new weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlframe.single_controller.ray import PendingCall, RayWorkerGroup
    from rlframe.trainer.launch import WorkerGroups


class Replicas(ABC):
    """The engines a pooled source generates on."""

    views: list[RayWorkerGroup]  # one group per replica: a call on it runs on that replica alone
    partial_rollout: bool  # whether running generation is cut when newer weights are announced
    own_processes: bool  # a pool of processes of their own, which report how long they waited for work
    board = None  # partial rollout: the VersionBoard actor every replica watches

    def watch(self, board) -> None:
        """Partial rollout: every replica stops its generation once `board` announces a version newer than its
        weights'."""
        self.board = board
        self._watch_group().watch_versions(board)

    def _announce(self, version: int, weights=None) -> None:
        """`weights`: the object-store reference of the pushed weights, which a replica may load itself
        (`VersionedRollout.catch_up`)."""
        if self.board is not None:
            self.board.announce.remote(version, None if weights is None else [weights])

    def push_metrics(self) -> dict[str, float]:
        """Metrics of the weight pushes (the collective push's last finished broadcast)."""
        return {}

    def sample_end(self, step: int) -> None:
        """Step `step`'s batch is sampled and about to train."""

    def start_from_dummy_weights(self) -> bool:
        """Whether the engines wait for the actor's weights before they may generate (a first push brings them)."""
        return False

    @abstractmethod
    def _watch_group(self) -> RayWorkerGroup:
        """The worker group whose processes hold the replicas' engines."""

    @abstractmethod
    def publish(self, version: int) -> PendingCall:
        """Queue the actor's current weights on every replica as policy version `version`, after the calls
        queued there; with partial rollout, the generations running on older weights are cut first."""


class PoolReplicas(Replicas):
    """separate_async: the rollout pool's processes, their weights pushed from the training pool."""

    own_processes = True

    def __init__(self, groups: WorkerGroups, rollout_cfg):
        """`rollout_cfg`: actor_rollout_ref.rollout (its TP size and partial_rollout)."""
        if groups.rollout is None:
            raise ValueError("trainer.v1.trainer_mode=separate_async needs the rollout pool's worker group")
        self.actor_wg, self.rollout_wg = groups.actor_rollout, groups.rollout
        # a replica is a TP group of consecutive processes (`RolloutWorker`); its calls run on all of them
        self.views = groups.rollout.rank_views(int(rollout_cfg.tensor_model_parallel_size))
        self.partial_rollout = bool(rollout_cfg.partial_rollout)
        self._with_base = False  # whether the next push brings a LoRA adapter engine its base weights
        self.collective = rollout_cfg.checkpoint_engine.backend == "nccl"  # else naive: through Ray's object store
        self._previous_push: tuple[int, float] | None = None  # the collective push's last finished broadcast
        if self.collective:  # the push group forms now, while the rollout pool has no call queued to wait behind
            world = 1 + self.rollout_wg.world_size
            host, port = self.actor_wg.open_weight_push(world)  # rank 0 listens, and joins in its sending thread
            self.rollout_wg.join_weight_push(host, port, world)

    def _watch_group(self) -> RayWorkerGroup:
        return self.rollout_wg

    def push_metrics(self) -> dict[str, float]:
        """backend=nccl: the bytes and seconds of the broadcast before the latest push (the latest is still under
        way when the step's metrics are written), from its first bucket to its last."""
        if self._previous_push is None:
            return {}
        nbytes, seconds = self._previous_push
        return {"async/weight_push/bytes": nbytes, "async/weight_push/broadcast_s": seconds}

    def start_from_dummy_weights(self) -> bool:
        """vLLM's load_format=dummy: the first push brings the actor's weights (with a LoRA adapter engine, the base
        weights, which later pushes leave out)."""
        self._with_base = any(self.rollout_wg.needs_base_weights())
        return self._with_base

    def publish(self, version: int) -> PendingCall:
        if self.collective:
            return self._publish_collective(version)
        import ray

        # one copy in the object store for every replica, and for the board that lets a replica load it itself
        weights = ray.put(self.actor_wg.export_weights(with_base=self._with_base))
        self._with_base = False
        self._announce(version, weights)  # running generations stop now; what they cut continues on these weights
        return self.rollout_wg.submit("load_weights", version, weights)

    def _publish_collective(self, version: int) -> PendingCall:
        """checkpoint_engine.backend=nccl: the training pool's rank 0 broadcasts the weights to every rollout process
        over a group of their own (`rlframe/workers/weight_push.py`), formed at the first push. The call returns once
        rank 0 holds its copy; the receive is queued on the rollout pool after its calls, as the naive load is."""
        self._previous_push = self.actor_wg.push_weights(with_base=self._with_base)
        self._with_base = False
        self._announce(version)
        return self.rollout_wg.submit("receive_weights", version)


class HybridReplicas(Replicas):
    """colocate_async: the training processes' engines, synced in place from the actor they live next to."""

    partial_rollout = True  # verl: colocate_async runs with partial rollout
    own_processes = False

    def __init__(self, groups: WorkerGroups):
        self.actor_wg = groups.actor_rollout
        self.views = [groups.actor_rollout]

    def _watch_group(self) -> RayWorkerGroup:
        return self.actor_wg

    def sample_end(self, step: int) -> None:
        """verl's abort at the sample's end: what generates ahead stops now, before the step trains on these
        devices; its rows continue after the weight sync."""
        self._announce(step)

    def publish(self, version: int) -> PendingCall:
        self._announce(version)  # a resumed run's first sync (a step's end announced it at its sample end)
        return self.actor_wg.submit("sync_rollout_weights", version)
