"""Start (or join) Ray and create the colocated worker groups the trainer drives."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from rlframe.batch_plan import BatchPlan
from rlframe.config.checks import resolve_device


def _num_cpus_for_local_ray(cfg: DictConfig, world_size: int, device_type: str) -> int | None:
    """CPU workers may outnumber cores (tests, laptops): give a local Ray at least one CPU per worker."""
    if cfg.trainer.ray_init.num_cpus is not None:
        return int(cfg.trainer.ray_init.num_cpus)
    if cfg.trainer.ray_init.address is None and device_type == "cpu":
        return max(os.cpu_count() or 1, world_size)
    return None


def create_worker_groups(cfg: DictConfig, plan: BatchPlan, total_training_steps: int) -> tuple[dict, int]:
    """Actor/rollout(/ref), critic and reward model share each worker process; ({role: group}, num_devices)."""
    import ray

    from rlframe.single_controller.ray import (RayClassWithInitArgs, RayResourcePool, RayWorkerGroup,
                                               create_colocated_worker_cls, init_ray)
    from rlframe.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, worker_env
    from rlframe.workers.reward_model import RewardModelWorker

    device_type = resolve_device(cfg.trainer.device)
    started_here = not ray.is_initialized()
    init_ray(address=cfg.trainer.ray_init.address,
             num_cpus=_num_cpus_for_local_ray(cfg, plan.world_size, device_type),
             runtime_env={"env_vars": worker_env()})
    pool = RayResourcePool([int(cfg.trainer.n_gpus_per_node)] * int(cfg.trainer.nnodes),
                           use_gpu=device_type == "cuda")
    config = OmegaConf.to_container(cfg)
    roles = {"actor_rollout": RayClassWithInitArgs(ActorRolloutRefWorker, config, plan, with_ref=plan.ref is not None)}
    if plan.critic is not None:
        roles["critic"] = RayClassWithInitArgs(CriticWorker, config, plan)
    if cfg.reward_model.enable:
        roles["rm"] = RayClassWithInitArgs(RewardModelWorker, config, plan)
    group = RayWorkerGroup(pool, create_colocated_worker_cls(roles),
                           call_timeout_s=float(cfg.trainer.worker_timeout_s))
    groups = group.spawn(list(roles))
    groups["_group"], groups["_pool"], groups["_started_ray"] = group, pool, started_here
    for name in roles:  # in order: the actor's process group is created first
        groups[name].init_model(total_training_steps)
    return groups, plan.world_size


def shutdown(groups: dict) -> None:
    """Kill the workers, free the placement groups, stop Ray if this process started it."""
    import ray

    groups["_group"].shutdown()
    groups["_pool"].remove()
    if groups["_started_ray"]:
        ray.shutdown()
