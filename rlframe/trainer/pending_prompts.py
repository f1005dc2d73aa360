"""Prompts a checkpoint carries untrained, so that a resume in either trainer mode trains each prompt exactly once.

The loader's saved position is past every prompt it has handed out. An asynchronous run has handed out more than it
has trained: the groups generating, those finished but not trained yet (kept whole: `finished_groups.py`), and the
prompts waiting for room. The synchronous loop, resuming such a checkpoint, may be left with rows that do not fill a
loader batch. Both keep the prompts not kept whole in the driver state as `pending_prompts`, oldest first; a resumed
run in either mode takes them before the loader's next ones (`PendingPrompts`). Their responses are not saved: a
resumed run generates them again.
Checkpoints written before this file named the entry `async_prompts`; it is read under that name too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from rlframe.models.vision import load_image, png_bytes
from rlframe.protocol import DataProto

STATE_KEY = "pending_prompts"
OLD_STATE_KEYS = ("async_prompts",)  # the name before: separate_async's checkpoints


class PendingPrompts:
    """One prompt per entry, oldest first; what the loop takes before the loader's next batch."""

    def __init__(self):
        self.rows: deque[DataProto] = deque()

    def __len__(self) -> int:
        return len(self.rows)

    def restore(self, driver_state: dict) -> None:
        """Take the prompts a checkpoint carried (none from a checkpoint that has the entry under no name)."""
        for key in (STATE_KEY, *OLD_STATE_KEYS):
            if key in driver_state:
                self.rows.extend(rows_from_plain(driver_state[key]))
                return

    def batches(self, loader: Iterable[dict], size: int) -> Iterator[DataProto]:
        """One pass over the loader as batches of `size` prompts, the pending ones first. With none pending, each
        loader batch as it is; else the pending prompts and the loader's rows regrouped, and what does not fill a
        batch stays pending (saved with the next checkpoint)."""
        for batch_dict in loader:
            batch = DataProto.from_single_dict(batch_dict)
            if not self.rows and len(batch) == size:
                yield batch
                continue
            self.rows.extend(batch.split(1))
            while len(self.rows) >= size:
                yield DataProto.concat([self.rows.popleft() for _ in range(size)])


def plain_rows(rows: list[DataProto]) -> dict:
    """Prompt rows as plain data for a checkpoint's data.pt: their tensors, and their other fields as lists."""
    if not rows:
        return {"tensors": {}, "fields": {}}
    batch = DataProto.concat(rows)
    fields = {key: values.tolist() for key, values in batch.non_tensor_batch.items()}
    if "multi_modal_data" in fields:  # PIL images as PNG bytes: data.pt holds plain data only
        fields["multi_modal_data"] = [
            {"image": [png_bytes(i) for i in d.get("image", [])]} for d in fields["multi_modal_data"]
        ]
    return {"tensors": {key: batch.batch[key] for key in batch.batch_keys}, "fields": fields}


def rows_from_plain(plain: dict) -> list[DataProto]:
    """Inverse of `plain_rows`: one DataProto per prompt."""
    if not plain["tensors"]:
        return []
    fields, plain_fields = {}, dict(plain["fields"])
    if "multi_modal_data" in plain_fields:
        plain_fields["multi_modal_data"] = [
            {"image": [load_image(b, "data.pt") for b in d["image"]]} for d in plain_fields["multi_modal_data"]
        ]
    for key, values in plain_fields.items():  # object arrays, as the loader's collate_fn builds them
        fields[key] = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):  # element by element: a row's value may itself be a list
            fields[key][i] = value
    return DataProto.from_single_dict({**plain["tensors"], **fields}).split(1)
