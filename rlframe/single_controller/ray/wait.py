"""Waiting on the workers of one call: fail fast on the first error, never wait forever."""

from __future__ import annotations

import re
import time
from typing import Any

import ray
from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

from rlframe.single_controller.errors import WorkerDiedError, WorkerError, WorkerOutOfMemoryError, WorkerTimeoutError
from rlframe.single_controller.transport import unpack_value


def wait_all(refs: list, ranks: list[int], method: str, timeout_s: float | None, copy: bool = True) -> list:
    """Outputs of `refs` (one per rank, same order), raising on the first failed rank.

    Results are taken as they arrive rather than all at once: when one rank fails while its
    peers block in a collective waiting for it, the failure is raised now instead of after
    the peers time out (or never).
    """
    pending = dict(zip(refs, ranks))
    outputs: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
        if not ready:
            raise WorkerTimeoutError(sorted(pending.values()), method, timeout_s)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                outputs[rank] = unpack_value(_get_one(ref, rank, method), copy=copy)
            except WorkerDiedError:
                _drain(pending, method)
                raise
            except Exception as first:
                died = _drain(pending, method)
                if died is not None:  # the root cause: its peers failed in collectives with it
                    raise died from first
                raise
    return [outputs[rank] for rank in ranks]


def _drain(pending: dict, method: str, grace_s: float = 5.0) -> WorkerDiedError | None:
    """Fetch the results other ranks deliver shortly after a failure; return a death among them.

    Ranks often fail together (same bad input); fetching their errors here keeps Ray from
    logging each one later as an "unhandled error" next to the one already raised. When one of
    them died, its peers usually fail first with connection errors in a collective; the death is
    the error worth reporting.
    """
    if not pending:
        return None
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    died = None
    for ref in ready:
        try:
            _get_one(ref, pending[ref], method)
        except WorkerDiedError as err:
            died = died or err
        except Exception:  # noqa: BLE001 - already reporting the first failure
            pass
    return died


# how Ray words a kill by its memory monitor in an actor's death cause (ray 2.60: "... killed due to the node
# running low on memory ... set the environment variable `RAY_memory_usage_threshold` ...")
MEMORY_MONITOR_KILL = re.compile(r"running low on memory|memory monitor|RAY_memory_usage_threshold")


def _get_one(ref, rank: int, method: str):
    try:
        return ray.get(ref)
    except RayTaskError as err:
        if isinstance(err.cause, WorkerError):
            raise err.cause from None
        raise WorkerError(rank, method, str(err)) from None
    except OutOfMemoryError as err:  # the task's worker was killed by Ray's memory monitor
        raise WorkerOutOfMemoryError(rank, method, str(err).strip()) from None
    except RayActorError as err:
        detail = str(err).strip() or type(err).__name__
        if MEMORY_MONITOR_KILL.search(detail):  # the actor's death cause: the same kill, seen through the actor
            raise WorkerOutOfMemoryError(rank, method, detail) from None
        raise WorkerDiedError(rank, method, detail) from None
