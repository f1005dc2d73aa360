"""Crash consistency: SIGKILL at every point of a checkpoint save, then resume, again and again.

A miniature training run (`tests/helpers/faults_harness.py`: the real `TrainerCheckpointer` and the real
worker checkpoint code, actor and critic, in one process) is killed by `RLFRAME_KILL_AT` at each
named point of the save — before and after each role, between every file the workers write (each
DCP shard and index, each rank file), after `data.pt`, after the manifest, after the rename, after
the pointer — 20 kills in a chain. After every kill the newest checkpoint must verify against its
manifest and the next run must resume from it, with exactly the parameters and optimizer moments
recorded for that step; a kill before the rename must leave the previous step as the latest. The
last run goes to the end without a kill and must end bitwise where an uninterrupted run ends.

The processes are forked from a server that has imported torch once, so a kill costs well under a
second. The same points in a real run (Ray workers killed while generating, updating and saving)
are in tests/e2e/test_faults_restart.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
from helpers.faults_harness import checkpointer, run_steps

from rlframe.utils.faults import ENV
from rlframe.utils.manifest import verify_manifest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

LAST_STEP = 8
# A child resumes, then saves a step after each training step; its first save is where most kills land.
# Per save the workers write 10 files: for actor then critic, model/__0_0.distcp, model/.metadata,
# optimizer/__0_0.distcp, optimizer/.metadata, extra_state/rank_0.pt.
# point -> how many steps the killed run saved completely before dying
KILL_POINTS = {
    "save.begin:1": 0,
    **{f"checkpoint.file:{n}": 0 for n in range(1, 11)},  # between every shard file of the first save
    "save.actor:1": 0,
    "save.critic:1": 0,
    "save.data:1": 0,
    "save.manifest:1": 0,  # complete and described, not yet renamed: still global_step_N.tmp
    "save.renamed:1": 1,  # the step's folder is complete, the pointer still names the previous step
    "save.latest:1": 1,
    "checkpoint.file:13": 1,  # the same process's second save, inside the actor's optimizer
    "save.manifest:2": 1,
    "save.latest:2": 2,
}


PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "helpers.faults_harness",
]


def _child(root, model_path, record_dir, kill_at, result_file):
    """One run in a fresh process: resume, record what was resumed, train until killed (or to the end)."""
    import torch

    torch.set_num_threads(1)
    os.environ[ENV] = kill_at

    def record(found):
        with open(result_file, "w") as f:
            json.dump(found, f)

    record(run_steps(root, model_path, LAST_STEP, record_dir, keep=3, on_resume=record))


def test_sigkill_at_every_save_point_leaves_a_complete_checkpoint_to_resume_from(tiny_model_path, tmp_path):
    reference = run_steps(str(tmp_path / "straight"), tiny_model_path, LAST_STEP, str(_mkdir(tmp_path / "rec0")))
    context = multiprocessing.get_context("forkserver")
    # everything a child imports, imported once in the server (transformers imports its models lazily)
    context.set_forkserver_preload(PRELOAD)
    root, records = str(tmp_path / "killed"), str(_mkdir(tmp_path / "rec1"))
    run_steps(root, tiny_model_path, 1, records)  # every kill then has an earlier checkpoint to lose
    complete = 1  # the newest step whose checkpoint must have survived
    for number, kill_at in enumerate([*KILL_POINTS, ""]):
        result_file = str(tmp_path / f"result_{number}.json")
        child = context.Process(target=_child, args=(root, tiny_model_path, records, kill_at, result_file))
        child.start()
        child.join()
        with open(result_file) as f:
            found = json.load(f)
        assert found["resumed"] == complete and found["matches"], f"run {number} after the kill before it: {found}"
        if kill_at:
            assert child.exitcode == -9, f"{kill_at} was not reached (exit code {child.exitcode})"
            complete += KILL_POINTS[kill_at]
            latest = checkpointer(root).latest_path()
            assert latest == os.path.join(root, f"global_step_{complete}"), kill_at
            verify_manifest(latest)
        else:
            assert child.exitcode == 0
    assert found["final"] == reference["final"]  # killed 20 times, ends where the straight run ends
    assert complete == 7 and len(KILL_POINTS) == 20


def _mkdir(path):
    path.mkdir()
    return path
