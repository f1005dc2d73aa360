"""The staleness core of `separate_async`: which groups may start generating, and which a step trains.

Pure bookkeeping, no Ray and no tensors: the trainer and the simulator in tests/trainer/test_staleness.py drive the
same `GroupLedger`, so the bound the simulator checks under random delays is the trainer's bound.

Definitions (docs/async.md states them for users):

- version v: the weights after v training steps. Step s trains from version s - 1 and publishes version s.
- a group's admission version: the published version when its prompt was submitted for generation.
- staleness of a group trained in step s: (s - 1) - admission version. verl's "span" is staleness + 1, so verl's
  `max_off_policy_threshold` is η + 1, where η is the largest staleness a trained group may have.
- admission (AReaL's rule in groups): a group may start only while finished-but-untrained plus running groups stay
  within (L + 1) · B, where B is train_batch_size and L the lookahead, at most η.
- a step takes the B finished groups with the oldest admission version, in admission order. Finished groups older
  than η are never trained: `drop` evicts them (verl's meaning); `regenerate` evicts them too and the trainer
  generates their prompts again at the current version, so each prompt is still trained once; `wait` holds the
  step while training the oldest finished groups would leave a running group unable to be trained within η (verl's
  `wait` holds it while a running group has reached η; rlframe's rule looks further ahead, so that no group ever
  goes stale, which verl's does not guarantee once several groups fall due at once).
- a resumed run's ledger first takes back the finished groups its checkpoint carried, with their admission versions
  (`restore`): they are trained or evicted by the same rules. Under `wait` one already past η (a run resumed with a
  smaller η) is evicted too, and its prompt generated again: no waiting can make it younger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("drop", "wait", "regenerate")


@dataclass(frozen=True)
class Take:
    """Train these groups now (B of them, oldest admission version first)."""

    groups: list[int]


@dataclass(frozen=True)
class Evict:
    """These finished groups are older than η: they are never trained (drop, or regenerate their prompts; under wait
    only restored groups are, and their prompts are regenerated)."""

    groups: list[int]


@dataclass(frozen=True)
class Wait:
    """The step cannot start yet: `reason` says why (fewer than B finished groups, or a running group at η)."""

    reason: str


@dataclass
class GroupLedger:
    """Every group from admission until it is trained or evicted, by id (admission order)."""

    batch_groups: int  # B: groups per training step (data.train_batch_size)
    max_staleness: int  # η = max_off_policy_threshold - 1
    lookahead: int  # L = min(num_warmup_batches, η)
    strategy: str = "drop"
    running: dict[int, int] = field(default_factory=dict)  # id -> admission version
    finished: dict[int, int] = field(default_factory=dict)
    restored: set[int] = field(default_factory=set)  # finished groups a checkpoint carried, until removed
    next_id: int = 0
    peak_in_flight: int = 0  # the most finished-untrained plus running groups seen at once

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: one of {STRATEGIES}")
        if not 0 <= self.lookahead <= self.max_staleness:
            raise ValueError(f"lookahead {self.lookahead} must lie in [0, η={self.max_staleness}]")

    @property
    def capacity(self) -> int:
        """(L + 1) · B: the most groups finished-but-untrained and running at once."""
        return (self.lookahead + 1) * self.batch_groups

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.finished)

    def room(self) -> int:
        """How many more groups may start now."""
        return max(self.capacity - self.in_flight, 0)

    def admit(self, version: int) -> int:
        """A group starts generating under published `version`; returns its id."""
        if self.room() == 0:
            raise RuntimeError(f"admission over capacity: {self.in_flight} groups in flight of {self.capacity}")
        gid, self.next_id = self.next_id, self.next_id + 1
        self.running[gid] = version
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return gid

    def restore(self, version: int) -> int:
        """A finished group a checkpoint carried, admitted at `version` by the run that saved it, joins the finished
        groups under a new id; returns it. Restored before any admission, they keep the admission order. The capacity
        is not checked: the saving run kept them within its own."""
        gid, self.next_id = self.next_id, self.next_id + 1
        self.finished[gid] = version
        self.restored.add(gid)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return gid

    def finish(self, gid: int) -> None:
        """The group's responses are all back."""
        self.finished[gid] = self.running.pop(gid)

    def staleness(self, gid: int, step: int) -> int:
        """Staleness of group `gid` if step `step` trains it."""
        version = self.finished[gid] if gid in self.finished else self.running[gid]
        return step - 1 - version

    def decide(self, step: int) -> Take | Evict | Wait:
        """What step `step` (training from version step - 1) does next. The groups it takes stay in the ledger,
        counted in flight, until `remove` after the update: admission never runs ahead of the bound meanwhile."""
        stale = [g for g in self.finished if self.staleness(g, step) > self.max_staleness]
        if stale:
            if self.strategy == "wait" and not self.restored.issuperset(stale):  # `_keeps_every_deadline` prevents it
                raise AssertionError(f"step {step}: groups {stale} went past η={self.max_staleness} under wait")
            return Evict(stale)
        if len(self.finished) < self.batch_groups:
            return Wait(f"{len(self.finished)} of {self.batch_groups} groups finished")
        take = sorted(self.finished, key=lambda g: (self.finished[g], g))[: self.batch_groups]
        if self.strategy == "wait" and not self._keeps_every_deadline(step, take):
            return Wait(f"older running groups must be trained within η={self.max_staleness}")
        return Take(take)

    def _keeps_every_deadline(self, step: int, take: list[int]) -> bool:
        """After step `step` trains `take`, can every other group still be trained by its last step (admission
        version + η + 1), at B groups per step? Then taking the oldest finished groups never makes one stale: the
        admission rule keeps this true whenever every group has finished, so the step waits only for running ones.
        """
        taken = set(take)
        rest = [v for g, v in (*self.running.items(), *self.finished.items()) if g not in taken]
        deadlines = sorted(v + self.max_staleness + 1 for v in rest)
        return all(i + 1 <= (d - step) * self.batch_groups for i, d in enumerate(deadlines))

    def remove(self, groups: list[int]) -> None:
        """The groups were trained or evicted: they leave the ledger and free their room."""
        for gid in groups:
            del self.finished[gid]
            self.restored.discard(gid)
