"""Start (or join) Ray and create the worker groups the trainer drives: the colocated training group, and under
trainer.v1.trainer_mode=separate_async a rollout group on a resource pool of its own."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from rlframe.batch_plan import BatchPlan
from rlframe.config.checks import resolve_device
from rlframe.config.schema import sections_of
from rlframe.trainer.profiling import nsight_runtime_env
from rlframe.utils.faults import DELAY_ENV

if TYPE_CHECKING:  # Ray is imported only when the groups are created (prepare() runs without it)
    from rlframe.single_controller.ray import RayResourcePool, RayWorkerGroup
    from rlframe.trainer.worker_groups import ActorRolloutGroup, CriticGroup, RewardModelGroup, RolloutGroup


def rollout_pool_size(cfg: DictConfig) -> int:
    """Processes of the standalone rollout pool: actor_rollout_ref.rollout.nnodes × n_gpus_per_node (0 without one)."""
    if cfg.trainer.v1.trainer_mode != "separate_async":
        return 0
    return cfg.actor_rollout_ref.rollout.nnodes * cfg.actor_rollout_ref.rollout.n_gpus_per_node


def _num_cpus_for_local_ray(cfg: DictConfig, world_size: int, device_type: str) -> int | None:
    """CPU workers may outnumber cores (tests, laptops): give a local Ray at least one CPU per worker."""
    if cfg.trainer.ray_init.num_cpus is not None:
        return cfg.trainer.ray_init.num_cpus
    if cfg.trainer.ray_init.address is None and device_type == "cpu":
        return max(os.cpu_count() or 1, world_size)
    return None


@dataclass
class WorkerGroups:
    """The role groups the trainer drives (views of one set of colocated worker processes), and the rollout pool's.

    The private fields are what `shutdown` needs: the group that owns the processes, the placement
    groups' pools, and whether this process started Ray (then it stops it too).
    """

    actor_rollout: ActorRolloutGroup  # actor + rollout (+ reference) in every process
    critic: CriticGroup | None  # None without a critic (e.g. GRPO)
    reward_model: RewardModelGroup | None  # None unless reward_model.enable
    num_devices: int  # worker processes of both pools (one device each)
    _owner: RayWorkerGroup = field(repr=False)
    _pool: RayResourcePool = field(repr=False)
    _started_ray: bool = field(repr=False)
    rollout: RolloutGroup | None = None  # RolloutWorkers on a pool of their own (separate_async), else None
    _rollout_pool: RayResourcePool | None = field(default=None, repr=False)

    def shutdown(self) -> None:
        """Kill the workers, free the placement groups, stop Ray if this process started it."""
        import ray

        if self.rollout is not None:
            self.rollout.shutdown()
        if self._rollout_pool is not None:
            self._rollout_pool.remove()
        self._owner.shutdown()
        self._pool.remove()
        if self._started_ray:
            ray.shutdown()


# Set on the workers unless --verbose: no "Loading weights" bars, transformers' errors only, vLLM's warnings and
# errors only (not its engine configuration at start-up nor a line per weight sync). Errors, tracebacks and anything a
# worker prints still reach the console, prefixed with the worker's rank.
QUIET_WORKER_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def create_worker_groups(
    cfg: DictConfig, plan: BatchPlan, total_training_steps: int, verbose: bool = False, node_wait_s: float = 0.0
) -> WorkerGroups:
    """Actor/rollout(/ref), critic and reward model share each worker process; models are built here.

    `cfg` is a DictConfig of the typed sections (`PPOTrainerConfig`; `main_ppo.normalize_config`).
    Unless `verbose`, Ray's own start-up messages below ERROR and the workers' loading bars are muted. When
    the alive nodes cannot hold the workers, waits up to `node_wait_s` for nodes to join (a restart passes
    trainer.restart_node_wait_s), then raises `ClusterTooSmallError` naming the trainer keys and the nodes.
    """
    import ray

    from rlframe.single_controller.ray import (
        ClusterTooSmallError,
        RayResourcePool,
        RayWorkerGroup,
        create_colocated_worker_cls,
        init_ray,
    )
    from rlframe.trainer.worker_groups import ROLE_GROUPS
    from rlframe.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, worker_env
    from rlframe.workers.reward_model import RewardModelWorker

    device_type = resolve_device(cfg.trainer.device)
    started_here = not ray.is_initialized()
    init_ray(
        address=cfg.trainer.ray_init.address,
        num_cpus=_num_cpus_for_local_ray(cfg, plan.world_size + rollout_pool_size(cfg), device_type),
        dashboard_host=cfg.trainer.ray_init.dashboard_host,
        runtime_env={"env_vars": {**worker_env(), **({} if verbose else QUIET_WORKER_ENV)}},
        logging_level=logging.INFO if verbose else logging.ERROR,  # Ray's driver-side logger
    )
    nnodes, per_node = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
    pool = RayResourcePool([per_node] * nnodes, use_gpu=device_type == "cuda", node_wait_s=node_wait_s)
    config = OmegaConf.to_object(cfg)  # the typed tree, built once (interpolations resolved)
    roles = {"actor_rollout": _role(ActorRolloutRefWorker, config, plan, with_ref=plan.ref is not None)}
    if plan.critic is not None:
        roles["critic"] = _role(CriticWorker, config, plan)
    if cfg.reward_model.enable:
        roles["reward_model"] = _role(RewardModelWorker, config, plan)
    try:
        owner = RayWorkerGroup(
            pool,
            create_colocated_worker_cls(roles),
            call_timeout_s=cfg.trainer.worker_timeout_s,
            # global_profiler.tool=nsys: the workers run under nsys; the tests' delay points reach the engines
            runtime_env={**nsight_runtime_env(cfg), **delay_runtime_env()},
        )
    except ClusterTooSmallError as err:
        waited = f" (trainer.restart_node_wait_s={node_wait_s:g})" if node_wait_s else ""
        raise ClusterTooSmallError(
            f"the run needs trainer.nnodes={nnodes} × trainer.n_gpus_per_node={per_node} worker processes "
            f"(trainer.device={device_type}), which the Ray cluster cannot hold{waited}: {err}"
        ) from None
    by_role = owner.spawn(list(roles), ROLE_GROUPS)
    groups = WorkerGroups(
        actor_rollout=by_role["actor_rollout"],
        critic=by_role.get("critic"),
        reward_model=by_role.get("reward_model"),
        num_devices=plan.world_size + rollout_pool_size(cfg),
        _owner=owner,
        _pool=pool,
        _started_ray=started_here,
    )
    try:
        for name in roles:  # in order: the actor's process group is created first
            by_role[name].init_model(total_training_steps)
        if rollout_pool_size(cfg):
            _create_rollout_group(cfg, plan, config, groups, device_type, node_wait_s)
    except BaseException:  # a worker lost while building its models: free the others and the placement groups
        groups.shutdown()
        raise
    return groups


def delay_runtime_env() -> dict:
    """The tests' delay points (`RLFRAME_DELAY_AT`), for worker processes of a Ray cluster started before they were
    set; {} without them."""
    return {"env_vars": {DELAY_ENV: os.environ[DELAY_ENV]}} if os.environ.get(DELAY_ENV) else {}


def _role(worker_cls: type, config, *args, **kwargs):
    """A role's worker class with its init arguments: only the sections it reads (`worker_cls.SECTIONS`), typed."""
    from rlframe.single_controller.ray import RayClassWithInitArgs

    return RayClassWithInitArgs(worker_cls, sections_of(config, worker_cls.SECTIONS), *args, **kwargs)


def _create_rollout_group(cfg, plan: BatchPlan, config, groups: WorkerGroups, device_type: str, node_wait_s: float):
    """separate_async: RolloutWorkers on a pool of their own, drawing the sampling seeds the hybrid engine would.

    They start from the training processes' RNG state once every role is built: the state a hybrid worker's
    first generation draws its seed from (`RolloutWorker`).
    """
    from rlframe.single_controller.ray import ClusterTooSmallError, RayResourcePool
    from rlframe.trainer.worker_groups import RolloutGroup
    from rlframe.workers.rollout_worker import RolloutWorker

    nnodes, per_node = cfg.actor_rollout_ref.rollout.nnodes, cfg.actor_rollout_ref.rollout.n_gpus_per_node
    groups._rollout_pool = RayResourcePool([per_node] * nnodes, use_gpu=device_type == "cuda", node_wait_s=node_wait_s)
    try:
        groups.rollout = RolloutGroup(
            groups._rollout_pool,
            _role(RolloutWorker, config, plan),
            call_timeout_s=cfg.trainer.worker_timeout_s,
            # global_profiler.tool=nsys: the pool's processes run under nsys too
            runtime_env={**nsight_runtime_env(cfg), **delay_runtime_env()},
        )
    except ClusterTooSmallError as err:
        raise ClusterTooSmallError(
            f"the rollout pool needs actor_rollout_ref.rollout.nnodes={nnodes} × actor_rollout_ref.rollout."
            f"n_gpus_per_node={per_node} worker processes besides the training pool's, which the Ray cluster "
            f"cannot hold: {err}"
        ) from None
    groups.rollout.init_model(groups.actor_rollout.process_rng_state())
