"""RayWorkerGroup: one Ray actor per process slot, with the worker class's methods bound on it."""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import inspect
import os
import socket
import tempfile
import types
import uuid
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlframe.single_controller.decorator import CallPlan, RegisterSpec, plan_call, registered_methods
from rlframe.single_controller.errors import WorkerGroupError
from rlframe.single_controller.ray.pending import PendingCall
from rlframe.single_controller.ray.resource_pool import RayResourcePool
from rlframe.single_controller.ray.wait import wait_all
from rlframe.single_controller.transport import pack_value
from rlframe.single_controller.worker import RENDEZVOUS_FILE_ENV, Worker

W = TypeVar("W", bound=Worker)

# Values small enough to travel inline with each call; anything else is put into the object
# store once per call and passed by reference (ONE_TO_ALL ranks all read the same copy).
_INLINE_TYPES = (type(None), bool, int, float, str, enum.Enum)


def init_ray(
    address: str | None = None, num_cpus: int | None = None, dashboard_host: str | None = None, **init_kwargs
) -> None:
    """Connect to the cluster at `address` (or $RAY_ADDRESS), or start a local one; no-op if connected.

    A local cluster starts its dashboard only with `dashboard_host` (trainer.ray_init.dashboard_host),
    listening there: 127.0.0.1 keeps it to this machine.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address in (None, "local"):
        # "local" always starts a fresh cluster, even when another one runs on this machine.
        dashboard = {"include_dashboard": dashboard_host is not None, "dashboard_host": dashboard_host or "127.0.0.1"}
        ray.init(address="local", num_cpus=num_cpus, **{**dashboard, **init_kwargs})
        return
    if num_cpus is not None:
        raise ValueError(
            f"num_cpus={num_cpus} only applies when starting a local cluster; the cluster at "
            f"{address!r} already has its resources"
        )
    ray.init(address=address, **init_kwargs)


# Where and with what each worker runs is the resource pool's: one bundle per process
_PLACEMENT_OPTIONS = (
    "num_cpus",
    "num_gpus",
    "resources",
    "memory",
    "accelerator_type",
    "scheduling_strategy",
    "placement_group",
    "placement_group_bundle_index",
    "placement_group_capture_child_tasks",
    "name",
    "get_if_exists",
)


class RayClassWithInitArgs(Generic[W]):
    """A Worker subclass plus its constructor arguments (resources come from the pool).

    `cls` is the class, or the class wrapped in `ray.remote(...)` as verl writes it: then its options other
    than placement (`max_concurrency`, `max_restarts`, `runtime_env`, ...) apply to every worker. Placement
    is the pool's, one bundle per process: `num_cpus`/`num_gpus` equal to the pool's bundle are accepted,
    any other placement option is refused when the group is built (`check_placement`).
    """

    def __init__(self, cls: type[W], *args, **kwargs):
        self.ray_options: dict[str, Any] = {}  # the options of a `ray.remote(...)` class, as the user passed them
        if isinstance(cls, ray.actor.ActorClass):
            self.ray_options = dict(cls._default_options)
            cls = cls.__ray_actor_class__
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(
                f"RayClassWithInitArgs needs a subclass of rlframe.single_controller.Worker (or one wrapped "
                f"in ray.remote), got {cls!r}"
            )
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.roles: dict[str, type[Worker]] = {}  # role -> class, for create_colocated_worker_cls

    def check_placement(self, pool: RayResourcePool) -> None:
        """Refuse `ray.remote` placement options that differ from the pool's bundle (they would never apply)."""
        bundle = pool.actor_resources()
        wrong = {
            name: value
            for name, value in self.ray_options.items()
            if name in _PLACEMENT_OPTIONS and not (name in bundle and value == bundle[name])
        }
        if wrong:
            raise ValueError(
                f"ray.remote({self.cls.__name__}) was given {wrong}: each worker of a RayWorkerGroup runs in "
                f"one bundle of its RayResourcePool ({bundle}); set the CPUs and GPUs on the pool "
                "(num_cpus_per_process, use_gpu) and drop these options from ray.remote"
            )

    def remote_class(self):
        """The Ray actor class: the worker class with the user's `ray.remote` options, less placement and
        `runtime_env` (merged with the group's by `runtime_env`)."""
        options = {k: v for k, v in self.ray_options.items() if k not in (*_PLACEMENT_OPTIONS, "runtime_env")}
        return ray.remote(**options)(self.cls) if options else ray.remote(self.cls)

    def runtime_env(self, group_env: dict) -> dict:
        """The user's `ray.remote(runtime_env=...)` under the group's (its keys and env_vars win)."""
        user_env = self.ray_options.get("runtime_env") or {}
        env_vars = {**user_env.get("env_vars", {}), **group_env.get("env_vars", {})}
        return {**user_env, **group_env, "env_vars": env_vars}


@ray.remote(num_cpus=0)
def _node_address() -> tuple[str, int, str]:
    """This node's IP, a port free on it right now, and an unused file path in its temporary folder.

    A multi-node group rendezvouses at the IP and port (torch.distributed's TCPStore, which listens on
    every interface); a group on one node rendezvouses through the file (a FileStore: no socket at all).
    """
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    store_file = os.path.join(tempfile.gettempdir(), f"rlframe-rendezvous-{uuid.uuid4().hex}")
    return ray.util.get_node_ip_address(), port, store_file


@ray.remote(num_cpus=0)
def _remove_file(path: str) -> None:
    """Remove a finished group's rendezvous file (its ranks were killed, so none removed it)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


class RayWorkerGroup(Generic[W]):
    """Ray actors of one Worker class, one per slot of a resource pool, driven as one object.

    Every `@register`-ed method of the worker class is bound on the group at construction:
    `wg.compute_log_prob(data)` dispatches `data`, runs the worker method on every rank and
    collects the result. The bound method is `functools.wraps` of the worker's, so `help()`,
    `inspect.signature` and `inspect.getsource` (IPython `??`, debuggers) show the worker
    method. For an editor, which cannot see methods bound at run time, a subclass may declare them:
    `rlframe.trainer.worker_groups` has one per role, so `wg.update_actor` leads to the worker's method.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs[W],
        *,
        call_timeout_s: float | None = None,
        init_timeout_s: float = 300.0,
        runtime_env: dict | None = None,
    ):
        self.resource_pool = resource_pool
        self.call_timeout_s = call_timeout_s
        self._role_classes = dict(ray_cls_with_init.roles)
        workers, self._rendezvous_file = _create_workers(resource_pool, ray_cls_with_init, runtime_env or {})
        self._setup(workers, ray_cls_with_init.cls, role=None)
        try:  # also surfaces constructor failures now, with their rank
            self.worker_info = wait_all(
                [w._rlframe_info.remote() for w in workers],
                list(range(len(workers))),
                f"{self.worker_cls.__name__}.__init__",
                init_timeout_s,
            )
        except BaseException:
            self.shutdown()
            raise

    def _setup(self, workers: list, worker_cls: type[W], role: str | None) -> None:
        self._workers = workers  # shared (same list) with every view spawned from this group
        self.worker_cls = worker_cls
        self.role = role
        for name, spec in registered_methods(worker_cls).items():
            if hasattr(RayWorkerGroup, name):
                raise TypeError(
                    f"{worker_cls.__name__}.{name} is registered, but RayWorkerGroup.{name} already "
                    f"exists; rename the worker method"
                )
            setattr(self, name, types.MethodType(_group_method(name, spec, getattr(worker_cls, name)), self))

    # ------------------------------------------------------------------ the group
    @property
    def world_size(self) -> int:
        return len(self._workers)

    def spawn(
        self, prefix_set: Iterable[str], group_classes: dict[str, type[RayWorkerGroup]] | None = None
    ) -> dict[str, RayWorkerGroup]:
        """Per-role groups of a colocated group: same processes, methods of each role's class.

        `group_classes` gives a role's view a subclass declaring its worker's methods for an editor
        (`rlframe.trainer.worker_groups`); the calls are the same."""
        if not self._role_classes:
            raise ValueError(
                f"spawn() needs a group built from create_colocated_worker_cls; this one runs "
                f"{self.worker_cls.__name__}"
            )
        unknown = sorted(set(prefix_set) - set(self._role_classes))
        if unknown:
            raise ValueError(f"unknown roles {unknown}; this colocated group has {sorted(self._role_classes)}")
        views = {}
        for role in prefix_set:
            group_cls = (group_classes or {}).get(role, RayWorkerGroup)
            view = group_cls.__new__(group_cls)
            view.resource_pool, view.call_timeout_s, view.worker_info = (
                self.resource_pool,
                self.call_timeout_s,
                self.worker_info,
            )
            view._role_classes, view._rendezvous_file = {}, self._rendezvous_file
            view._setup(self._workers, self._role_classes[role], role=role)
            views[role] = view
        return views

    def rank_views(self, ranks_per_view: int = 1) -> list[RayWorkerGroup]:
        """One group per `ranks_per_view` consecutive ranks over the same processes: a call on view r runs on its
        ranks alone (its whole batch there, split among them by the method's dispatch mode), so the driver can
        keep each rollout replica (a TP group) busy on its own."""
        workers = self._live_workers()
        if len(workers) % ranks_per_view:
            raise ValueError(f"rank_views({ranks_per_view}): {len(workers)} ranks do not split into such views")
        views = []
        for first in range(0, len(workers), ranks_per_view):
            ranks = slice(first, first + ranks_per_view)
            view = type(self).__new__(type(self))
            view.resource_pool, view.call_timeout_s = self.resource_pool, self.call_timeout_s
            view.worker_info = self.worker_info[ranks]
            view._role_classes, view._rendezvous_file = {}, None  # the parent group owns the file
            view._setup(workers[ranks], self.worker_cls, role=self.role)
            views.append(view)
        return views

    def shutdown(self) -> None:
        """Kill every worker process (of this group and all groups spawned from it), once each has removed its
        files in shared memory (`Worker._rlframe_release`; one dead or busy for 10 s keeps them until the next
        run on its node clears them)."""
        with contextlib.suppress(Exception):
            ray.get([worker._rlframe_release.remote() for worker in self._workers], timeout=10)
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers.clear()
        if self._rendezvous_file is not None:
            node, path = self._rendezvous_file
            strategy = NodeAffinitySchedulingStrategy(node, soft=True)
            with contextlib.suppress(Exception):  # best effort: a file of a few bytes in the node's /tmp
                ray.get(_remove_file.options(scheduling_strategy=strategy).remote(path), timeout=30)

    def __repr__(self) -> str:
        role = f", role={self.role!r}" if self.role else ""
        return f"RayWorkerGroup[{self.worker_cls.__name__}](world_size={self.world_size}{role})"

    # ------------------------------------------------------------------ one call
    def submit(self, method: str, *args, **kwargs) -> PendingCall:
        """Dispatch the registered method `method` without waiting: `.result()` gives what `wg.method(...)` returns.

        The driver can submit calls on several groups and wait for them in any order; a group's calls run in
        the order they were submitted.
        """
        spec = registered_methods(self.worker_cls).get(method)
        if spec is None:
            raise AttributeError(
                f"{self.worker_cls.__name__}.{method} is not a registered worker method; registered: "
                f"{sorted(registered_methods(self.worker_cls))}"
            )
        return self._start(method, spec, args, kwargs)

    def _call(self, method: str, spec: RegisterSpec, args: tuple, kwargs: dict):
        """Dispatch one driver call, wait for every executing rank, collect their outputs."""
        return self._start(method, spec, args, kwargs).result()

    def _start(self, method: str, spec: RegisterSpec, args: tuple, kwargs: dict) -> PendingCall:
        workers = self._live_workers()
        qualified = f"{self.worker_cls.__name__}.{method}"
        plan = plan_call(spec, qualified, args, kwargs, len(workers))
        return PendingCall(self._submit(workers, method, plan), plan, qualified, self.call_timeout_s)

    def _submit(self, workers: list, method: str, plan: CallPlan) -> list:
        """Send each rank its arguments; a non-scalar value several ranks read is put once for all of them (a value
        the caller put already, an `ObjectRef`, is passed as it is).

        A value only one rank reads (its data-parallel shard) travels with that rank's call: Ray puts it
        into the object store itself when it is large, and sends a small one inline, sparing the small
        batches of a short step a round trip through the store.
        """
        readers = collections.Counter(id(value) for values in (*plan.args, *plan.kwargs) for value in _values(values))
        refs_by_id: dict[int, Any] = {}

        def prepare(value):
            if isinstance(value, _INLINE_TYPES) or isinstance(value, ray.ObjectRef):  # a reference: Ray resolves it
                return value
            if readers[id(value)] == 1:
                return pack_value(value)
            if id(value) not in refs_by_id:  # the plan holds every value, so ids stay unique
                refs_by_id[id(value)] = ray.put(pack_value(value))
            return refs_by_id[id(value)]

        return [
            workers[rank]._rlframe_call.remote(
                self.role, method, *map(prepare, args), **{k: prepare(v) for k, v in kwargs.items()}
            )
            for rank, args, kwargs in zip(plan.ranks, plan.args, plan.kwargs)
        ]

    def _live_workers(self) -> list:
        if not self._workers:
            raise WorkerGroupError(f"{self!r} was shut down")
        return self._workers


def _values(args: tuple | dict) -> Iterable:
    return args.values() if isinstance(args, dict) else args


def _group_method(name: str, spec: RegisterSpec, worker_fn):
    """The driver-side twin of a registered worker method (same name, signature and doc)."""

    @functools.wraps(worker_fn)
    def group_method(self: RayWorkerGroup, *args, **kwargs):
        return self._call(name, spec, args, kwargs)

    # Ray's actor tracing adds a `_ray_trace_ctx` parameter to the worker method's signature
    # (in place, on the driver's class too); the driver-side call never takes it.
    signature = inspect.signature(worker_fn)
    group_method.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"]
    )
    return group_method


def _create_workers(
    pool: RayResourcePool, cls_with_init: RayClassWithInitArgs, runtime_env: dict
) -> tuple[list, tuple[str, str] | None]:
    """One actor per slot, and (node, path) of the group's rendezvous file when it has one.

    Rank order follows the pool's nodes, then the slots on each node. `runtime_env` adds to each
    actor's Ray runtime_env (e.g. `nsight`: run the worker under nsys).
    """
    cls_with_init.check_placement(pool)  # before any placement group is reserved
    pgs = pool.placement_groups()
    node_of_rank0 = ray.util.placement_group_table(pgs[0])["bundles_to_node_id"][0]
    master_addr, master_port, store_file = ray.get(
        _node_address.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_of_rank0, soft=False)).remote(),
        timeout=120,
    )
    rendezvous = {}
    if len(pool.process_on_nodes) == 1:  # every rank on rank 0's node: no network listener for the rendezvous
        master_addr = "127.0.0.1"
        rendezvous = {RENDEZVOUS_FILE_ENV: store_file}
    remote_cls = cls_with_init.remote_class()
    runtime_env = cls_with_init.runtime_env(runtime_env)
    workers = []
    for pg, count in zip(pgs, pool.process_on_nodes):
        for local_rank in range(count):
            env = {
                "RANK": len(workers),
                "WORLD_SIZE": pool.world_size,
                # torchrun's meaning: the process's index on its node, not a CUDA device index (Ray
                # narrows each worker to one visible GPU, index 0); the vLLM rollout sets LOCAL_RANK to
                # its visible device while building its engine (vllm_rollout.engine_environment)
                "LOCAL_RANK": local_rank,
                "LOCAL_WORLD_SIZE": count,
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": master_port,
                **rendezvous,
            }
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=local_rank)
            workers.append(
                remote_cls.options(
                    scheduling_strategy=strategy,
                    runtime_env={
                        **runtime_env,
                        "env_vars": {**runtime_env.get("env_vars", {}), **{k: str(v) for k, v in env.items()}},
                    },
                    **pool.actor_resources(),
                ).remote(*cls_with_init.args, **cls_with_init.kwargs)
            )
    return workers, ((node_of_rank0, store_file) if rendezvous else None)
