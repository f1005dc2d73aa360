"""A small stateful dataloader: its position can be checkpointed and resumed batch-exactly.

The order of epoch `e` is a permutation drawn from `(seed, e)` alone, so the state is three
integers (epoch, batches consumed, seed) plus the sizes it was computed for. A loader restored
from `state_dict()` yields exactly the batches the original would have yielded next.

Iteration semantics (what a trainer's `for epoch ...: for batch in loader:` relies on):
- `iter(loader)` yields the rest of the current epoch; once an epoch is exhausted, the next
  `iter()` starts the following epoch with a fresh permutation.
- A batch counts as consumed when it is handed out, so a checkpoint saved after processing a
  batch resumes with the one after it. Leaving a loop early keeps the position (no restart).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from rlframe.data.dataset import collate_fn as default_collate_fn


class StatefulDataLoader:
    """Batches of `dataset` in a seed-determined order per epoch, with `state_dict`/`load_state_dict`."""

    def __init__(self, dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool = True,
                 collate_fn: Callable[[list], dict] = default_collate_fn):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size} "
                             "(data.train_batch_size); with drop_last=True no batch would ever be produced")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.epoch = 0
        self.batches_consumed = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        num_samples = len(self.dataset)
        if self.drop_last:
            return num_samples // self.batch_size
        return -(-num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch`: a function of (seed, epoch) only."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[dict]:
        if self.batches_consumed >= len(self):
            self.epoch += 1
            self.batches_consumed = 0
        order = self.epoch_order(self.epoch)
        while self.batches_consumed < len(self):
            start = self.batches_consumed * self.batch_size
            indices = order[start:start + self.batch_size]
            self.batches_consumed += 1  # before yielding: a checkpoint taken now resumes after this batch
            yield self.collate_fn([self.dataset[int(i)] for i in indices])

    def state_dict(self) -> dict:
        """The position: epoch, batches consumed in it, and what the order depends on."""
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size, "drop_last": self.drop_last,
                "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the dataset and order settings must be the ones it was saved with."""
        current = self.state_dict()
        for key in ("seed", "shuffle", "batch_size", "drop_last", "num_samples"):
            if state[key] != current[key]:
                raise ValueError(f"cannot resume the dataloader: the checkpoint has {key}={state[key]!r} but this "
                                 f"run has {key}={current[key]!r}; resuming would replay different batches "
                                 "(same data files, data.seed, data.shuffle and data.train_batch_size are needed)")
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])


def make_dataloader(dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool = True) -> StatefulDataLoader:
    """A resumable dataloader over `dataset` yielding dicts for `DataProto.from_single_dict`."""
    return StatefulDataLoader(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
