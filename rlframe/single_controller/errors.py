"""Errors a worker-group call raises on the driver, each naming the rank it came from."""

from __future__ import annotations


class WorkerGroupError(RuntimeError):
    """Base class for failures of a call fanned out to a worker group."""


class WorkerError(WorkerGroupError):
    """A registered method raised inside a worker; carries the rank and the worker's traceback."""

    def __init__(self, rank: int, method: str, traceback_text: str):
        self.rank = rank
        self.method = method
        self.traceback_text = traceback_text
        super().__init__(f"{method} raised on worker rank {rank}:\n{traceback_text.rstrip()}")

    def __reduce__(self):
        # Exceptions with custom __init__ signatures must say how to rebuild themselves
        # to cross the process boundary intact.
        return type(self), (self.rank, self.method, self.traceback_text)


class WorkerDiedError(WorkerGroupError):
    """The worker process of `rank` died (crash, kill, OOM, lost node) before answering."""

    def __init__(self, rank: int, method: str, reason: str):
        self.rank = rank
        self.method = method
        self.reason = reason
        super().__init__(f"worker rank {rank} died during {method}: {reason}")

    def __reduce__(self):
        return type(self), (self.rank, self.method, self.reason)


class WorkerTimeoutError(WorkerGroupError, TimeoutError):
    """Some ranks did not answer within the call timeout (hung, not known to be dead)."""

    def __init__(self, ranks: list[int], method: str, timeout_s: float):
        self.ranks = list(ranks)
        self.method = method
        self.timeout_s = timeout_s
        super().__init__(
            f"{method}: worker ranks {self.ranks} did not answer within {timeout_s:g}s "
            f"(alive but stuck, e.g. in a collective whose peer failed)"
        )

    def __reduce__(self):
        return type(self), (self.ranks, self.method, self.timeout_s)
