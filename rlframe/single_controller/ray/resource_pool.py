"""RayResourcePool: processes per node × nodes, reserved as one placement group per node."""

from __future__ import annotations

import math
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


class RayResourcePool:
    """Reserve `process_on_nodes[i]` process slots on node i (one STRICT_PACK placement group each).

    Each slot is a bundle of `num_cpus_per_process` CPUs plus one GPU when `use_gpu`, taken by
    one worker process (roles that share a process: `create_colocated_worker_cls`). The
    cluster's capacity is checked before any placement group is created, so an impossible
    request fails at once, naming both sides.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = False,
        num_cpus_per_process: float = 1.0,
        ready_timeout_s: float = 120.0,
    ):
        process_on_nodes = list(process_on_nodes)
        if not process_on_nodes or any(not isinstance(n, int) or n < 1 for n in process_on_nodes):
            raise ValueError(
                f"process_on_nodes must be a non-empty list of positive ints (processes per node), "
                f"got {process_on_nodes!r}"
            )
        if num_cpus_per_process <= 0:
            raise ValueError(f"num_cpus_per_process must be > 0, got {num_cpus_per_process}")
        self.process_on_nodes = process_on_nodes
        self.use_gpu = use_gpu
        self.num_cpus_per_process = float(num_cpus_per_process)
        self.ready_timeout_s = ready_timeout_s
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
            self._check_capacity()
            pgs = [
                placement_group(
                    [dict(self.bundle) for _ in range(count)],
                    strategy="STRICT_PACK",
                    name=f"rlframe_pg{i}_{id(self):x}",
                )
                for i, count in enumerate(self.process_on_nodes)
            ]
            ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s)
            if len(ready) < len(pgs):
                for pg in pgs:
                    remove_placement_group(pg)
                raise RuntimeError(
                    f"{self!r}: placement groups not ready after {self.ready_timeout_s:g}s; the "
                    f"cluster has room in total but other work holds it. Available now: "
                    f"{_resources_text(ray.available_resources())}"
                )
            self._pgs = pgs
        return self._pgs

    def remove(self) -> None:
        """Release the reserved resources (kill the pool's worker groups first)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None

    def _check_capacity(self) -> None:
        """Raise unless the per-node requests pack onto the alive nodes' capacity (first-fit decreasing)."""
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        slots = [self._slots_on(node["Resources"]) for node in nodes]
        free = list(slots)
        for count in sorted(self.process_on_nodes, reverse=True):
            fitting = [i for i, n in enumerate(free) if n >= count]
            if not fitting:
                described = "; ".join(
                    f"{node['NodeManagerAddress']}: {_resources_text(node['Resources'])} (room for {n} processes)"
                    for node, n in zip(nodes, slots)
                )
                raise ValueError(
                    f"{self!r} asks for {len(self.process_on_nodes)} node(s) × {self.process_on_nodes} processes "
                    f"with {self.bundle} each, but the Ray cluster has {len(nodes)} alive node(s): {described}. "
                    f"Ask for fewer processes per node or nodes, lower num_cpus_per_process, or add nodes."
                )
            best = min(fitting, key=lambda i: free[i])
            free[best] -= count

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
