"""Trainer checkpoints: `global_step_N/` with actor, critic, dataloader and driver state, and a manifest.

Nothing is lost (docs/architecture.md, invariant 4; docs/reliability.md). A step is written into
`global_step_N.tmp`; `manifest.json` (every file's size and SHA-256) is written last; the folder is
renamed to `global_step_N`; only then is `latest_checkpointed_iteration.txt` rewritten (through a
temporary file). Resuming takes the newest `global_step_N` whose files match its manifest; a
folder that does not (truncated or corrupted shard, interrupted save, lost file) is skipped with a
warning naming the file, and the previous complete checkpoint is used.

Nothing outside `trainer.default_local_dir` is written, read or deleted through a symlink
(`rlframe.utils.safe_files`): a step folder that is a symlink is refused on save and on resume, naming
it; pruning and the removal of a failed save's `.tmp` unlink a symlink rather than follow it, and refuse
a path that resolves outside the folder.

`data.pt` holds the dataloader's `state_dict()` and the driver state as tensors and plain
containers only; it is read with `torch.load(weights_only=True)`, so a crafted file cannot run code.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import re

import torch

from rlframe.protocol import plain_data
from rlframe.utils.faults import KillPoints
from rlframe.utils.manifest import CorruptCheckpointError, verify_manifest, write_manifest
from rlframe.utils.safe_files import UnsafePathError, refuse_symlink, remove_under, write_file_atomically

logger = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"
DATA_FILE = "data.pt"
# why data.pt refuses a value (plain_data's `refusal`): checked at save time, not at resume
CHECKPOINT_REFUSAL = (
    "a checkpoint holds only tensors, numbers, strings, bytes and lists/tuples/dicts of them "
    "(so that loading it cannot run code)"
)
RESUME_MODES = ("auto", "disable", "resume_path")
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointSaveError(RuntimeError):
    """Saving a step failed (e.g. the disk is full); the previous checkpoint is untouched and still the latest."""


class TrainerCheckpointer:
    def __init__(self, trainer_cfg, kill_points: KillPoints | None = None):
        self.root = str(trainer_cfg.default_local_dir)
        self.resume_mode = str(trainer_cfg.resume_mode)
        self.resume_from_path = trainer_cfg.resume_from_path
        self.max_actor_ckpt_to_keep = trainer_cfg.max_actor_ckpt_to_keep
        self.max_critic_ckpt_to_keep = trainer_cfg.max_critic_ckpt_to_keep
        if self.resume_mode not in RESUME_MODES:
            raise ValueError(f"trainer.resume_mode={self.resume_mode!r} is not one of {', '.join(RESUME_MODES)}")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<dir>/global_step_N")
        self.last_complete: str | None = None  # the newest checkpoint this run saved or resumed from
        self.kill_points = kill_points if kill_points is not None else KillPoints()  # the run's: PreparedRun

    def restart_from(self, folder: str) -> None:
        """After a restart (trainer.max_restarts): resume from `folder`, this run's latest complete checkpoint."""
        self.resume_mode, self.resume_from_path = "resume_path", folder

    # ------------------------------------------------------------------ save
    def save(self, step: int, actor_wg, critic_wg, dataloader, driver_state: dict, before_complete=None) -> str:
        """Write step `step` completely or not at all; a failure leaves the previous checkpoint as latest.

        `before_complete()` runs once the step's files are written, before the folder is renamed into place: the
        trainer logs the step's metrics there, so a checkpoint that counts as complete has its metrics line."""
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = final + ".tmp"
        state = {"dataloader": dataloader.state_dict(), "driver": driver_state}
        data = plain_data(state, f"checkpoint entry {DATA_FILE}", CHECKPOINT_REFUSAL)
        try:
            fix = "remove the link (what it points to stays) or give trainer.default_local_dir a folder of its own"
            refuse_symlink(final, fix)
            self._write_step(tmp, actor_wg, critic_wg, data)
            if before_complete is not None:
                before_complete()
            remove_under(final, self.root)  # a step saved again (after a resume from an earlier one)
            os.replace(tmp, final)
        except Exception as error:
            with contextlib.suppress(OSError, UnsafePathError):
                remove_under(tmp, self.root)  # frees the space a full disk needs back
            raise CheckpointSaveError(self._save_failure(step, tmp, error)) from error
        self.kill_points.hit("save.renamed")
        self._write_latest(step)
        self.kill_points.hit("save.latest")
        self.last_complete = final
        self._prune()
        return final

    def _write_step(self, tmp: str, actor_wg, critic_wg, data: dict) -> None:
        remove_under(tmp, self.root)  # a killed save's folder, or a link planted in its place (unlinked)
        os.makedirs(self.root, exist_ok=True)
        os.mkdir(tmp)  # never follows a link: one planted since the line above makes it fail
        self.kill_points.hit("save.begin")
        actor_wg.save_checkpoint(os.path.join(tmp, "actor"))
        self.kill_points.hit("save.actor")
        if critic_wg is not None:
            critic_wg.save_checkpoint(os.path.join(tmp, "critic"))
            self.kill_points.hit("save.critic")
        torch.save(data, os.path.join(tmp, DATA_FILE))
        self.kill_points.hit("save.data")
        write_manifest(tmp)  # last: a folder with a manifest was complete
        self.kill_points.hit("save.manifest")

    def _save_failure(self, step: int, tmp: str, error: BaseException) -> str:
        """The message of a failed save: the cause (disk full named as such) and which checkpoint is still latest."""
        latest = self._pointer_step()
        kept = (
            f"the previous checkpoint global_step_{latest} is intact and still the latest"
            if latest is not None
            else "no earlier checkpoint exists"
        )
        if _disk_full(error):
            cause = f"no space left on the device of {self.root} (trainer.default_local_dir)"
        else:
            cause = f"{type(error).__name__}: {error}"
        left = f"{tmp} is left behind: remove it by hand" if os.path.lexists(tmp) else f"no {tmp} is left"
        return f"cannot save checkpoint global_step_{step} ({left}): {cause}; {kept}"

    def _write_latest(self, step: int) -> None:
        write_file_atomically(os.path.join(self.root, LATEST), lambda f: f.write(str(step).encode()))

    def _prune(self) -> None:
        """Keep the newest max_*_ckpt_to_keep steps (the actor's limit decides whole step folders)."""
        keep = self.max_actor_ckpt_to_keep
        steps = self.saved_steps()
        if keep is not None and keep > 0:
            for step in steps[:-keep]:
                self._remove(os.path.join(self.root, f"global_step_{step}"))
            steps = steps[-keep:]
        keep_critic = self.max_critic_ckpt_to_keep
        if keep_critic is not None and keep_critic > 0:
            for step in steps[:-keep_critic]:
                self._remove(os.path.join(self.root, f"global_step_{step}", "critic"))

    def _remove(self, path: str) -> None:
        """Prune `path` inside the run folder; what cannot be removed safely is kept, with a warning."""
        try:
            remove_under(path, self.root)
        except (OSError, UnsafePathError) as error:  # the step is saved: a kept old folder is no reason to stop
            logger.warning("not pruning %s: %s", path, error)

    def saved_steps(self) -> list[int]:
        """Steps with a `global_step_N` folder, oldest first (complete or not)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(int(m.group(1)) for name in os.listdir(self.root) if (m := _STEP_DIR.match(name)))

    # ------------------------------------------------------------------ resume
    def _pointer_step(self) -> int | None:
        """The step `latest_checkpointed_iteration.txt` names (verl's pointer), or None."""
        try:
            with open(os.path.join(self.root, LATEST)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def latest_path(self) -> str | None:
        """The newest complete checkpoint (its files match its manifest); incomplete newer ones are logged."""
        skipped = []
        for step in reversed(self.saved_steps()):
            folder = os.path.join(self.root, f"global_step_{step}")
            refuse_symlink(
                folder,
                f"put the checkpoint itself in its place, or resume from it with trainer.resume_mode=resume_path "
                f"trainer.resume_from_path={os.path.realpath(folder)}",
            )
            try:
                verify_manifest(folder)
            except CorruptCheckpointError as error:
                logger.warning("skipping checkpoint %s: %s", folder, error)
                skipped.append(f"{folder}: {error}")
                continue
            if skipped:
                logger.warning("falling back to the previous complete checkpoint %s", folder)
            return folder
        if skipped:
            raise CorruptCheckpointError(
                f"no complete checkpoint under {self.root} (trainer.default_local_dir) to resume from; "
                "refusing to start over it (set trainer.resume_mode=disable to start a fresh run):\n  "
                + "\n  ".join(skipped)
            )
        return None

    def resume_folder(self) -> str | None:
        """The folder the resume mode asks for, verified against its manifest; None for a fresh start."""
        if self.resume_mode == "disable":
            return None
        if self.resume_mode == "auto":
            return self.latest_path()
        folder = str(self.resume_from_path)
        if not os.path.isdir(folder):
            raise ValueError(f"trainer.resume_from_path={folder!r} does not exist")
        refuse_symlink(
            folder,
            f"give the checkpoint's own path, {os.path.realpath(folder)}",
            f"trainer.resume_from_path={folder!r}",
        )
        verify_manifest(folder)  # an explicit choice: no fallback, the error names the file
        return folder

    def maybe_resume(self, actor_wg, critic_wg, dataloader, check_driver=None) -> dict | None:
        """Load the checkpoint the resume mode asks for; returns the driver state, or None for a fresh start.
        `check_driver(driver_state)` may refuse the driver state before the workers load anything."""
        folder = self.resume_folder()
        if folder is None:
            return None
        state = load_data(os.path.join(folder, DATA_FILE))  # before the workers: a refused file stops here
        if check_driver is not None:
            try:
                check_driver(state["driver"])
            except ValueError as error:
                raise ValueError(f"cannot resume from {folder}: {error}") from error
        print(f"[rlframe] resuming from {folder}", flush=True)
        self.last_complete = folder
        actor_wg.load_checkpoint(os.path.join(folder, "actor"))
        if critic_wg is not None:
            critic_wg.load_checkpoint(os.path.join(folder, "critic"))
        dataloader.load_state_dict(state["dataloader"])
        return state["driver"]


def _disk_full(error: BaseException) -> bool:
    """Whether `error` (or a cause, or a worker's traceback text) is ENOSPC."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen):  # a worker's error arrives as its traceback's text
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def load_data(path: str) -> dict:
    """Read `data.pt` with weights_only=True; a file that is not plain data is refused, naming it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{path} is not plain data (tensors and containers); refusing to load it: {e}"
        ) from e
