"""A worker-group call in flight: sent to every executing rank, not yet waited for.

`RayWorkerGroup.submit` returns a `PendingCall`; `.result()` waits for every rank and collects their
outputs exactly as a blocking call does (a blocking call is `submit(...).result()`). Two calls submitted on
two groups run at the same time; calls on one group's actors run in submission order (Ray's actor queue).
"""

from __future__ import annotations

from typing import Any

import ray

from rlframe.single_controller.decorator import CallPlan
from rlframe.single_controller.ray.wait import wait_all


class PendingCall:
    """One driver call whose per-rank tasks are running; `result()` once gives the collected output."""

    def __init__(self, refs: list, plan: CallPlan, method: str, timeout_s: float | None):
        self.refs, self.plan, self.method, self.timeout_s = refs, plan, method, timeout_s
        self._taken = False

    def done(self) -> bool:
        """True when every rank has answered (with a result or an error); never blocks."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self) -> Any:
        """Wait for every executing rank (failing fast on the first error), then collect their outputs.

        The timeout (the group's call_timeout_s) counts from this wait, not from the submission.
        """
        if self._taken:
            raise RuntimeError(f"{self.method}: result() was already taken; a pending call gives its result once")
        self._taken = True
        copy = not self.plan.outputs_are_copied
        outputs = wait_all(self.refs, self.plan.ranks, self.method, self.timeout_s, copy=copy)
        return self.plan.collect(outputs)

    def __repr__(self) -> str:
        return f"PendingCall({self.method}, ranks={self.plan.ranks}, done={self.done()})"


def wait_any(calls: list[PendingCall]) -> PendingCall:
    """The first of `calls`, in list order, whose ranks have all answered (with results or errors); blocks until
    one has. List order, not the order `ray.wait` reports: it returns any `num_returns` of the ready refs, so a
    call that finished long ago could otherwise be passed over again and again."""
    if not calls:
        raise ValueError("wait_any needs at least one pending call")
    refs = [ref for call in calls for ref in call.refs]
    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        answered = set(ready)
        for call in calls:
            if all(ref in answered for ref in call.refs):
                return call
        ray.wait(refs, num_returns=min(len(ready) + 1, len(refs)))  # until one more has answered
