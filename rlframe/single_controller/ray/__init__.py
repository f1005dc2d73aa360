"""The Ray implementation of the single controller: resource pools, worker groups, colocation."""

from rlframe.single_controller.ray.base import RayClassWithInitArgs, RayWorkerGroup, init_ray
from rlframe.single_controller.ray.colocate import ColocatedWorker, create_colocated_worker_cls
from rlframe.single_controller.ray.pending import PendingCall, wait_any
from rlframe.single_controller.ray.resource_pool import ClusterTooSmallError, RayResourcePool

__all__ = [
    "ClusterTooSmallError",
    "ColocatedWorker",
    "PendingCall",
    "wait_any",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "create_colocated_worker_cls",
    "init_ray",
]
