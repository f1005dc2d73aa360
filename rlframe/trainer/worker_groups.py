"""The worker groups the trainer drives, one class per role, declaring the methods an editor cannot see otherwise.

`RayWorkerGroup` binds every `@register`-ed method of its worker class on the group when the group is built:
`wg.update_actor(batch)` dispatches the batch, runs `ActorRolloutRefWorker.update_actor` on every rank and
collects the outputs. Bound at run time, those methods are invisible to an editor or a type checker. Each class
below declares its role's methods as the worker's own functions, so that "go to definition" on
`self.actor_rollout_wg.update_actor` lands here and then on the worker's method. The declarations are never
called: building the group binds the dispatching twin of each over it, as for any `RayWorkerGroup`
(`tests/trainer/test_worker_groups.py` checks that each class declares exactly its worker's registered methods).
"""

from __future__ import annotations

from rlframe.single_controller.ray import RayWorkerGroup
from rlframe.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker
from rlframe.workers.reward_model import RewardModelWorker
from rlframe.workers.rollout_worker import RolloutWorker


class ActorRolloutGroup(RayWorkerGroup[ActorRolloutRefWorker]):
    """The actor, its rollout engine, the reference policy and the distillation teacher, in every training process."""

    init_model = ActorRolloutRefWorker.init_model
    generate_sequences = ActorRolloutRefWorker.generate_sequences
    generate_whole = ActorRolloutRefWorker.generate_whole
    watch_versions = ActorRolloutRefWorker.watch_versions
    sync_rollout_weights = ActorRolloutRefWorker.sync_rollout_weights
    continue_sequences = ActorRolloutRefWorker.continue_sequences
    compute_log_prob = ActorRolloutRefWorker.compute_log_prob
    compute_ref_log_prob = ActorRolloutRefWorker.compute_ref_log_prob
    compute_teacher_log_prob = ActorRolloutRefWorker.compute_teacher_log_prob
    update_actor = ActorRolloutRefWorker.update_actor
    export_weights = ActorRolloutRefWorker.export_weights
    open_weight_push = ActorRolloutRefWorker.open_weight_push
    push_weights = ActorRolloutRefWorker.push_weights
    process_rng_state = ActorRolloutRefWorker.process_rng_state
    flops_info = ActorRolloutRefWorker.flops_info
    save_checkpoint = ActorRolloutRefWorker.save_checkpoint
    load_checkpoint = ActorRolloutRefWorker.load_checkpoint
    start_profile = ActorRolloutRefWorker.start_profile
    stop_profile = ActorRolloutRefWorker.stop_profile


class CriticGroup(RayWorkerGroup[CriticWorker]):
    """The value model, in the same processes as the actor."""

    init_model = CriticWorker.init_model
    compute_values = CriticWorker.compute_values
    update_critic = CriticWorker.update_critic
    save_checkpoint = CriticWorker.save_checkpoint
    load_checkpoint = CriticWorker.load_checkpoint
    start_profile = CriticWorker.start_profile
    stop_profile = CriticWorker.stop_profile


class RewardModelGroup(RayWorkerGroup[RewardModelWorker]):
    """The reward model (`reward_model.enable`), in the same processes as the actor."""

    init_model = RewardModelWorker.init_model
    compute_rm_score = RewardModelWorker.compute_rm_score
    start_profile = RewardModelWorker.start_profile
    stop_profile = RewardModelWorker.stop_profile


class RolloutGroup(RayWorkerGroup[RolloutWorker]):
    """The rollout pool of `trainer.v1.trainer_mode=separate_async`, on processes of its own."""

    init_model = RolloutWorker.init_model
    generate_sequences = RolloutWorker.generate_sequences
    generate_whole = RolloutWorker.generate_whole
    continue_sequences = RolloutWorker.continue_sequences
    load_weights = RolloutWorker.load_weights
    join_weight_push = RolloutWorker.join_weight_push
    receive_weights = RolloutWorker.receive_weights
    needs_base_weights = RolloutWorker.needs_base_weights
    watch_versions = RolloutWorker.watch_versions
    start_profile = RolloutWorker.start_profile
    stop_profile = RolloutWorker.stop_profile


# the colocated roles' views, by the role names `launch.create_worker_groups` gives them
ROLE_GROUPS: dict[str, type[RayWorkerGroup]] = {
    "actor_rollout": ActorRolloutGroup,
    "critic": CriticGroup,
    "reward_model": RewardModelGroup,
}
