"""`rlframe.trainer.worker_groups`: each role's group class declares exactly its worker's registered methods."""

import pytest

from rlframe.single_controller.decorator import registered_methods
from rlframe.trainer import worker_groups
from rlframe.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker
from rlframe.workers.reward_model import RewardModelWorker
from rlframe.workers.rollout_worker import RolloutWorker

GROUPS = [
    (worker_groups.ActorRolloutGroup, ActorRolloutRefWorker),
    (worker_groups.CriticGroup, CriticWorker),
    (worker_groups.RewardModelGroup, RewardModelWorker),
    (worker_groups.RolloutGroup, RolloutWorker),
]


@pytest.mark.parametrize(("group_cls", "worker_cls"), GROUPS, ids=lambda c: c.__name__)
def test_a_group_class_declares_each_registered_method_of_its_worker_and_nothing_else(group_cls, worker_cls):
    declared = {name for name in vars(group_cls) if not name.startswith("_")}
    assert declared == set(registered_methods(worker_cls)), "declare (or drop) the difference in worker_groups.py"
    for name in declared:  # the worker's own function: "go to definition" lands on it
        assert getattr(group_cls, name) is getattr(worker_cls, name), name


def test_the_colocated_roles_have_their_group_class():
    assert worker_groups.ROLE_GROUPS == {
        "actor_rollout": worker_groups.ActorRolloutGroup,
        "critic": worker_groups.CriticGroup,
        "reward_model": worker_groups.RewardModelGroup,
    }
