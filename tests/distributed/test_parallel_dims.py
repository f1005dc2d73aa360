"""`ParallelDims.build` makes, from the batch plan's `ParallelPlan`, the process groups the plan describes.

One job on the session's four-process gloo world (tests/helpers/world.py) builds the groups of two layouts and
returns each rank's view of them: the sizes must be the plan's degrees and the TP and Ulysses groups consecutive
ranks (the layout vLLM's and SGLang's TP groups and `_sp_and_dp`'s arithmetic assume).
"""

import torch.distributed as dist
from helpers.small_config import SMALL
from helpers.world import spawned_world

from rlframe.batch_plan import make_batch_plan
from rlframe.distributed.parallel_dims import ParallelDims, ParallelPlan
from rlframe.trainer.config import compose


def _ranks(group) -> list[int] | None:
    return None if group is None else [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def _groups_of(rank: int, plans: list[ParallelPlan]) -> list[dict]:
    views = []
    for plan in plans:
        dims = ParallelDims.build(plan, "cpu")
        views.append(
            {
                "dp": _ranks(dims.dp_group),
                "sp": _ranks(dims.sp_group),
                "tp": _ranks(dims.tp_group),
                "pool": _ranks(dims.pool_group),
                "fsdp_shape": tuple(dims.fsdp_mesh.shape),
                "sizes": (dims.dp_size, dims.sp_size),
            }
        )
    return views


def test_build_makes_the_groups_the_plan_describes():
    overrides = [
        *SMALL,
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "algorithm.adv_estimator=gae",
        "critic.ppo_mini_batch_size=4",
    ]
    plan = make_batch_plan(compose(overrides), rollout_pools=True)
    actor, critic = plan.actor_parallel, plan.critic_parallel
    assert (actor.sp_size, actor.dp_size, actor.fsdp_size, actor.tp_size) == (2, 2, 2, 2)
    assert not actor.pools_generation  # TP 2: no pooling
    assert (critic.sp_size, critic.fsdp_size, critic.tp_size) == (1, 4, 1)
    pooled = ParallelPlan(world_size=4, pools_generation=True)
    views = spawned_world(4).run(_groups_of, [actor, critic, pooled])
    for rank, (a, c, p) in enumerate(views):
        pair = [rank - rank % 2, rank - rank % 2 + 1]  # consecutive ranks
        assert a == {"dp": [rank % 2, rank % 2 + 2], "sp": pair, "tp": pair, "pool": None, "fsdp_shape": (2, 2),
                     "sizes": (2, 2)}  # fmt: skip
        assert c == {"dp": [0, 1, 2, 3], "sp": None, "tp": None, "pool": None, "fsdp_shape": (4,), "sizes": (4, 1)}
        assert p["pool"] == [0, 1, 2, 3] and p["tp"] is None
