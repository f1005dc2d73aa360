"""The one owner of a worker's device meshes: degrees checked once, named meshes built once, everyone asks it.

A training role on `world` ranks has three views of the same processes:

- `fsdp`: the ranks its parameters are sharded over (one dim), or `(ddp, fsdp)` for hybrid sharding (HSDP:
  shard within groups of `fsdp_size`, replicate across them);
- `(dp, sp)`: Ulysses sequence parallelism. The `sp` ranks of a group run the same sequences, each 1/sp of
  every row; the `dp` groups run different sequences, and the loss denominators are summed over `dp`;
- `(dp, tp)` of the rollout: the ranks of one tensor-parallel generation group.

Roles receive a `ParallelDims` and ask it (`dims.dp_group`, `dims.reduces_over_dp`, ...) instead of carrying
groups and sizes positionally. `ParallelDims.single()` is the plain single-process reference the
equivalence tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


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

    @classmethod
    def single(cls) -> ParallelDims:
        """One process, no collectives: the reference every parallel layout must equal."""
        return cls()

    @classmethod
    def build(cls, device_type: str, world_size: int, sp_size: int, fsdp_size: int = -1) -> ParallelDims:
        """The meshes of a role on `world_size` ranks with Ulysses degree `sp_size` (the process group is up)."""
        from torch.distributed.device_mesh import init_device_mesh

        fsdp_mesh = build_fsdp_mesh(device_type, world_size, fsdp_size)
        dp_size = world_size // sp_size
        sp_mesh = init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
        sp_group = sp_mesh["sp"].get_group() if sp_size > 1 else None
        return cls(dp_size, sp_size, sp_mesh["dp"].get_group(), sp_group, fsdp_mesh)

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


def build_fsdp_mesh(device_type: str, world_size: int, fsdp_size: int, key: str = "fsdp_config.fsdp_size"):
    """1-D mesh over all ranks (fsdp_size -1 or world size), else (replicas, fsdp_size): hybrid sharding.

    With two dims, FSDP shards within groups of `fsdp_size` ranks and replicates across groups
    (HSDP), keeping the all-gathers inside a node; gradients are averaged over both dims, so the
    math is the same as with one dim.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from rlframe.config.checks import check_fsdp_size

    if fsdp_size in (-1, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    check_fsdp_size(fsdp_size, world_size, key)
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def tensor_parallel_group(device_type: str, world_size: int, tp_size: int):
    """The rollout's tensor-parallel group of this rank (None for tp = 1): consecutive ranks generate together."""
    if tp_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return mesh["tp"].get_group()
