"""Shared memory that cannot crash a run (rlframe.distributed.shm_gather, rlframe.utils.shm).

In a small tmpfs of our own ($RLFRAME_SHM_DIR; mounting one needs root, as in CI): a folder that fills after
the group measured it makes the gather fall back to gloo with the same result instead of a SIGBUS; a rank
killed before it mapped the buffer leaves no file; files registered for removal go when the process exits.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.world import spawned_world

from rlframe.distributed.shm_gather import SharedMemoryGroups
from rlframe.utils.shm import SHM_DIR_ENV

TMPFS_MB = 64


@pytest.fixture
def small_shm(tmp_path):
    """A fresh 64 MB tmpfs, unmounted after the test."""
    path = tmp_path / "shm"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}M", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.fail(f"this test mounts a tmpfs at {path} and needs root for it: {mounted.stderr.strip()}")
    yield str(path)
    subprocess.run(["umount", "-l", str(path)], check=True)


def _gather(memory: SharedMemoryGroups, rank: int, world: int, floats: int) -> tuple[bool, torch.Tensor]:
    """Every rank's `floats` values through the shared buffer, else through gloo; and whether it was shared."""
    mine = torch.arange(floats, dtype=torch.float32) + 1000 * rank
    half = memory.shared_half(dist.group.WORLD, world * floats * 4)
    if half is None:
        every = torch.empty(world, floats)
        dist.all_gather_into_tensor(every, mine.unsqueeze(0))
        return False, every
    slots = half.view(torch.float32).view(world, floats)
    slots[rank] = mine
    dist.barrier()
    return True, slots.clone()


def _filling_worker(rank: int, shm: str) -> dict:
    os.environ[SHM_DIR_ENV] = shm
    world, memory, seen = dist.get_world_size(), SharedMemoryGroups(), {}
    seen["small"] = _gather(memory, rank, world, 1 << 16)  # a 2 x 1 MiB buffer, room measured: 64 MB
    if rank == 0:  # another process fills the folder after the group measured it
        with open(os.path.join(shm, "filler"), "wb") as filler:
            filler.write(b"\0" * ((TMPFS_MB - 3) << 20))
    dist.barrier()
    seen["grown"] = _gather(memory, rank, world, 1 << 20)  # 2 x 8 MiB: past what is left
    seen["after"] = _gather(memory, rank, world, 1 << 10)  # the group keeps to gloo
    return seen


@pytest.mark.slow  # a multi-process world: over 6 s on 2 cores (tests/README.md)
def test_a_folder_filled_after_setup_falls_back_to_gloo_with_the_same_result(small_shm):
    for seen in spawned_world(2).run(_filling_worker, small_shm):
        for name, floats in (("small", 1 << 16), ("grown", 1 << 20), ("after", 1 << 10)):
            shared, every = seen[name]
            assert shared == (name == "small"), name
            expected = torch.stack([torch.arange(floats, dtype=torch.float32) + 1000 * r for r in range(2)])
            assert torch.equal(every, expected), name
    assert os.listdir(small_shm) == ["filler"]


def _dying_before_mapping(rank: int, store_path: str, shm: str, results) -> None:
    """Rank `rank` of a fresh 2-process world; rank 1 dies where it would map the buffer."""
    import mmap

    os.environ[SHM_DIR_ENV] = shm
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    if rank == 1:
        mmap.mmap = lambda *args: os._exit(3)
    try:
        SharedMemoryGroups().shared_half(dist.group.WORLD, 1 << 20)
        results.put("no error")
    except RuntimeError as error:
        results.put(f"{type(error).__name__}: {error}")
    results.close()
    results.join_thread()  # the message is through before the process ends
    os._exit(0)  # not destroy_process_group: its peer is gone


@pytest.mark.slow  # two fresh processes: over 6 s on 2 cores
def test_a_rank_killed_before_mapping_the_buffer_leaves_no_file(small_shm, tmp_path):
    before = set(glob.glob("/dev/shm/rlframe-gather-*"))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_dying_before_mapping, args=(rank, str(tmp_path / "store"), small_shm, results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        assert results.get(timeout=120).startswith("RuntimeError: ")  # rank 0: its peer went (gloo says so)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert procs[1].exitcode == 3
    assert os.listdir(small_shm) == []
    assert set(glob.glob("/dev/shm/rlframe-gather-*")) <= before


def test_files_registered_for_removal_go_when_the_process_exits(small_shm):
    script = (
        "import os, sys\n"
        "from rlframe.utils.shm import remove_at_exit, remove_now, shm_dir\n"
        "folder = os.path.join(shm_dir(), 'adapter')\n"
        "os.makedirs(folder)\n"
        "open(os.path.join(folder, 'weights'), 'w').close()\n"
        "remove_at_exit(folder)\n"
        "early = os.path.join(shm_dir(), 'early')\n"
        "open(early, 'w').close()\n"
        "remove_at_exit(early)\n"
        "remove_now(early)\n"
        "assert not os.path.exists(early)\n"
        "print(sorted(os.listdir(shm_dir())))\n"
    )
    env = {**os.environ, SHM_DIR_ENV: small_shm, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['adapter']"  # there while the process ran
    assert os.listdir(small_shm) == []


def _copy_in_another_process(model_path: str, shm: str) -> str:
    script = f"from rlframe.models.builtin import copy_to_shm; print(copy_to_shm({model_path!r}, {shm!r}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout


def test_a_model_copy_is_removed_by_the_last_process_that_uses_it(small_shm, tiny_model_path):
    from rlframe.models.builtin import copy_to_shm
    from rlframe.utils.shm import remove_registered

    copy = copy_to_shm(tiny_model_path, small_shm)
    assert sorted(os.listdir(copy)) == sorted(os.listdir(tiny_model_path))
    assert _copy_in_another_process(tiny_model_path, small_shm).strip() == copy  # it exited: we still use it
    assert os.path.isdir(copy)
    remove_registered()  # what this process's exit (or its worker group's teardown) does
    assert not os.path.exists(copy)
    copy_to_shm.cache_clear()


def test_a_model_copy_that_does_not_fit_loads_from_the_folder_itself(small_shm, tiny_model_path):
    from rlframe.models.builtin import copy_to_shm

    with open(os.path.join(small_shm, "filler"), "wb") as filler:
        filler.write(b"\0" * ((TMPFS_MB << 20) - (64 << 10)))  # 64 KB left
    with pytest.warns(UserWarning, match="model.use_shm: cannot copy"):
        assert copy_to_shm(tiny_model_path, small_shm) == tiny_model_path
    assert sorted(os.listdir(small_shm)) == ["filler", "rlframe-models"]
    assert [name for name in os.listdir(os.path.join(small_shm, "rlframe-models")) if not name.endswith(".lock")] == []
    copy_to_shm.cache_clear()
