"""Waiting on the workers of one call: fail fast on the first error, never wait forever."""

from __future__ import annotations

import time
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from rlframe.single_controller.errors import WorkerDiedError, WorkerError, WorkerTimeoutError
from rlframe.single_controller.transport import unpack_value

GROUP_TIMEOUT = object()  # `WorkerGroupFuture.get` default: the timeout the group was built with


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


def _get_one(ref, rank: int, method: str):
    try:
        return ray.get(ref)
    except RayTaskError as err:
        if isinstance(err.cause, WorkerError):
            raise err.cause from None
        raise WorkerError(rank, method, str(err)) from None
    except RayActorError as err:
        raise WorkerDiedError(rank, method, str(err).strip() or type(err).__name__) from None


class WorkerGroupFuture:
    """The pending result of a non-blocking worker-group call; `get()` collects it."""

    def __init__(self, refs: list, ranks: list[int], collect: Callable[[list], Any], method: str,
                 timeout_s: float | None, outputs_are_copied: bool = False):
        self.refs = refs
        self.ranks = ranks
        self.method = method
        self._collect = collect
        self._timeout_s = timeout_s
        self._copy = not outputs_are_copied

    def done(self) -> bool:
        """True once every rank has answered (successfully or not)."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def get(self, timeout_s: float | None | object = GROUP_TIMEOUT) -> Any:
        """Wait for every rank and return the collected result (default: the group's call timeout)."""
        timeout_s = self._timeout_s if timeout_s is GROUP_TIMEOUT else timeout_s
        return self._collect(wait_all(self.refs, self.ranks, self.method, timeout_s, copy=self._copy))

    def __repr__(self) -> str:
        return f"WorkerGroupFuture({self.method}, ranks={self.ranks}, done={self.done()})"
