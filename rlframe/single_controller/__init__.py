"""Single controller: one driver process calls methods that fan out to many worker processes.

`Worker` is the base class of a worker process; `@register` marks the methods the driver may
call through a worker group, with a `Dispatch` mode (how data is split and results gathered)
and an `Execute` mode (which ranks run). The Ray implementation lives in
`rlframe.single_controller.ray`.
"""

from rlframe.single_controller.decorator import Dispatch, Execute, register
from rlframe.single_controller.errors import (
    WorkerDiedError,
    WorkerError,
    WorkerGroupError,
    WorkerOutOfMemoryError,
    WorkerTimeoutError,
)
from rlframe.single_controller.worker import Worker

__all__ = [
    "Dispatch",
    "Execute",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroupError",
    "WorkerOutOfMemoryError",
    "WorkerTimeoutError",
    "register",
]
