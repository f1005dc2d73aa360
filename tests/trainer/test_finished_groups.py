"""Finished-but-untrained groups across a resume (rlframe/trainer/finished_groups.py): an asynchronous checkpoint
keeps them whole, a resumed asynchronous run puts them back into its ledger with their admission versions and trains
them without generating them again, a synchronous one generates their prompts again first. (End to end:
tests/e2e/test_async_e2e.py.)"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from rlframe.data.dataloader import make_dataloader
from rlframe.protocol import DataProto, plain_data
from rlframe.trainer.checkpointing import CHECKPOINT_REFUSAL, TrainerCheckpointer, load_data
from rlframe.trainer.config import compose
from rlframe.trainer.finished_groups import FinishedGroup, check_rollout_n, plain_groups, saved_groups
from rlframe.trainer.pending_prompts import PendingPrompts
from rlframe.trainer.pooled_source import PooledSource
from rlframe.trainer.ray_trainer import RayPPOTrainer
from rlframe.trainer.rollout_stage import Scorer, SourceInputs
from rlframe.trainer.staleness import Evict, GroupLedger, Take
from rlframe.workers.rollout.base import VERSIONS_KEY

N, PROMPT_LEN, RESPONSE_LEN = 2, 3, 2


def prompt(index: int, image: bool = False) -> DataProto:
    row = DataProto.from_single_dict(
        {
            "input_ids": torch.full((1, PROMPT_LEN), index),
            "attention_mask": torch.ones(1, PROMPT_LEN, dtype=torch.long),
            "position_ids": torch.arange(PROMPT_LEN)[None],
            "index": np.array([index], dtype=object),
        }
    )
    if image:  # a vision-language prompt's image travels as a PIL image in multi_modal_data
        picture = Image.fromarray(np.full((4, 4, 3), index * 10, dtype=np.uint8))
        row.non_tensor_batch["multi_modal_data"] = np.array([{"image": [picture]}], dtype=object)
    return row


def group(index: int, version: int, image: bool = False) -> FinishedGroup:
    """A generated group: n rows whose response tokens are the prompt's index plus the sample's number, sampled by
    `version`, with the engine's log-probs."""
    rows = prompt(index, image).repeat(N, interleave=True)
    responses = torch.tensor([[index + j] * RESPONSE_LEN for j in range(N)])
    rows.batch["responses"] = responses
    rows.batch["response_mask"] = torch.ones(N, RESPONSE_LEN, dtype=torch.long)
    rows.batch["rollout_log_probs"] = -torch.rand(N, RESPONSE_LEN)
    rows.batch[VERSIONS_KEY] = torch.full((N, RESPONSE_LEN), version)
    rows.non_tensor_batch["uid"] = np.array([f"group-{index}"] * N, dtype=object)
    return FinishedGroup(version, prompt(index, image), rows)


def through_data_pt(entry, tmp_path):
    """As a checkpoint writes and reads it: plain data in data.pt, loaded with weights_only."""
    torch.save(plain_data(entry, "data.pt", CHECKPOINT_REFUSAL), tmp_path / "data.pt")
    return load_data(str(tmp_path / "data.pt"))


# ---------------------------------------------------------------- the ledger
def test_restored_groups_keep_their_versions_and_are_taken_first_oldest_first():
    ledger = GroupLedger(batch_groups=2, max_staleness=1, lookahead=1)
    restored = [ledger.restore(1), ledger.restore(1)]
    assert restored == [0, 1] and ledger.restored == {0, 1}
    assert ledger.in_flight == 2 and ledger.room() == 2  # they count against (L + 1) · B
    admitted = [ledger.admit(2), ledger.admit(2)]
    for gid in admitted:
        ledger.finish(gid)
    assert ledger.decide(3) == Take(restored)  # step 3 trains from version 2: staleness 1 ≤ η
    assert ledger.staleness(0, 3) == 1
    ledger.remove(restored)
    assert ledger.restored == set() and ledger.decide(4) == Take(admitted)


@pytest.mark.parametrize("strategy", ["drop", "regenerate", "wait"])
def test_a_restored_group_older_than_eta_is_evicted_under_every_strategy(strategy):
    """A run resumed with a smaller η: under `wait` too (no waiting makes it younger; its prompt is generated
    again), while a group of the resumed run's own past η under `wait` is still a broken promise."""
    ledger = GroupLedger(batch_groups=1, max_staleness=0, lookahead=0, strategy=strategy)
    old, fresh = ledger.restore(1), ledger.restore(2)
    assert ledger.decide(3) == Evict([old])
    ledger.remove([old])
    assert ledger.decide(3) == Take([fresh])
    ledger.remove([fresh])
    if strategy == "wait":
        ledger.finish(ledger.admit(1))
        with pytest.raises(AssertionError, match="past η=0 under wait"):
            ledger.decide(3)


# ---------------------------------------------------------------- the driver-state entry
def test_finished_groups_round_trip_through_data_pt_with_their_rows_versions_and_images(tmp_path):
    groups = [group(3, version=1, image=True), group(4, version=2, image=True)]
    entry, unsaved = plain_groups(groups, N)
    assert unsaved == []
    back = saved_groups({"finished_groups": through_data_pt(entry, tmp_path)})
    assert [g.version for g in back] == [1, 2]
    for before, after in zip(groups, back):
        for key in before.rows.batch_keys:
            assert torch.equal(after.rows.batch[key], before.rows.batch[key]), key
        for key in before.prompt.batch_keys:
            assert torch.equal(after.prompt.batch[key], before.prompt.batch[key]), key
        assert after.rows.non_tensor_batch["uid"].tolist() == before.rows.non_tensor_batch["uid"].tolist()
    images = [np.asarray(d["image"][0]) for d in back[0].rows.non_tensor_batch["multi_modal_data"]]
    assert len(images) == N and all((image == 30).all() and image.shape == (4, 4, 3) for image in images)
    assert np.asarray(back[0].prompt.non_tensor_batch["multi_modal_data"][0]["image"][0]).tolist() == images[0].tolist()


def test_a_checkpoint_without_the_entry_or_with_none_restores_no_group(tmp_path):
    assert saved_groups({"global_step": 2, "kl_coef": 0.0}) == []  # written before the entry existed
    entry, _ = plain_groups([], N)
    assert saved_groups({"finished_groups": through_data_pt(entry, tmp_path)}) == []


def test_a_group_with_a_value_a_checkpoint_cannot_hold_is_kept_as_its_prompt():
    odd = group(5, version=1)
    odd.rows.non_tensor_batch["extra"] = np.array([object()] * N, dtype=object)
    entry, unsaved = plain_groups([group(4, version=1), odd], N)
    assert entry["versions"] == [1] and unsaved == [odd.prompt]


def test_an_asynchronous_resume_with_another_rollout_n_is_refused_naming_the_key_and_both_values():
    entry, _ = plain_groups([group(1, version=0)], N)
    check_rollout_n({"finished_groups": entry}, N, "trainer.v1.trainer_mode=separate_async")
    check_rollout_n({"global_step": 2}, 4, "trainer.v1.trainer_mode=separate_async")  # nothing to restore
    with pytest.raises(ValueError) as error:
        check_rollout_n({"finished_groups": entry}, 4, "trainer.v1.trainer_mode=separate_async")
    message = str(error.value)
    assert "actor_rollout_ref.rollout.n=2" in message and "actor_rollout_ref.rollout.n=4" in message
    assert "trainer.v1.trainer_mode=sync" in message


def test_the_trainers_driver_state_keeps_finished_groups_whole_and_the_rest_as_prompts(tmp_path):
    """`RayPPOTrainer._driver_state` and `_restore_driver_state` around data.pt, with a stand-in source."""
    saved_source = SimpleNamespace(
        finished_groups=lambda: [group(7, version=1)], untrained_prompts=lambda: [prompt(8), prompt(9)]
    )
    trainer = SimpleNamespace(
        source=saved_source, plan=SimpleNamespace(n=N), global_step=2, kl_ctrl=SimpleNamespace(value=0.5)
    )
    state = through_data_pt(RayPPOTrainer._driver_state(trainer), tmp_path)
    restored = []
    source = SimpleNamespace(restore_finished=restored.extend)
    resumed = SimpleNamespace(pending=PendingPrompts(), kl_ctrl=SimpleNamespace(value=0.0), source=source)
    RayPPOTrainer._restore_driver_state(resumed, state)
    assert resumed.global_step == 2 and resumed.kl_ctrl.value == 0.5
    assert [int(row.non_tensor_batch["index"][0]) for row in resumed.pending.rows] == [8, 9]
    assert [g.version for g in restored] == [1] and restored[0].rows.batch["responses"][:, 0].tolist() == [7, 8]


# ---------------------------------------------------------------- the asynchronous source
class Replica:
    """A stand-in rollout replica: it records what it is sent (nothing comes back in these tests)."""

    def __init__(self):
        self.sent: list[DataProto] = []

    def submit(self, method: str, rows: DataProto):
        self.sent.append(rows)
        return SimpleNamespace()


def pooled_source(total_steps: int, loader_prompts: int, n: int = N):
    config = compose(
        [
            f"actor_rollout_ref.rollout.n={n}",
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.sampler.max_off_policy_threshold=2",  # η = 1, L = 1
        ]
    )
    plan = SimpleNamespace(n=n, train_batch_size=2, filter_groups=False)
    rows = [{k: v[0] for k, v in prompt(100 + i).batch.items()} for i in range(loader_prompts)]
    loader = make_dataloader(rows, 2, shuffle=False, seed=0)

    def score(batch, return_dict):
        return {"reward_tensor": batch.batch["responses"].float(), "dropped": torch.zeros(len(batch), dtype=bool)}

    inputs = SourceInputs(config, plan, loader, PendingPrompts(), Scorer(config, score, None))
    replica = Replica()
    replicas = SimpleNamespace(
        views=[replica],
        partial_rollout=False,
        own_processes=True,
        sample_end=lambda step: None,
        publish=lambda version: SimpleNamespace(result=lambda: None),
        push_metrics=dict,
    )
    source = PooledSource(inputs, replicas, total_steps)
    source._batches = source._loader_batches()  # `start` without the weight push
    return source, replica


def test_a_resumed_pooled_source_trains_the_restored_groups_first_without_generating_them():
    source, replica = pooled_source(total_steps=4, loader_prompts=4)
    source.check_resumable({"finished_groups": plain_groups([group(1, 1)], N)[0]})
    source.restore_finished([group(1, version=1), group(2, version=1)])
    assert [g.version for g in source.finished_groups()] == [1, 1] and source.untrained_prompts() == []
    source.published_version = 2  # the resumed checkpoint's weights
    ready = source.next_batch(3)
    assert ready.batch.batch["token_level_scores"][:, 0].tolist() == [1, 2, 2, 3]  # the saved responses
    assert ready.metrics["async/restored_groups"] == 2
    assert ready.metrics["training/off_policy/trajectory_staleness/max"] == 1  # sampled by version 1, as saved
    # only the loader's prompts went to the replica (step 4's groups, n rows each), none of the restored ones
    source.after_update(3, {})
    assert [int(i) for rows in replica.sent for i in rows.batch["input_ids"][:, 0]] == [100, 100, 101, 101]
    assert source.finished_groups() == [] and len(source.untrained_prompts()) == 2  # generating: saved as prompts


def test_a_pooled_source_under_remax_generates_a_checkpoints_finished_groups_again():
    source, _ = pooled_source(total_steps=4, loader_prompts=4)
    source.remax = True  # the greedy baselines are not in the checkpoint
    source.restore_finished([group(1, version=1)])
    assert source.ledger.in_flight == 0 and [int(r.non_tensor_batch["index"][0]) for r in source.pending.rows] == [1]


class Role:
    """A stand-in worker group: what it was asked to save and load."""

    def __init__(self):
        self.loaded: list[str] = []

    def save_checkpoint(self, path):
        os.makedirs(path)

    def load_checkpoint(self, path):
        self.loaded.append(path)


def test_another_rollout_n_is_refused_at_resume_before_the_workers_load_the_checkpoint(tmp_path):
    """Through the checkpointer and the pooled source's check: the error names the checkpoint, the key and both
    values, and no worker has loaded anything."""
    config = SimpleNamespace(
        default_local_dir=str(tmp_path),
        resume_mode="auto",
        resume_from_path=None,
        max_actor_ckpt_to_keep=None,
        max_critic_ckpt_to_keep=None,
    )
    loader = SimpleNamespace(state_dict=lambda: {"yielded": 4}, load_state_dict=lambda state: None)
    entry, _ = plain_groups([group(1, version=1)], N)
    TrainerCheckpointer(config).save(2, Role(), None, loader, {"global_step": 2, "finished_groups": entry})
    four, _ = pooled_source(total_steps=4, loader_prompts=4, n=4)
    actor = Role()
    refused = r"global_step_2: .*actor_rollout_ref\.rollout\.n=2 .*actor_rollout_ref\.rollout\.n=4"
    with pytest.raises(ValueError, match=refused):
        TrainerCheckpointer(config).maybe_resume(actor, None, loader, check_driver=four.check_resumable)
    assert actor.loaded == []
    same, _ = pooled_source(total_steps=4, loader_prompts=4)
    assert TrainerCheckpointer(config).maybe_resume(actor, None, loader, check_driver=same.check_resumable)
    assert actor.loaded == [str(tmp_path / "global_step_2" / "actor")]
