"""The tests' kept gloo worlds (tests/helpers/world.py) report what went wrong on a rank, and soon: a failure with its
traceback, a rank that dies (as the OOM killer's SIGKILL ends one) at once with its exit code, a hang at the job's
timeout; a world that failed is replaced by a fresh one for the next job."""

import os
import time

import pytest
from helpers.world import spawned_world


def _rank_times_ten(rank: int) -> int:
    return rank * 10


def _rank1_raises(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1's own error")
    return rank


def _rank1_dies_while_rank0_waits(rank: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        os._exit(9)
    dist.barrier()


def _sleeps(rank: int) -> None:
    time.sleep(60)


@pytest.mark.slow  # spawns three worlds
def test_a_world_reports_failures_deaths_and_hangs_and_is_replaced():
    assert spawned_world(2).run(_rank_times_ten) == [0, 10]
    with pytest.raises(RuntimeError, match="rank 1's own error"):
        spawned_world(2).run(_rank1_raises)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code 9\)"):
        spawned_world(2).run(_rank1_dies_while_rank0_waits)
    assert time.monotonic() - start < 60  # not the job's 300 s timeout, nor gloo's
    with pytest.raises(RuntimeError, match="did not finish in 3s"):
        spawned_world(2).run(_sleeps, timeout=3)
    assert spawned_world(2).run(_rank_times_ten) == [0, 10]
