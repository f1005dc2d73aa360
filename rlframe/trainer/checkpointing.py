"""Trainer checkpoints: `global_step_N/` with actor, critic, dataloader and driver state.

Nothing is lost (docs/architecture.md, invariant 4): a step is written into `global_step_N.tmp`, renamed to
`global_step_N` when complete, and only then is `latest_checkpointed_iteration.txt` rewritten
(itself through a temporary file). A crash at any point leaves the previous checkpoint as latest.

`data.pt` holds the dataloader's `state_dict()` and the driver state as tensors and plain
containers only; it is read with `torch.load(weights_only=True)`, so a crafted file cannot run code.
"""

from __future__ import annotations

import numbers
import os
import pickle
import re
import shutil

import numpy as np
import torch

LATEST = "latest_checkpointed_iteration.txt"
DATA_FILE = "data.pt"
RESUME_MODES = ("auto", "disable", "resume_path")
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class TrainerCheckpointer:
    def __init__(self, trainer_cfg):
        self.root = str(trainer_cfg.default_local_dir)
        self.resume_mode = str(trainer_cfg.resume_mode)
        self.resume_from_path = trainer_cfg.resume_from_path
        self.max_actor_ckpt_to_keep = trainer_cfg.max_actor_ckpt_to_keep
        self.max_critic_ckpt_to_keep = trainer_cfg.max_critic_ckpt_to_keep
        if self.resume_mode not in RESUME_MODES:
            raise ValueError(f"trainer.resume_mode={self.resume_mode!r} is not one of {', '.join(RESUME_MODES)}")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<dir>/global_step_N")

    # ------------------------------------------------------------------ save
    def save(self, step: int, actor_wg, critic_wg, dataloader, driver_state: dict) -> str:
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        actor_wg.save_checkpoint(os.path.join(tmp, "actor"))
        if critic_wg is not None:
            critic_wg.save_checkpoint(os.path.join(tmp, "critic"))
        data = {"dataloader": dataloader.state_dict(), "driver": driver_state}
        torch.save(plain_data(data, "data.pt"), os.path.join(tmp, DATA_FILE))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._write_latest(step)
        self._prune()
        return final

    def _write_latest(self, step: int) -> None:
        path = os.path.join(self.root, LATEST)
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)

    def _prune(self) -> None:
        """Keep the newest max_*_ckpt_to_keep steps (the actor's limit decides whole step folders)."""
        keep = self.max_actor_ckpt_to_keep
        steps = self.saved_steps()
        if keep is not None and keep > 0:
            for step in steps[:-keep]:
                shutil.rmtree(os.path.join(self.root, f"global_step_{step}"), ignore_errors=True)
            steps = steps[-keep:]
        keep_critic = self.max_critic_ckpt_to_keep
        if keep_critic is not None and keep_critic > 0:
            for step in steps[:-keep_critic]:
                shutil.rmtree(os.path.join(self.root, f"global_step_{step}", "critic"), ignore_errors=True)

    def saved_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        return sorted(int(m.group(1)) for name in os.listdir(self.root) if (m := _STEP_DIR.match(name)))

    # ------------------------------------------------------------------ resume
    def latest_path(self) -> str | None:
        path = os.path.join(self.root, LATEST)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            step = int(f.read().strip())
        folder = os.path.join(self.root, f"global_step_{step}")
        return folder if os.path.isdir(folder) else None

    def maybe_resume(self, actor_wg, critic_wg, dataloader) -> dict | None:
        """Load the checkpoint the resume mode asks for; returns the driver state, or None for a fresh start."""
        if self.resume_mode == "disable":
            return None
        folder = self.latest_path() if self.resume_mode == "auto" else str(self.resume_from_path)
        if folder is None:
            return None
        if not os.path.isfile(os.path.join(folder, DATA_FILE)):
            raise ValueError(
                f"trainer.resume_from_path={folder!r} is not a complete checkpoint "
                f"(expected {os.path.join(folder, DATA_FILE)})"
            )
        state = load_data(os.path.join(folder, DATA_FILE))  # before the workers: a refused file stops here
        print(f"[rlframe] resuming from {folder}", flush=True)
        actor_wg.load_checkpoint(os.path.join(folder, "actor"))
        if critic_wg is not None:
            critic_wg.load_checkpoint(os.path.join(folder, "critic"))
        dataloader.load_state_dict(state["dataloader"])
        return state["driver"]


def plain_data(value, where: str):
    """`value` as tensors and plain containers (numpy scalars and arrays converted); anything else is refused.

    Checked at save time, so that a state a weights_only load would refuse fails the save that wrote
    it, naming the entry, rather than the resume.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {key: plain_data(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_data(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(
        f"checkpoint entry {where} is a {type(value).__name__}; a checkpoint holds only tensors, "
        "numbers, strings and lists/tuples/dicts of them (so that loading it cannot run code)"
    )


def load_data(path: str) -> dict:
    """Read `data.pt` with weights_only=True; a file that is not plain data is refused, naming it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{path} is not plain data (tensors and containers); refusing to load it: {e}"
        ) from e
