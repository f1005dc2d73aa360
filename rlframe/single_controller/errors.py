"""Errors a worker-group call raises on the driver, each naming the rank it came from."""

from __future__ import annotations


class WorkerGroupError(RuntimeError):
    """Base class for failures of a call fanned out to a worker group."""


class _RankError(WorkerGroupError):
    """A failure of one rank's call, told by `message` from (rank, method, detail), which also rebuild it."""

    message = "{method} failed on worker rank {rank}: {detail}"

    def __init__(self, rank: int, method: str, detail: str):
        self.rank = rank
        self.method = method
        self.detail = detail
        super().__init__(self.message.format(rank=rank, method=method, detail=detail.rstrip()))

    def __reduce__(self):
        # an exception with its own __init__ signature must say how to rebuild itself across processes
        return type(self), (self.rank, self.method, self.detail)


class WorkerError(_RankError):
    """A registered method raised inside a worker; `detail` is the worker's traceback."""

    message = "{method} raised on worker rank {rank}:\n{detail}"

    @property
    def traceback_text(self) -> str:
        return self.detail


class WorkerDiedError(_RankError):
    """The worker process of `rank` died (crash, kill, OOM, lost node) before answering; `detail` says how.

    A kill by Ray's memory monitor is the subclass `WorkerOutOfMemoryError`."""

    message = "worker rank {rank} died during {method}: {detail}"


class WorkerOutOfMemoryError(WorkerDiedError):
    """Ray's memory monitor killed the worker process of `rank` (its node ran low on memory); `detail`: Ray's words."""

    message = (
        "worker rank {rank} was killed by Ray's memory monitor during {method}: its node ran low on memory (the "
        "process killed is the most recently started task, not necessarily the one that grew). Lower what the run "
        "holds on that node (on a CPU: a vLLM engine's actor_rollout_ref.rollout.max_num_seqs, max_model_len and "
        "gpu_memory_utilization; micro-batch sizes; trainer.n_gpus_per_node processes per node) or give Ray more "
        "room (RAY_memory_usage_threshold, default 0.95). Ray's report: {detail}"
    )


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
