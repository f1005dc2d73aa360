"""Load and skew: dynamic micro-batching on 4 gloo ranks over 100 random, skewed batches.

In each batch one rank (a different one each time) holds only long sequences (half the budget to
the whole budget) and the others short ones, in random lengths; every rank holds the same number of
sequences, as the driver's dispatch makes it. Every rank must cut its share into the same number of
micro-batches (else FSDP's collectives would wait forever), every micro-batch must stay within the
token budget, and every sequence must be in exactly one micro-batch. A hang would fail the test
through the job's timeout; the test asserts what every rank saw.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers.world import spawned_world
from tensordict import TensorDict

from rlframe.seqpack import rearrange_micro_batches

WORLD, NUM_BATCHES, BUDGET = 4, 100, 1024


def skewed_lengths(batch: int, rank: int) -> list[int]:
    """This rank's sequence lengths in batch `batch`: all long on rank batch % WORLD, short elsewhere."""
    count = int(np.random.default_rng(batch).integers(4, 17))  # equal on every rank, as dispatch makes them
    rng = np.random.default_rng(batch * WORLD + rank)
    if rank == batch % WORLD:
        return rng.integers(BUDGET // 2, BUDGET + 1, count).tolist()
    return rng.integers(1, 64, count).tolist()


def _rank_seen(rank: int) -> list[dict]:
    seen = []
    for batch in range(NUM_BATCHES):
        lengths = skewed_lengths(batch, rank)
        mask = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        for row, length in enumerate(lengths):
            mask[row, -length:] = 1
        data = TensorDict({"attention_mask": mask}, batch_size=[len(lengths)])
        micro, groups = rearrange_micro_batches(data, BUDGET, dp_group=dist.group.WORLD)
        seen.append(
            {
                "count": len(micro),
                "largest": max(int(mb["attention_mask"].sum()) for mb in micro),
                "covered": sorted(i for group in groups for i in group) == list(range(len(lengths))),
            }
        )
    return seen


@pytest.mark.slow
def test_dynamic_micro_batching_on_skewed_ranks_never_hangs_or_exceeds_the_budget():
    ranks = spawned_world(WORLD).run(_rank_seen, timeout=120)
    assert all(len(seen) == NUM_BATCHES for seen in ranks)
    for batch in range(NUM_BATCHES):
        counts = {ranks[r][batch]["count"] for r in range(WORLD)}
        assert len(counts) == 1, f"batch {batch}: micro-batch counts differ across ranks: {counts}"
        long_rank = ranks[batch % WORLD][batch]
        assert long_rank["count"] >= 2  # the long rank needs several micro-batches; the short ones follow it
        for r in range(WORLD):
            assert ranks[r][batch]["largest"] <= BUDGET and ranks[r][batch]["covered"], (batch, r)
