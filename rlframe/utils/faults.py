"""Named kill points: crash-consistency tests SIGKILL a real run at an exact place.

`RLFRAME_KILL_AT=NAME:N` (or `NAME:N:RANK`; several separated by commas) makes the process that
reaches the point `NAME` for the N-th time kill itself with SIGKILL, with no cleanup, as a preempted
node or the OOM killer would. `RANK` restricts it to the worker of that rank (`RANK` from the
environment, which Ray workers set). With `RLFRAME_KILL_ONCE=DIR` each kill happens once per run:
it leaves a marker in DIR first, so the processes a restart creates (their counts start at 0 again)
pass the point. Without the variable a point costs one environment lookup. The points are listed in
docs/reliability.md.

`RLFRAME_DELAY_AT=NAME:SEED:MIN-MAX[:RANK]` (several separated by commas) makes every process (or the one of that
`RANK`) that reaches `NAME` sleep a random MIN to MAX seconds first, drawn from its own generator seeded with SEED
and its rank: the asynchronous tests make replicas of the rollout pool finish out of order, reproducibly
(`DelayPoints`).
"""

from __future__ import annotations

import os
import random
import signal
import time

ENV = "RLFRAME_KILL_AT"
ONCE_ENV = "RLFRAME_KILL_ONCE"
DELAY_ENV = "RLFRAME_DELAY_AT"


def _targets(spec: str) -> list[tuple[str, int, str | None]]:
    targets = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected NAME:N or NAME:N:RANK (kill at the N-th time NAME is reached)")
        targets.append((parts[0], int(parts[1]), parts[2] if len(parts) == 3 else None))
    return targets


class KillPoints:
    """The kill points of one process: how often each point was reached, counted from this object's creation.

    The process's long-lived object owns it and hands it to the code with points: a worker process
    (`rlframe.single_controller.Worker.kill_points`, one for all the roles it hosts) and the driver's
    `TrainerCheckpointer`. Only the counts live here; `RLFRAME_KILL_AT` is read at each point.
    """

    def __init__(self):
        self.hits: dict[str, int] = {}

    def hit(self, name: str) -> None:
        """SIGKILL this process if `RLFRAME_KILL_AT` names `name` and this is its N-th hit here."""
        spec = os.environ.get(ENV)
        if not spec:
            return
        targets = [(wanted, rank) for target, wanted, rank in _targets(spec) if target == name]
        if not targets:
            return
        self.hits[name] = self.hits.get(name, 0) + 1
        for wanted, rank in targets:
            if (
                self.hits[name] == wanted
                and (rank is None or os.environ.get("RANK") == rank)
                and _first_time(name, wanted)
            ):
                os.kill(os.getpid(), signal.SIGKILL)


def _first_time(name: str, hit: int) -> bool:
    """With RLFRAME_KILL_ONCE=DIR: whether this kill has not happened yet in the run (and mark it)."""
    folder = os.environ.get(ONCE_ENV)
    if not folder:
        return True
    try:
        with open(os.path.join(folder, f"killed-{name}-{hit}"), "x"):
            return True
    except FileExistsError:
        return False


class DelayPoints:
    """The delay points of one process: a seeded generator per point, drawn at each hit."""

    def __init__(self):
        self.generators: dict[str, random.Random] = {}

    def hit(self, name: str) -> None:
        """Sleep as `RLFRAME_DELAY_AT` says for `name` (nothing without it)."""
        spec = os.environ.get(DELAY_ENV)
        rank = os.environ.get("RANK")
        for item in spec.split(",") if spec else ():
            target, seed, span, only_rank = _delay(item)
            if target == name and only_rank in (None, rank):
                generator = self.generators.setdefault(name, random.Random(f"{seed}:{rank}"))
                time.sleep(generator.uniform(*span))


def _delay(item: str) -> tuple[str, str, tuple[float, float], str | None]:
    try:
        name, seed, span, *rank = item.split(":")
        low, high = (float(x) for x in span.split("-"))
        if len(rank) > 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"{DELAY_ENV}={item!r}: expected NAME:SEED:MIN-MAX[:RANK] (seconds)") from None
    return name, seed, (low, high), rank[0] if rank else None
