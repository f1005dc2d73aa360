"""Nothing lost across a resume: the prompts a checkpoint carries untrained come first in either trainer mode, a
resumed run's metrics replace the killed run's lines, and a step's metrics line is written before its checkpoint
counts as complete. (End to end across the two trainer modes: tests/e2e/test_async_e2e.py.)"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from rlframe.data.dataloader import make_dataloader
from rlframe.protocol import DataProto
from rlframe.trainer.checkpointing import TrainerCheckpointer
from rlframe.trainer.pending_prompts import PendingPrompts, plain_rows
from rlframe.trainer.tracking import Tracking


def prompts(*indices: int) -> list[DataProto]:
    return DataProto.from_single_dict({"index": torch.tensor(indices)}).split(1)


def indices(batch: DataProto) -> list[int]:
    return batch.batch["index"].tolist()


def loader():
    return make_dataloader([{"index": torch.tensor(i)} for i in range(8)], 4, shuffle=False, seed=0)


def test_without_pending_prompts_each_loader_batch_goes_as_it_is():
    assert [indices(b) for b in PendingPrompts().batches(loader(), 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_pending_prompts_come_first_regrouped_with_the_loaders_and_the_rest_stays_pending():
    pending = PendingPrompts()
    pending.restore({"pending_prompts": plain_rows(prompts(10, 11, 12))})
    assert [indices(b) for b in pending.batches(loader(), 4)] == [[10, 11, 12, 0], [1, 2, 3, 4]]
    assert [indices(row) for row in pending.rows] == [[5], [6], [7]]  # saved with the next checkpoint


def test_a_checkpoint_of_before_reads_under_its_old_name_and_one_without_the_entry_carries_none():
    pending = PendingPrompts()
    pending.restore({"global_step": 2, "async_prompts": plain_rows(prompts(5, 6))})
    assert [indices(row) for row in pending.rows] == [[5], [6]]
    empty = PendingPrompts()
    empty.restore({"global_step": 2, "kl_coef": 0.0})  # a synchronous checkpoint written before
    assert len(empty) == 0


def test_a_resumed_run_replaces_the_lines_logged_after_its_checkpoint(tmp_path):
    first = Tracking("p", "e", ["jsonl"], str(tmp_path))
    for step in (1, 2, 3):
        first.log({"x": step}, step)
    first._jsonl.write('{"step": 4, "x"')  # a line cut by the kill
    first.finish()
    resumed = Tracking("p", "e", ["jsonl"], str(tmp_path))
    assert resumed.drop_steps_after(2) == 2
    resumed.log({"x": 30}, 3)
    resumed.finish()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(line["step"], line["x"]) for line in lines] == [(1, 1), (2, 2), (3, 30)]


class _Role:
    def save_checkpoint(self, path: str) -> None:
        os.makedirs(path)
        with open(os.path.join(path, "weights"), "w") as f:
            f.write("w")


def test_the_steps_metrics_are_logged_before_its_checkpoint_counts_as_complete(tmp_path):
    trainer_cfg = SimpleNamespace(
        default_local_dir=str(tmp_path),
        resume_mode="auto",
        resume_from_path=None,
        max_actor_ckpt_to_keep=None,
        max_critic_ckpt_to_keep=None,
    )
    seen = []

    def before_complete():
        seen.append(sorted(os.listdir(tmp_path)))

    TrainerCheckpointer(trainer_cfg).save(1, _Role(), None, loader(), {"global_step": 1}, before_complete)
    assert seen == [["global_step_1.tmp"]]  # written, not yet renamed, no pointer
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", "latest_checkpointed_iteration.txt"]
