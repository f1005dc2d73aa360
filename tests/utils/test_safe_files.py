"""rlframe.utils.safe_files: temporary files and folders renamed into place, removals kept inside their root."""

from __future__ import annotations

import os

import pytest

from rlframe.utils.safe_files import UnsafePathError, remove_under, replace_folder, write_file_atomically


def test_write_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "run" / "pointer.txt"
    target.parent.mkdir()
    os.symlink(victim, target)
    write_file_atomically(str(target), lambda f: f.write(b"3"))
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_text() == "3"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "data.pt"
    target.write_text("old")

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_file_atomically(str(target), fail)
    assert os.listdir(tmp_path) == ["data.pt"] and target.read_text() == "old"


def test_a_written_file_has_the_umask_mode_not_a_private_one(tmp_path):
    old = os.umask(0o022)
    try:
        write_file_atomically(str(tmp_path / "f"), lambda f: f.write(b"x"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o644


def test_removal_through_a_symlinked_folder_out_of_the_root_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "critic").mkdir(parents=True)
    (elsewhere / "critic" / "shard").write_text("keep")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / "global_step_1")
    with pytest.raises(
        UnsafePathError, match=f"refusing to remove {root}/global_step_1/critic: it lies at {elsewhere}"
    ):
        remove_under(str(root / "global_step_1" / "critic"), str(root))
    assert (elsewhere / "critic" / "shard").read_text() == "keep"
    with pytest.raises(UnsafePathError, match="outside"):
        remove_under(str(root / ".." / "elsewhere"), str(root))
    with pytest.raises(UnsafePathError, match="outside"):
        remove_under(str(root), str(root))


def test_removal_unlinks_a_symlink_and_keeps_what_it_points_to(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "shard").write_text("keep")
    root = tmp_path / "root"
    (root / "global_step_2" / "actor").mkdir(parents=True)
    os.symlink(elsewhere, root / "global_step_1")
    os.symlink(elsewhere, root / "global_step_2" / "actor" / "link")  # inside a tree: unlinked, not followed
    remove_under(str(root / "global_step_1"), str(root))
    remove_under(str(root / "global_step_2"), str(root))
    remove_under(str(root / "global_step_3"), str(root))  # nothing there: nothing to do
    assert os.listdir(root) == [] and (elsewhere / "shard").read_text() == "keep"


def test_replace_folder_replaces_an_old_folder_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old").write_text("old")
    replace_folder(str(out), lambda tmp: open(os.path.join(tmp, "new"), "w").close())
    assert os.listdir(out) == ["new"]

    def fail(tmp):
        open(os.path.join(tmp, "half"), "w").close()
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        replace_folder(str(out), fail)
    assert os.listdir(tmp_path) == ["hf"] and os.listdir(out) == ["new"]


def test_replace_folder_refuses_a_symlinked_target_naming_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "hf")
    with pytest.raises(UnsafePathError, match=f"{tmp_path}/hf is a symlink \\(to {elsewhere}\\).*remove the link"):
        replace_folder(str(tmp_path / "hf"), lambda tmp: None)
    assert os.listdir(elsewhere) == [] and sorted(os.listdir(tmp_path)) == ["elsewhere", "hf"]
