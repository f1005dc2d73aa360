"""Checkpoints against crafted files, corruption and a full disk: the real save/resume code, in one process.

The checkpoints are the trainer's (`global_step_N/` with actor and critic shards, `data.pt` and the
manifest), written by `tests/helpers/faults_harness.py`'s miniature run: two steps, a checkpoint after each.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import shutil
from contextlib import contextmanager

import pytest
import torch
from helpers.faults_harness import run_steps

from rlframe.utils.manifest import MANIFEST, CorruptCheckpointError, write_manifest
from rlframe.workers import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def two_steps(tiny_model_path, tmp_path_factory):
    """A run folder with complete checkpoints of steps 1 and 2, and the records of what each holds."""
    root = tmp_path_factory.mktemp("run")
    records = tmp_path_factory.mktemp("records")
    run_steps(str(root / "ckpt"), tiny_model_path, 2, str(records))
    return str(root / "ckpt"), str(records)


@pytest.fixture
def run_dir(two_steps, tmp_path):
    """A private copy of the two-step run folder."""
    root, records = two_steps
    shutil.copytree(root, tmp_path / "ckpt")
    return str(tmp_path / "ckpt"), records


def checkpoint_files(step_dir: str) -> list[str]:
    """Every file of a step folder but the manifest (relative paths)."""
    found = []
    for parent, _, names in os.walk(step_dir):
        found += [os.path.relpath(os.path.join(parent, n), step_dir) for n in names if n != MANIFEST]
    return sorted(found)


def test_a_checkpoint_has_seven_files_per_role_layout(two_steps):
    root, _ = two_steps
    files = checkpoint_files(os.path.join(root, "global_step_2"))
    role = ["extra_state/rank_0.pt", "model/.metadata", "model/__0_0.distcp"]
    role += ["optimizer/.metadata", "optimizer/__0_0.distcp"]
    assert files == sorted(["data.pt", *(f"actor/{f}" for f in role), *(f"critic/{f}" for f in role)])


# ---------------------------------------------------------------- 3: checkpoints are data, not code
class _RunsCode:
    """Unpickling this calls os.system: what a crafted checkpoint file would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def craft(path: str, marker: str) -> None:
    """Put a payload that creates `marker` when unpickled where the loader of `path` will unpickle it."""
    if path.endswith(".metadata"):  # DCP's index: a plain pickle
        with open(path, "wb") as f:
            pickle.dump(_RunsCode(marker), f)
    elif path.endswith(".distcp"):  # a shard: the payload at the offset of its largest stored item
        reader = ckpt.SafeFileSystemReader(os.path.dirname(path))
        items = [info for info in reader.read_metadata().storage_data.values()]
        largest = max(items, key=lambda info: info.length)
        payload = io.BytesIO()
        torch.save(_RunsCode(marker), payload, _use_new_zipfile_serialization=False)  # a pickle stream
        assert len(payload.getvalue()) <= largest.length
        with open(path, "r+b") as f:
            f.seek(largest.offset)
            f.write(payload.getvalue())
    else:  # data.pt, extra_state/rank_<r>.pt
        torch.save({"dataloader": _RunsCode(marker), "world_size": 1, "rng": _RunsCode(marker)}, path)


FILES = sorted(
    ["data.pt"]
    + [
        f"{role}/{f}"
        for role in ("actor", "critic")
        for f in (
            "extra_state/rank_0.pt",
            "model/.metadata",
            "model/__0_0.distcp",
            "optimizer/.metadata",
            "optimizer/__0_0.distcp",
        )
    ]
)


@pytest.mark.parametrize("name", FILES)
def test_crafted_pickle_in_any_checkpoint_file_is_refused_and_never_runs(run_dir, tiny_model_path, tmp_path, name):
    root, records = run_dir
    step_dir = os.path.join(root, "global_step_2")
    marker = str(tmp_path / "pwned")
    craft(os.path.join(step_dir, name), marker)
    write_manifest(step_dir)  # whoever can write the folder can rewrite the manifest too
    with pytest.raises((pickle.UnpicklingError, RuntimeError)) as refused:
        run_steps(root, tiny_model_path, 2, records)
    assert os.path.join(step_dir, name) in str(refused.value)
    assert "refusing to load it" in str(refused.value)
    assert not os.path.exists(marker)


def test_crafted_file_without_a_matching_manifest_is_never_unpickled(run_dir, tiny_model_path, tmp_path, caplog):
    root, records = run_dir
    marker = str(tmp_path / "pwned")
    craft(os.path.join(root, "global_step_2", "actor", "model", ".metadata"), marker)
    with caplog.at_level(logging.WARNING, logger="rlframe"):
        found = run_steps(root, tiny_model_path, 2, records)
    assert found["resumed"] == 1 and found["matches"]  # fell back to the previous complete checkpoint
    assert "global_step_2/actor/model/.metadata" in caplog.text and not os.path.exists(marker)


# ---------------------------------------------------------------- 4: manifest, fallback
def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "truncated shard": (lambda d: truncate(os.path.join(d, "actor/model/__0_0.distcp")), "actor/model/__0_0.distcp is"),
    "corrupted shard": (
        lambda d: flip_a_byte(os.path.join(d, "critic/optimizer/__0_0.distcp")),
        "critic/optimizer/__0_0.distcp does not match its SHA-256",
    ),
    "lost file": (lambda d: os.remove(os.path.join(d, "data.pt")), "data.pt is missing"),
    "interrupted save (no manifest)": (lambda d: os.remove(os.path.join(d, MANIFEST)), f"has no {MANIFEST}"),
    "stray file": (lambda d: open(os.path.join(d, "actor", "x.pt"), "w").close(), "actor/x.pt is not in"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_previous_complete_one(run_dir, tiny_model_path, caplog, damage):
    root, records = run_dir
    do, message = DAMAGE[damage]
    do(os.path.join(root, "global_step_2"))
    with caplog.at_level(logging.WARNING, logger="rlframe"):
        found = run_steps(root, tiny_model_path, 3, records)
    assert found["resumed"] == 1 and found["matches"]
    assert message in caplog.text and "falling back to the previous complete checkpoint" in caplog.text
    assert os.path.join(root, "global_step_1") in caplog.text


def test_explicit_resume_path_with_a_damaged_file_fails_naming_it(run_dir, tiny_model_path):
    from helpers.faults_harness import LocalRole, checkpointer, make_loader

    root, _ = run_dir
    truncate(os.path.join(root, "global_step_2", "data.pt"))
    saver = checkpointer(root)
    saver.resume_mode, saver.resume_from_path = "resume_path", os.path.join(root, "global_step_2")
    with pytest.raises(CorruptCheckpointError, match=r"global_step_2/data.pt is \d+ bytes, the manifest says"):
        saver.maybe_resume(LocalRole(tiny_model_path, 0), None, make_loader())


def test_no_complete_checkpoint_left_is_an_error_not_a_fresh_start(run_dir, tiny_model_path):
    root, records = run_dir
    for step in (1, 2):
        truncate(os.path.join(root, f"global_step_{step}", "critic", "model", "__0_0.distcp"))
    with pytest.raises(CorruptCheckpointError, match="no complete checkpoint under .* refusing to start over it"):
        run_steps(root, tiny_model_path, 3, records)


# ---------------------------------------------------------------- 5: disk full during save
@contextmanager
def disk_with_room_for(num_bytes: int):
    """Every file DCP writes draws from one budget; past it, writes fail with ENOSPC as on a full disk."""
    original = ckpt._NamedFiles.create_stream
    room = [num_bytes]

    class Full:
        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            if len(data) > room[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            room[0] -= len(data)
            return self.stream.write(data)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    @contextmanager
    def limited(self, path, mode):
        with original(self, path, mode) as stream:
            yield Full(stream) if "w" in mode else stream

    ckpt._NamedFiles.create_stream = limited
    try:
        yield
    finally:
        ckpt._NamedFiles.create_stream = original


def test_disk_full_during_save_is_a_clear_error_and_the_previous_checkpoint_stays(run_dir, tiny_model_path):
    from rlframe.trainer.checkpointing import CheckpointSaveError

    root, records = run_dir
    shard = os.path.getsize(os.path.join(root, "global_step_2", "actor", "model", "__0_0.distcp"))
    with disk_with_room_for(shard + shard // 2), pytest.raises(CheckpointSaveError) as failed:
        run_steps(root, tiny_model_path, 3, records)
    message = str(failed.value)
    assert "cannot save checkpoint global_step_3" in message and "no space left on the device" in message
    assert "the previous checkpoint global_step_2 is intact and still the latest" in message
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2", "latest_checkpointed_iteration.txt"]
    found = run_steps(root, tiny_model_path, 3, records)  # room again: resume from step 2 and go on
    assert found["resumed"] == 2 and found["matches"]


# ---------------------------------------------------------------- 3: every other file rlframe loads
def test_dataproto_from_disk_round_trips_and_refuses_a_crafted_file(tmp_path):
    import numpy as np

    from rlframe.protocol import DataProto

    data = DataProto.from_dict(
        {"input_ids": torch.arange(6).view(3, 2)},
        {"uid": ["a", "b", "c"], "reward_model": [{"ground_truth": "1"}, {"ground_truth": 2}, {"x": [np.int64(3)]}]},
        {"temperature": np.float32(0.5)},
    )
    path = str(tmp_path / "batch.pt")
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert loaded.batch["input_ids"].equal(data.batch["input_ids"]) and loaded.meta_info == {"temperature": 0.5}
    assert list(loaded.non_tensor_batch["reward_model"]) == [{"ground_truth": "1"}, {"ground_truth": 2}, {"x": [3]}]
    marker = tmp_path / "pwned"
    with open(path, "wb") as f:
        pickle.dump(_RunsCode(str(marker)), f)
    with pytest.raises(pickle.UnpicklingError, match=f"{path} is not plain data; refusing to load it"):
        DataProto.load_from_disk(path)
    assert not marker.exists()
    data.meta_info["model"] = object()
    with pytest.raises(TypeError, match=r"meta_info\['model'\] is a object"):
        data.save_to_disk(path)


def test_crafted_pytorch_model_bin_in_a_model_folder_is_refused(tiny_model_path, tmp_path):
    # Hugging Face folders (actor, critic, reward model, merge output) load through from_pretrained, which
    # reads *.safetensors, or *.bin with weights_only=True: a crafted .bin never runs.
    from rlframe.workers.model_loading import ModelSpec, load_hf_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            os.remove(folder / name)
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": _RunsCode(str(marker))}, folder / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights.only"):
        load_hf_model(ModelSpec(path=str(folder), role="actor", dtype=torch.float32, use_remove_padding=False))
    assert not marker.exists()


# ---------------------------------------------------------------- symlinks: nothing outside the run folder is touched
def tree_digest(folder: str) -> dict[str, bytes]:
    """Every file under `folder` and its bytes: what must stay as it was."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


def link_out(root: str, name: str, elsewhere: str) -> str:
    """Move `root/name` to `elsewhere` (a checkpoint stored on another disk) and leave a symlink to it."""
    shutil.move(os.path.join(root, name), elsewhere)
    os.symlink(elsewhere, os.path.join(root, name))
    return elsewhere


@pytest.mark.parametrize("keep", ["critic", "actor"])
def test_pruning_never_deletes_through_a_symlinked_step_folder(run_dir, tiny_model_path, tmp_path, caplog, keep):
    from helpers.faults_harness import LocalRole, checkpointer, make_loader

    root, _ = run_dir
    target = link_out(root, "global_step_1", str(tmp_path / "elsewhere" / "global_step_1"))
    before = tree_digest(target)
    saver = checkpointer(root)
    if keep == "critic":
        saver.max_critic_ckpt_to_keep = 1
    else:
        saver.max_actor_ckpt_to_keep = 1
    actor, critic = LocalRole(tiny_model_path, 0), LocalRole(tiny_model_path, 1)
    with caplog.at_level(logging.WARNING, logger="rlframe"):
        saver.save(3, actor, critic, make_loader(), {"global_step": 3})
    assert tree_digest(target) == before  # the checkpoint stored elsewhere keeps every file
    if keep == "critic":  # the critic under the link is kept, and the warning says why
        assert f"{root}/global_step_1/critic" in caplog.text and "symlink" in caplog.text
        assert not os.path.exists(os.path.join(root, "global_step_2", "critic"))
    else:  # the step is pruned by removing the link alone
        assert sorted(os.listdir(root)) == ["global_step_3", "latest_checkpointed_iteration.txt"]


def test_a_planted_latest_pointer_tmp_symlink_is_not_followed(run_dir, tiny_model_path, tmp_path):
    root, records = run_dir
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, os.path.join(root, "latest_checkpointed_iteration.txt.tmp"))
    run_steps(root, tiny_model_path, 3, records)
    assert victim.read_text() == "precious"
    pointer = os.path.join(root, "latest_checkpointed_iteration.txt")
    assert not os.path.islink(pointer) and open(pointer).read() == "3"


def test_a_symlinked_next_step_folder_is_refused_naming_it_and_leaves_no_tmp(run_dir, tiny_model_path, tmp_path):
    from helpers.faults_harness import LocalRole, checkpointer, make_loader

    from rlframe.trainer.checkpointing import CheckpointSaveError

    root, _ = run_dir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    os.symlink(elsewhere, os.path.join(root, "global_step_3"))  # appears while step 2 trains on
    actor, critic = LocalRole(tiny_model_path, 0), LocalRole(tiny_model_path, 1)
    with pytest.raises(CheckpointSaveError) as refused:
        checkpointer(root).save(3, actor, critic, make_loader(), {"global_step": 3})
    message = str(refused.value)
    assert f"{root}/global_step_3 is a symlink (to {elsewhere})" in message and "remove the link" in message
    assert "the previous checkpoint global_step_2 is intact and still the latest" in message
    assert sorted(os.listdir(root)) == [
        "global_step_1",
        "global_step_2",
        "global_step_3",
        "latest_checkpointed_iteration.txt",
    ]
    assert os.listdir(elsewhere) == ["keep.txt"]


def test_a_planted_tmp_step_symlink_is_removed_not_followed(run_dir, tiny_model_path, tmp_path):
    root, records = run_dir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    os.symlink(elsewhere, os.path.join(root, "global_step_3.tmp"))
    found = run_steps(root, tiny_model_path, 3, records)
    assert found["resumed"] == 2 and found["matches"]
    assert os.listdir(elsewhere) == ["keep.txt"]
    assert sorted(os.listdir(root))[-2:] == ["global_step_3", "latest_checkpointed_iteration.txt"]
    assert not os.path.islink(os.path.join(root, "global_step_3"))


def test_resume_refuses_a_symlinked_step_folder_naming_it(run_dir, tiny_model_path, tmp_path):
    from helpers.faults_harness import LocalRole, checkpointer, make_loader

    root, records = run_dir
    target = link_out(root, "global_step_2", str(tmp_path / "elsewhere" / "global_step_2"))
    link = os.path.join(root, "global_step_2")
    with pytest.raises(ValueError, match=f"{link} is a symlink \\(to {target}\\)"):
        run_steps(root, tiny_model_path, 3, records)
    saver = checkpointer(root)
    saver.resume_mode, saver.resume_from_path = "resume_path", link
    with pytest.raises(ValueError, match=f"trainer.resume_from_path={link!r} is a symlink \\(to {target}\\)"):
        saver.maybe_resume(LocalRole(tiny_model_path, 0), None, make_loader())
    saver.resume_from_path = target  # the checkpoint's own path is accepted
    assert saver.maybe_resume(LocalRole(tiny_model_path, 0), None, make_loader())["global_step"] == 2


def test_a_symlink_inside_a_step_folder_fails_its_check(run_dir, tiny_model_path, tmp_path, caplog):
    root, records = run_dir
    link_out(os.path.join(root, "global_step_2"), "actor", str(tmp_path / "elsewhere" / "actor"))
    with caplog.at_level(logging.WARNING, logger="rlframe"):
        found = run_steps(root, tiny_model_path, 2, records)
    assert found["resumed"] == 1 and found["matches"]
    assert f"{root}/global_step_2/actor is a symlink" in caplog.text


def test_merge_refuses_an_output_folder_that_is_a_symlink(run_dir, tiny_model_path, tmp_path):
    from rlframe.cli import main

    root, _ = run_dir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    os.symlink(elsewhere, tmp_path / "hf")
    step = os.path.join(root, "global_step_2")
    assert main(["merge", step, str(tmp_path / "hf"), "--model", tiny_model_path]) == 2
    assert os.listdir(elsewhere) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "elsewhere", "hf"]  # no temporary folder left


# ---------------------------------------------------------------- non-finite weights are named when loaded
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values_in_a_model_file_are_refused_naming_file_and_tensor(tiny_model_path, tmp_path, value):
    from safetensors.torch import load_file, save_file

    from rlframe.workers.model_loading import ModelSpec, load_hf_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    spec = ModelSpec(path=str(folder), role="actor", dtype=torch.float32, use_remove_padding=False)
    with pytest.raises(ValueError) as refused:
        load_hf_model(spec)
    message = str(refused.value)
    assert f"{folder}/model.safetensors" in message and "'model.layers.0.mlp.up_proj.weight'" in message
    assert "1 NaN/inf value(s)" in message


def test_non_finite_weights_in_a_checkpoint_are_refused_on_resume_naming_the_tensor(run_dir, tiny_model_path):
    from helpers.faults_harness import LocalRole

    root, records = run_dir
    step_dir = os.path.join(root, "global_step_2")
    diverged = LocalRole(tiny_model_path, 1)
    with torch.no_grad():
        diverged.model.model.norm.weight[0] = float("nan")  # a run that diverged, then saved
    diverged.save_checkpoint(os.path.join(step_dir, "critic"))
    write_manifest(step_dir)
    with pytest.raises(ValueError) as refused:
        run_steps(root, tiny_model_path, 3, records)
    message = str(refused.value)
    assert f"{step_dir}/critic/model" in message and "'model.norm.weight'" in message
    assert "1 NaN/inf value(s)" in message and "trainer.resume_from_path" in message
