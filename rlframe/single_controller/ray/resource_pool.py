"""RayResourcePool: processes per node × nodes, reserved as one placement group per node."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

logger = logging.getLogger(__name__)


class ClusterTooSmallError(ValueError):
    """The alive nodes cannot hold the pool's processes (after waiting `node_wait_s` for nodes to join)."""


class RayResourcePool:
    """Reserve `process_on_nodes[i]` process slots on node i (one STRICT_PACK placement group each).

    Each slot is a bundle of `num_cpus_per_process` CPUs plus one GPU when `use_gpu`, taken by
    one worker process (roles that share a process: `create_colocated_worker_cls`). The
    cluster's capacity is checked before any placement group is created, so an impossible
    request fails at once, naming both sides; with `node_wait_s` it fails only when the alive
    nodes still cannot hold it that many seconds later (a lost node being replaced), also when
    nodes die while the placement groups wait.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = False,
        num_cpus_per_process: float = 1.0,
        ready_timeout_s: float = 120.0,
        node_wait_s: float = 0.0,
    ):
        process_on_nodes = list(process_on_nodes)
        if not process_on_nodes or any(not isinstance(n, int) or n < 1 for n in process_on_nodes):
            raise ValueError(
                f"process_on_nodes must be a non-empty list of positive ints (processes per node), "
                f"got {process_on_nodes!r}"
            )
        if num_cpus_per_process <= 0:
            raise ValueError(f"num_cpus_per_process must be > 0, got {num_cpus_per_process}")
        if node_wait_s < 0:
            raise ValueError(f"node_wait_s must be >= 0, got {node_wait_s}")
        self.process_on_nodes = process_on_nodes
        self.use_gpu = use_gpu
        self.num_cpus_per_process = float(num_cpus_per_process)
        self.ready_timeout_s = ready_timeout_s
        self.node_wait_s = float(node_wait_s)
        self._pgs: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict[str, float]:
        """Resources reserved per process slot."""
        return {"CPU": self.num_cpus_per_process, **({"GPU": 1.0} if self.use_gpu else {})}

    def actor_resources(self) -> dict[str, float]:
        """Ray actor options for the one worker process of a slot: the whole bundle."""
        return {"num_cpus": self.num_cpus_per_process, "num_gpus": 1 if self.use_gpu else 0}

    def placement_groups(self) -> list[PlacementGroup]:
        """The pool's placement groups, one per node, created and ready on first use."""
        if self._pgs is None:
            node_deadline = time.monotonic() + self.node_wait_s
            self._wait_for_capacity(node_deadline)
            pgs = [
                placement_group(
                    [dict(self.bundle) for _ in range(count)],
                    strategy="STRICT_PACK",
                    name=f"rlframe_pg{i}_{id(self):x}",
                )
                for i, count in enumerate(self.process_on_nodes)
            ]
            try:
                self._wait_until_ready(pgs, node_deadline)
            except BaseException:
                for pg in pgs:
                    remove_placement_group(pg)
                raise
            self._pgs = pgs
        return self._pgs

    def _wait_for_capacity(self, node_deadline: float) -> None:
        """Return once the alive nodes can hold the pool; raise if they still cannot at `node_deadline`."""
        warned = False
        while (shortfall := self._shortfall()) is not None:
            warned = self._wait_for_nodes(shortfall, node_deadline, warned)
            time.sleep(1.0)

    def _wait_until_ready(self, pgs: list[PlacementGroup], node_deadline: float) -> None:
        """Wait for the placement groups; fail when nodes died under them, or when other work holds them.

        A node that died abruptly counts as alive in `ray.nodes()` until Ray's health checks give up on
        it (about 15 s by default), so the capacity check can pass and a group stay pending on it.
        """
        ready_deadline = time.monotonic() + self.ready_timeout_s
        refs = [pg.ready() for pg in pgs]
        warned = False
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            if len(ready) == len(refs):
                return
            shortfall = self._shortfall()
            if shortfall is not None:
                warned = self._wait_for_nodes(shortfall, node_deadline, warned)
            elif time.monotonic() >= ready_deadline:
                raise RuntimeError(
                    f"{self!r}: placement groups not ready after {self.ready_timeout_s:g}s; the "
                    f"cluster has room in total but other work holds it. Available now: "
                    f"{_resources_text(ray.available_resources())}"
                )

    def _wait_for_nodes(self, shortfall: str, node_deadline: float, warned: bool) -> bool:
        """Fail once `node_deadline` has passed; else say once that it waits. Returns whether it has said so."""
        if time.monotonic() >= node_deadline:
            waited = f" (waited {self.node_wait_s:g}s for nodes to join)" if self.node_wait_s else ""
            raise ClusterTooSmallError(shortfall + waited)
        if not warned:
            logger.warning("%s Waiting up to %gs for nodes to join.", shortfall, self.node_wait_s)
        return True

    def remove(self) -> None:
        """Release the reserved resources (kill the pool's worker groups first)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None

    def _shortfall(self) -> str | None:
        """Why the per-node requests do not pack onto the alive nodes (first-fit decreasing); None if they do."""
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        slots = [self._slots_on(node["Resources"]) for node in nodes]
        free = list(slots)
        for count in sorted(self.process_on_nodes, reverse=True):
            fitting = [i for i, n in enumerate(free) if n >= count]
            if not fitting:
                described = "; ".join(
                    f"{node['NodeManagerAddress']} (node {node['NodeID'][:8]}): {_resources_text(node['Resources'])} "
                    f"(room for {n} processes)"
                    for node, n in zip(nodes, slots)
                )
                return (
                    f"{self!r} asks for {len(self.process_on_nodes)} node(s) × {self.process_on_nodes} processes "
                    f"with {self.bundle} each, but the Ray cluster has {len(nodes)} alive node(s): {described}. "
                    f"Ask for fewer processes per node or nodes, lower num_cpus_per_process, or add nodes."
                )
            best = min(fitting, key=lambda i: free[i])
            free[best] -= count
        return None

    def _slots_on(self, resources: dict) -> int:
        slots = math.floor(resources.get("CPU", 0.0) / self.num_cpus_per_process + 1e-9)
        if self.use_gpu:
            slots = min(slots, math.floor(resources.get("GPU", 0.0) + 1e-9))
        return slots

    def __repr__(self) -> str:
        return (
            f"RayResourcePool(process_on_nodes={self.process_on_nodes}, use_gpu={self.use_gpu}, "
            f"num_cpus_per_process={self.num_cpus_per_process:g})"
        )


def _resources_text(resources: dict) -> str:
    keys = [k for k in ("CPU", "GPU") if k in resources] or ["CPU"]
    return ", ".join(f"{k}={resources.get(k, 0):g}" for k in keys)
