"""Trainer checkpoints: `global_step_N/` with actor, critic, dataloader and driver state.

Nothing is lost (docs/architecture.md, invariant 4): a step is written into `global_step_N.tmp`, renamed to
`global_step_N` when complete, and only then is `latest_checkpointed_iteration.txt` rewritten
(itself through a temporary file). A crash at any point leaves the previous checkpoint as latest.
"""

from __future__ import annotations

import os
import re
import shutil

import torch

LATEST = "latest_checkpointed_iteration.txt"
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
        torch.save({"dataloader": dataloader.state_dict(), "driver": driver_state}, os.path.join(tmp, "data.pt"))
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
        if not os.path.isfile(os.path.join(folder, "data.pt")):
            raise ValueError(f"trainer.resume_from_path={folder!r} is not a complete checkpoint "
                             f"(expected {os.path.join(folder, 'data.pt')})")
        print(f"[rlframe] resuming from {folder}", flush=True)
        actor_wg.load_checkpoint(os.path.join(folder, "actor"))
        if critic_wg is not None:
            critic_wg.load_checkpoint(os.path.join(folder, "critic"))
        state = torch.load(os.path.join(folder, "data.pt"), weights_only=False)
        dataloader.load_state_dict(state["dataloader"])
        return state["driver"]
