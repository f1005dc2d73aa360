"""Colocation: several roles (actor/rollout, ref, critic, ...) living in the same processes."""

from __future__ import annotations

from rlframe.single_controller.ray.base import RayClassWithInitArgs
from rlframe.single_controller.worker import Worker


class ColocatedWorker(Worker):
    """One process hosting one instance of each role's Worker class, called by role name.

    The worker group routes each call with an explicit role (`RayWorkerGroup.spawn` gives one
    group per role), so role methods keep their own names and need no prefixes.
    """

    def __init__(self, role_specs: dict[str, tuple[type[Worker], tuple, dict]]):
        # Roles are built in the given order, in this process, sharing its environment (rank,
        # rendezvous): the first to call init_process_group creates the group for all of them.
        # What the process owns (Worker.process_state: kill points, shared memory, profiler session) is the
        # host's: set before each role's __init__, which may already use it. Built inside the config-read trace.
        with self.config_trace:
            self.roles = {role: self._build(cls, args, kwargs) for role, (cls, args, kwargs) in role_specs.items()}

    def _build(self, cls: type[Worker], args: tuple, kwargs: dict) -> Worker:
        worker = cls.__new__(cls)
        worker._rlframe_host = self
        worker.__init__(*args, **kwargs)
        return worker

    def _rlframe_target(self, role: str | None):
        if role is None:
            return self
        if role not in self.roles:
            raise ValueError(f"no role {role!r} in this colocated worker; it has {sorted(self.roles)}")
        return self.roles[role]


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs[ColocatedWorker]:
    """One worker class hosting every role of `class_dict`; build a RayWorkerGroup from it, then `spawn`."""
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    for role, cls_with_init in class_dict.items():
        if not isinstance(cls_with_init, RayClassWithInitArgs):
            raise TypeError(f"role {role!r} must be a RayClassWithInitArgs, got {type(cls_with_init).__name__}")
        if cls_with_init.ray_options:  # the roles share one actor: there is no per-role actor to give them to
            raise ValueError(
                f"role {role!r}: ray.remote({cls_with_init.cls.__name__}) was given {cls_with_init.ray_options}; "
                "colocated roles share one Ray actor, so pass ray.remote(cls) without options or the plain class"
            )
    specs = {role: (c.cls, c.args, c.kwargs) for role, c in class_dict.items()}
    colocated = RayClassWithInitArgs(ColocatedWorker, specs)
    colocated.roles = {role: c.cls for role, c in class_dict.items()}
    return colocated
