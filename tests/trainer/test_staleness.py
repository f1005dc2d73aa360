"""The staleness core (rlframe/trainer/staleness.py) under a simulated rollout pool with random generation times.

A discrete-event simulator drives `GroupLedger` the way `PooledSource` does: chunks of groups go to the
replica free soonest, each replica runs its chunks in order and a chunk takes a heavy-tailed random time, a step
starts when the ledger says `Take` and publishes a new version when it ends. After every event it checks the bound:
no admission past (L + 1) · B groups in flight, no trained group older than η; and what each strategy promises about
the prompts: `wait` and `regenerate` train each one exactly once, `drop` at most once (the rest counted), and every
run ends.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from rlframe.trainer.staleness import Evict, GroupLedger, Take, Wait


@dataclass
class Outcome:
    trained: list[list[int]] = field(default_factory=list)  # prompt positions per step
    staleness: list[int] = field(default_factory=list)
    evicted: int = 0
    peak_in_flight: int = 0
    left_untrained: int = 0


def simulate(prompts: int, batch: int, eta: int, lookahead: int, strategy: str, seed: int, replicas=1, chunk=None):
    """One run over `prompts` prompts; returns what was trained, checking the bound after every event."""
    rng = random.Random(seed)
    ledger = GroupLedger(batch, eta, lookahead, strategy)
    chunk = chunk or batch
    queue = deque(range(prompts))  # prompt positions not yet generated (a regenerated one goes first)
    position: dict[int, int] = {}
    free_at = [0.0] * replicas  # when each replica has run the chunks queued on it
    events: list = []  # (time, order, kind, payload)
    order = itertools.count()
    now, version, training, out = 0.0, 0, None, Outcome()
    for _ in range(100 * prompts + 100):  # every run ends well within this many events
        while ledger.room() and queue:
            size = min(chunk, ledger.room(), len(queue))
            gids = []
            for _ in range(size):
                gid = ledger.admit(version)
                position[gid] = queue.popleft()
                gids.append(gid)
            assert ledger.in_flight <= ledger.capacity
            replica = min(range(replicas), key=free_at.__getitem__)
            free_at[replica] = max(now, free_at[replica]) + rng.lognormvariate(0, 1.0)  # a long tail
            heapq.heappush(events, (free_at[replica], next(order), "generated", gids))
        if training is None:
            decision = ledger.decide(version + 1)
            if isinstance(decision, Evict):
                ledger.remove(decision.groups)
                out.evicted += len(decision.groups)
                if strategy == "regenerate":
                    queue.extendleft(position[g] for g in reversed(decision.groups))
                continue
            if isinstance(decision, Take):
                out.trained.append([position[g] for g in decision.groups])
                out.staleness += [ledger.staleness(g, version + 1) for g in decision.groups]
                training = decision.groups
                heapq.heappush(events, (now + rng.uniform(0.5, 2.0), next(order), "trained", None))
            else:
                assert isinstance(decision, Wait)
                if not ledger.running and not queue:  # end of data: fewer than B groups left
                    out.left_untrained = len(ledger.finished)
                    out.peak_in_flight = ledger.peak_in_flight
                    return out
        now, _, kind, gids = heapq.heappop(events)
        if kind == "generated":
            for gid in gids:
                ledger.finish(gid)
        else:
            ledger.remove(training)
            training, version = None, version + 1
    raise AssertionError("the run did not end: the ledger deadlocked")


GRID = [
    (eta, lookahead, strategy, replicas, chunk)
    for eta, lookahead in [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]
    for strategy in ("drop", "wait", "regenerate")
    for replicas, chunk in [(1, None), (3, 2), (4, 1)]
]


@pytest.mark.parametrize("eta,lookahead,strategy,replicas,chunk", GRID)
def test_no_trained_group_is_older_than_eta_and_admission_stays_within_the_rule(
    eta, lookahead, strategy, replicas, chunk
):
    batch, prompts = 4, 96
    for seed in range(4):
        out = simulate(prompts, batch, eta, lookahead, strategy, seed, replicas, chunk)
        assert max(out.staleness) <= eta
        assert out.peak_in_flight <= (lookahead + 1) * batch
        trained = [p for step in out.trained for p in step]
        assert len(trained) == len(set(trained)), "a prompt was trained twice"
        assert all(len(step) == batch for step in out.trained)
        if strategy == "drop":
            assert len(trained) + out.evicted + out.left_untrained == prompts
        else:
            assert out.evicted == 0 or strategy == "regenerate"
            assert len(trained) + out.left_untrained == prompts
            assert out.left_untrained < batch


def test_eta_0_trains_the_loader_order_batch_by_batch_as_the_sync_loop():
    out = simulate(24, 4, 0, 0, "drop", seed=1, replicas=3, chunk=1)
    assert out.trained == [list(range(i, i + 4)) for i in range(0, 24, 4)]
    assert set(out.staleness) == {0} and out.evicted == 0


def test_a_long_tail_makes_drop_evict_and_wait_hold_the_step_instead():
    dropped = sum(simulate(96, 4, 1, 1, "drop", seed, replicas=4, chunk=1).evicted for seed in range(4))
    assert dropped > 0  # the simulated tail does produce stale groups: the other strategies are really tested
    waited = [simulate(96, 4, 1, 1, "wait", seed, replicas=4, chunk=1) for seed in range(4)]
    assert all(out.evicted == 0 and max(out.staleness) <= 1 for out in waited)


def test_the_ledger_refuses_admission_past_capacity_and_bad_settings():
    ledger = GroupLedger(batch_groups=2, max_staleness=1, lookahead=1)
    for _ in range(4):
        ledger.admit(0)
    assert ledger.room() == 0
    with pytest.raises(RuntimeError, match="admission over capacity: 4 groups in flight of 4"):
        ledger.admit(0)
    with pytest.raises(ValueError, match="lookahead 2 must lie in"):
        GroupLedger(batch_groups=2, max_staleness=1, lookahead=2)
    with pytest.raises(ValueError, match="strategy 'skip'"):
        GroupLedger(batch_groups=2, max_staleness=1, lookahead=1, strategy="skip")


def test_wait_looks_ahead_where_holding_only_the_due_groups_would_let_one_go_stale():
    """η = 2, B = 1: groups a (version 0) and b (version 0) are running, c (version 1) has finished. Step 2 could
    train c, since nothing is due yet (a and b may wait until step 3); but then step 3 can train only one of a and b,
    and the other goes stale. rlframe's wait holds step 2 for a."""
    ledger = GroupLedger(batch_groups=1, max_staleness=2, lookahead=2, strategy="wait")
    a, b = ledger.admit(0), ledger.admit(0)
    c = ledger.admit(1)
    ledger.finish(c)
    assert isinstance(ledger.decide(2), Wait)
    ledger.finish(a)
    assert ledger.decide(2) == Take([a])
    ledger.remove([a])
    ledger.finish(b)
    assert ledger.decide(3) == Take([b])
