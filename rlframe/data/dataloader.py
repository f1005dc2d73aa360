"""The training and validation dataloaders: torchdata's `StatefulDataLoader`, resumable batch-exactly.

Shuffling uses torchdata's stateful `RandomSampler` driven by a `torch.Generator` seeded with
`data.seed`: every `iter(loader)` (one epoch) draws a new permutation from that generator, and the
loader's `state_dict()` holds the generator state at the start of the current epoch plus the number
of samples handed out in it. A loader restored from it yields exactly the batches the original would
have yielded next, mid-epoch or at an epoch boundary, and the epochs after that.

torchdata's sampler is used rather than `torch.utils.data.RandomSampler`: the latter is not
`Stateful`, so on restore torchdata would re-draw the permutation from a freshly seeded generator and
replay epoch 0's order in any later epoch.
"""

from __future__ import annotations

import warnings

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from rlframe.data.dataset import collate_fn

# What the sample order depends on besides the generator state; a checkpoint made with other values
# would replay different batches, so resuming with them is refused.
_ORDER_SETTINGS = ("seed", "shuffle", "batch_size", "drop_last", "num_samples")


class ResumableDataLoader(StatefulDataLoader):
    """torchdata's StatefulDataLoader whose state also records the settings the sample order depends on."""

    def __init__(self, dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool):
        # Shuffling without a torch.Generator of our own would consume the global RNG; the loader's own
        # generator only seeds worker processes, and there are none.
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle else None
        # num_workers=0: the prompts are tokenized up front and held in memory, so a batch is a few
        # tensor stacks in the driver process; worker processes would only add start-up and IPC.
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, deprecated in recent torch; nothing a user can act on.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            super().__init__(
                dataset,
                batch_size=batch_size,
                sampler=sampler,
                drop_last=drop_last,
                collate_fn=collate_fn,
                num_workers=0,
                generator=torch.Generator().manual_seed(seed),
            )
        self.order_settings = {
            "seed": seed,
            "shuffle": shuffle,
            "batch_size": batch_size,
            "drop_last": drop_last,
            "num_samples": len(dataset),
        }

    def state_dict(self) -> dict:
        """torchdata's loader state plus the order settings it is only valid for."""
        return {"loader": super().state_dict(), "order_settings": dict(self.order_settings)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the dataset and order settings must be the ones it was saved with."""
        for key in _ORDER_SETTINGS:
            saved, current = state["order_settings"][key], self.order_settings[key]
            if saved != current:
                raise ValueError(
                    f"cannot resume the dataloader: the checkpoint has {key}={saved!r} but this run "
                    f"has {key}={current!r}; resuming would replay different batches (same data files, "
                    "data.seed, data.shuffle and data.train_batch_size are needed)"
                )
        super().load_state_dict(state["loader"])


def make_dataloader(dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool = True) -> ResumableDataLoader:
    """A resumable dataloader over `dataset` yielding dicts for `DataProto.from_single_dict`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if drop_last and len(dataset) < batch_size:
        raise ValueError(
            f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size} "
            "(data.train_batch_size); with drop_last=True no batch would ever be produced"
        )
    return ResumableDataLoader(dataset, batch_size, shuffle, seed, drop_last)
