"""Named kill points: crash-consistency tests SIGKILL a real run at an exact place.

`RLFRAME_KILL_AT=NAME:N` (optionally `NAME:N:RANK`) makes the process that reaches the point `NAME`
for the N-th time kill itself with SIGKILL, with no cleanup, as a preempted node or the OOM killer
would. `RANK` restricts it to the worker of that rank (`RANK` from the environment, which Ray workers
set). Without the variable a point costs one dictionary lookup. The points are listed in
docs/reliability.md; tests/test_faults_kill.py walks through them.
"""

from __future__ import annotations

import os
import signal

ENV = "RLFRAME_KILL_AT"
_hits: dict[str, int] = {}


def _target() -> tuple[str, int, str | None] | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected NAME:N or NAME:N:RANK (kill at the N-th time NAME is reached)")
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else None


def kill_point(name: str) -> None:
    """SIGKILL this process if `RLFRAME_KILL_AT` names `name` and this is its N-th hit here."""
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    wanted, rank = target[1], target[2]
    if _hits[name] == wanted and (rank is None or os.environ.get("RANK") == rank):
        os.kill(os.getpid(), signal.SIGKILL)
