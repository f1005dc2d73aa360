"""The one owner of a worker's process groups: the batch plan fixes the degrees, `ParallelDims.build` makes the groups.

A worker role on `world` ranks has up to four views of the same processes:

- `fsdp`: the ranks its parameters are sharded over (one dim), or `(ddp, fsdp)` for hybrid sharding (HSDP:
  shard within groups of `fsdp_size`, replicate across them);
- `(dp, sp)`: Ulysses sequence parallelism. The `sp` ranks of a group run the same sequences, each 1/sp of
  every row; the `dp` groups run different sequences, and the loss denominators are summed over `dp`;
- `(dp, tp)` of the rollout: the ranks of one tensor-parallel generation group (consecutive ranks);
- the pool: on CPU without TP, every rank of the machine may hand its prompts to rank 0 (`rollout/pool.py`).

The driver's batch plan computes and checks the degrees of every role once, before Ray starts (a `ParallelPlan`
per worker group, `rlframe.batch_plan`); each worker passes its role's plan to `ParallelDims.build`, which creates
every process group the role uses, in the same order on every rank. Roles then ask the `ParallelDims`
(`dims.dp_group`, `dims.tp_group`, `dims.reduces_over_dp`, ...) instead of carrying groups and sizes positionally.
`ParallelDims.single()` is the plain single-process reference the equivalence tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelPlan:
    """The degrees of one worker group's ranks, checked by the batch plan; `ParallelDims.build` makes its groups."""

    world_size: int
    sp_size: int = 1  # Ulysses degree
    fsdp_size: int = -1  # ranks one parameter is sharded over: world_size (or -1) all, a divisor of it for HSDP
    tp_size: int = 1  # the rollout's tensor-parallel degree (the actor's workers only)
    # the engine may pool CPU generation on rank 0 (it can, TP is 1, more than one rank): offered on CPU only,
    # and taken when `rollout/pool.pools_generation` says so (it needs the weights' size, known after loading)
    pools_generation: bool = False

    @property
    def dp_size(self) -> int:
        """The Ulysses groups: ranks that run different sequences."""
        return self.world_size // self.sp_size


def spans_ranks(group) -> bool:
    """True when a collective over `group` has peers to talk to (an initialized group of more than one rank)."""
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


@dataclass(frozen=True)
class ParallelDims:
    """Degrees and process groups of one role on one rank."""

    dp_size: int = 1
    sp_size: int = 1
    dp_group: Any = None  # None: a single process (or dp = 1 outside a process group)
    sp_group: Any = None  # None: sp = 1
    fsdp_mesh: Any = None  # the mesh FSDP shards over (1-D, or (ddp, fsdp) for HSDP)
    tp_group: Any = None  # the rollout's tensor-parallel group; None: tp = 1
    pool_group: Any = None  # the ranks that may pool CPU generation on their rank 0; None: no pooling

    @classmethod
    def single(cls) -> ParallelDims:
        """One process, no collectives: the reference every parallel layout must equal."""
        return cls()

    @classmethod
    def build(cls, plan: ParallelPlan, device_type: str) -> ParallelDims:
        """Every process group of a role laid out by `plan` (the default process group is up)."""
        from torch.distributed.device_mesh import init_device_mesh

        fsdp_mesh = build_fsdp_mesh(device_type, plan.world_size, plan.fsdp_size)
        sp_mesh = init_device_mesh(device_type, (plan.dp_size, plan.sp_size), mesh_dim_names=("dp", "sp"))
        sp_group = sp_mesh["sp"].get_group() if plan.sp_size > 1 else None
        tp_group = build_tp_group(device_type, plan.world_size, plan.tp_size)
        pool_group = dist.group.WORLD if plan.pools_generation and device_type == "cpu" else None
        return cls(plan.dp_size, plan.sp_size, sp_mesh["dp"].get_group(), sp_group, fsdp_mesh, tp_group, pool_group)

    @property
    def reduces_over_dp(self) -> bool:
        """Loss denominators and metrics must be summed over the DP group (it spans more than this rank)."""
        return spans_ranks(self.dp_group)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if self.reduces_over_dp else 0

    @property
    def sp_rank(self) -> int:
        return dist.get_rank(self.sp_group) if self.sp_group is not None else 0


def build_tp_group(device_type: str, world_size: int, tp_size: int):
    """This rank's rollout TP group: consecutive ranks generate together (None with tp_size 1). A collective."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp_size == 1:
        return None
    shape = (world_size // tp_size, tp_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))["tp"].get_group()


def build_fsdp_mesh(device_type: str, world_size: int, fsdp_size: int):
    """1-D mesh over all ranks (fsdp_size -1 or world size), else (replicas, fsdp_size): hybrid sharding.

    With two dims, FSDP shards within groups of `fsdp_size` ranks and replicates across groups
    (HSDP), keeping the all-gathers inside a node; gradients are averaged over both dims, so the
    math is the same as with one dim. The batch plan has checked that `fsdp_size` divides the world.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if fsdp_size in (-1, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))
