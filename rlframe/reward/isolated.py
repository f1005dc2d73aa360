"""Scoring in a child process with a per-batch time limit (`custom_reward_function.timeout_s`).

A Python function that hangs cannot be interrupted from another thread, so with a time limit the
reward manager's `score_samples` runs in a child process that the driver kills when a batch takes
longer than the limit. Per-sample managers stream each sample's result back as it is scored: at the
limit, the samples already scored keep their scores and the rest get a `ScorerTimeout` in place of
a result (scored 0 and counted by the manager). The child is started with `spawn` (the driver holds
Ray's threads, which `fork` would copy half-alive) and restarted for the next batch after a kill.
Exceptions raised by the scorer cross back as `RemoteScorerError`, carrying the child's traceback.
"""

from __future__ import annotations

import multiprocessing
import traceback

_READY, _RESULT, _DONE = "ready", "result", "done"


class ScorerTimeout(TimeoutError):
    """A sample was not scored within the batch's time limit."""


class RemoteScorerError(RuntimeError):
    """The scorer raised in the scoring process; the message is that process's traceback."""

    def __repr__(self) -> str:  # one line (the original exception), for the repeated-failure warnings
        return f"{type(self).__name__}({str(self).splitlines()[-1]!r})"


def _portable(result):
    """A result that can cross the pipe: exceptions become RemoteScorerError with their traceback text."""
    if isinstance(result, BaseException):
        text = "".join(traceback.format_exception(type(result), result, result.__traceback__))
        return RemoteScorerError(text.rstrip())
    return result


def _serve(conn, manager_bytes: bytes) -> None:
    """The child's loop: receive a batch, send each result (per sample, or all at once), then DONE."""
    import cloudpickle

    manager = cloudpickle.loads(manager_bytes)
    conn.send((_READY, None, None))
    while True:
        columns = conn.recv()
        if columns is None:
            return
        if manager.scores_per_sample:
            for i, sample in enumerate(zip(*columns)):
                result = manager.score_samples(*([value] for value in sample))[0]
                conn.send((_RESULT, i, _portable(result)))
        else:
            try:
                results = manager.score_samples(*columns)
            except Exception as error:  # noqa: BLE001 - every sample fails, counted by the manager
                results = [error] * len(columns[0])
            for i, result in enumerate(results):
                conn.send((_RESULT, i, _portable(result)))
        conn.send((_DONE, None, None))


class IsolatedScorer:
    """Runs `manager.score_samples` in a child process; a batch over `timeout_s` is cut off there."""

    def __init__(self, manager, timeout_s: float):
        self.manager, self.timeout_s = manager, float(timeout_s)
        self._process, self._conn = None, None

    def _start(self) -> None:
        import cloudpickle

        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_conn, cloudpickle.dumps(self.manager)), daemon=True, name="rlframe-scorer"
        )
        self._process.start()
        child_conn.close()
        kind, _, _ = self._conn.recv()  # start-up (imports) is not part of any batch's time
        assert kind == _READY

    def score(self, *columns) -> tuple[list, int]:
        """(a result or exception per sample, how many samples timed out)."""
        import time

        if self._process is None or not self._process.is_alive():
            self._start()
        num_samples = len(columns[0])
        results: list = [None] * num_samples
        received = [False] * num_samples
        self._conn.send(columns)
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._conn.poll(remaining):
                return self._cut_off(results, received)
            kind, index, value = self._conn.recv()
            if kind == _DONE:
                return results, 0
            results[index], received[index] = value, True

    def _cut_off(self, results: list, received: list) -> tuple[list, int]:
        """Kill the hung child; the samples it did not score get a ScorerTimeout."""
        self.close()
        missing = [i for i, done in enumerate(received) if not done]
        error = ScorerTimeout(
            f"scoring did not finish within custom_reward_function.timeout_s={self.timeout_s:g}s; "
            f"{len(missing)} of {len(results)} samples were not scored (the scoring process was killed)"
        )
        for i in missing:
            results[i] = error
        return results, len(missing)

    def close(self) -> None:
        """Kill the child process (if running)."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._conn.close()
        self._process, self._conn = None, None
