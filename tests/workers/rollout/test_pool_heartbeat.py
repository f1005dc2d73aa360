"""Pooled CPU generation outlasting the process group's timeout (rollout/pool.py, `_Heartbeat`).

The ranks that wait for rank 0's generation poll its heartbeat in the store instead of waiting in a
collective: a generation of 8 s in a group whose timeout is 3 s gives every rank its rows; a rank 0 that
dies in the middle of generating gives the other rank an error naming rank 0 and what it was doing.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.rollout import load_tokenizer, make_prompts, rollout_config
from helpers.world import spawned_world

from rlframe.workers.rollout import build_rollout, pool

LENGTHS = [(8, 3), (5, 2, 6)]


def _slow_rollout(model_path: str, rank: int, seconds: float, then=None):
    """The HF rollout on CPU whose generation on rank 0 sleeps `seconds` first (and then calls `then`)."""
    rollout = build_rollout("hf", rollout_config(), model_path, load_tokenizer(model_path), "cpu")
    real = rollout.generate_sequences

    def slow(batch):
        time.sleep(seconds)
        if then is not None:
            then()
        return real(batch)

    if rank == 0:
        rollout.generate_sequences = slow
    return rollout


def _outlasting_worker(rank: int, model_path: str) -> int:
    pool.HEARTBEAT_S = 0.5
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))  # every collective of it: 3 s at most
    rollout = _slow_rollout(model_path, rank, seconds=8)
    rows = pool.generate_pooled(rollout, make_prompts(LENGTHS[rank], seed=rank), group)
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return len(rows)


@pytest.mark.slow  # a multi-process world: over 6 s on 2 cores (tests/README.md)
def test_a_generation_longer_than_the_group_timeout_reaches_every_rank(tiny_model_path):
    assert spawned_world(2).run(_outlasting_worker, tiny_model_path) == [len(lengths) for lengths in LENGTHS]


def _dying_rank(rank: int, store_path: str, model_path: str, results) -> None:
    """Rank `rank` of a fresh 2-process world (a FileStore that outlives rank 0): rank 0 dies generating."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    pool.HEARTBEAT_S, pool.MISSED_HEARTBEATS = 0.2, 3
    rollout = _slow_rollout(model_path, rank, seconds=1, then=lambda: os._exit(3))
    try:
        pool.generate_pooled(rollout, make_prompts(LENGTHS[rank], seed=rank), dist.group.WORLD)
        results.put("no error")
    except RuntimeError as error:
        results.put(str(error))
    results.close()
    results.join_thread()  # the message is through before the process ends
    os._exit(0)  # not destroy_process_group: its peer is gone


@pytest.mark.slow  # two fresh processes: over 6 s on 2 cores
def test_rank_0_dying_while_generating_gives_the_others_a_clear_error(tiny_model_path, tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_dying_rank, args=(rank, str(tmp_path / "store"), tiny_model_path, results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        message = results.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert procs[0].exitcode == 3  # died inside its generation
    assert message == (
        "pooled generation: rank 0 of the machine stopped beating while generating the 5 rows of the 2 ranks "
        "of this machine: 3 heartbeats of 0.2 s missed, so it died or hangs (see its log for why)"
    )
