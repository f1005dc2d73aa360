"""A trainer's checkpoint cycle in one process: the real save/resume code, without Ray or workers.

`LocalRole` stands in for a worker group: it holds the plain (unsharded) tiny model, AdamW, an lr
scheduler and a shuffle generator, and saves/loads them through `rlframe.workers.checkpoint` exactly
as a worker does. `run_steps` is a miniature training run: resume (trainer.resume_mode=auto), then
one deterministic optimizer step per dataloader batch, a checkpoint after every step, until
`last_step`. Before each save it records what the step's checkpoint must hold (a digest of the
parameters and the next batch), so a resumed run can show that it continues exactly from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from types import SimpleNamespace

import torch

from rlframe.data.dataloader import make_dataloader
from rlframe.trainer.checkpointing import TrainerCheckpointer
from rlframe.utils.faults import KillPoints
from rlframe.workers import checkpoint as ckpt
from rlframe.workers.model_loading import ModelSpec, load_hf_model

NUM_SAMPLES, BATCH_SIZE = 12, 2


class LocalRole:
    """One role (actor or critic) in this process, with a worker group's save/load methods."""

    def __init__(self, model_path: str, seed: int, kill_points: KillPoints | None = None):
        self.kill_points = kill_points or KillPoints()  # the process's, as a worker's roles share their process's
        torch.manual_seed(seed)
        self.model = load_hf_model(
            ModelSpec(path=model_path, role="actor", dtype=torch.float32, use_remove_padding=False)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))
        self.generator = torch.Generator().manual_seed(seed)

    def save_checkpoint(self, path: str) -> None:
        ckpt.save_checkpoint(
            path,
            self.model,
            self.optimizer,
            self.scheduler,
            ("model", "optimizer", "extra"),
            generator=self.generator,
            kill_points=self.kill_points,
        )

    def load_checkpoint(self, path: str) -> None:
        ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler, generator=self.generator)

    def train_step(self, batch: dict) -> None:
        """One AdamW step on token ids derived from the batch's sample numbers (deterministic)."""
        vocab = self.model.config.vocab_size
        ids = torch.stack([torch.arange(8) * 7 + int(x) for x in batch["x"]]) % (vocab - 3) + 3
        self.model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def digest(self) -> str:
        """SHA-256 over the parameters and the optimizer's moments."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().contiguous().numpy().tobytes())
        for state in self.optimizer.state.values():
            for key in sorted(state):
                h.update(state[key].detach().contiguous().numpy().tobytes())
        return h.hexdigest()


def make_loader():
    """The real resumable dataloader over a 12-sample dataset, shuffled, 2 per batch."""
    dataset = [{"x": torch.tensor(i)} for i in range(NUM_SAMPLES)]
    return make_dataloader(dataset, BATCH_SIZE, shuffle=True, seed=3)


def checkpointer(root: str, keep: int | None = None) -> TrainerCheckpointer:
    return TrainerCheckpointer(
        SimpleNamespace(
            default_local_dir=root,
            resume_mode="auto",
            resume_from_path=None,
            max_actor_ckpt_to_keep=keep,
            max_critic_ckpt_to_keep=keep,
        )
    )


def run_steps(
    root: str, model_path: str, last_step: int, record_dir: str, keep: int | None = None, on_resume=None
) -> dict:
    """Resume from `root` (if anything is there) and train to `last_step`, saving after every step.

    Returns {"resumed": the step resumed from (0: fresh), "matches": whether the loaded parameters and
    moments are the ones recorded for that step, "final": the digests at `last_step`}. Records
    `record_dir/step_N.json` before saving step N; `on_resume(found)` is called right after resuming.
    """
    kill_points = KillPoints()
    actor, critic = LocalRole(model_path, 0, kill_points), LocalRole(model_path, 1, kill_points)
    loader = make_loader()
    saver = checkpointer(root, keep)
    driver = saver.maybe_resume(actor, critic, loader)
    step = 0 if driver is None else driver["global_step"]
    found = {"resumed": step, "matches": True}
    if step:
        with open(os.path.join(record_dir, f"step_{step}.json")) as f:
            found["matches"] = [actor.digest(), critic.digest()] == json.load(f)
    if on_resume is not None:
        on_resume(found)
    while step < last_step:
        for batch in loader:  # resumes mid-epoch; a new permutation each epoch
            step += 1
            actor.train_step(batch)
            critic.train_step(batch)
            with open(os.path.join(record_dir, f"step_{step}.json"), "w") as f:
                json.dump([actor.digest(), critic.digest()], f)
            saver.save(step, actor, critic, loader, {"global_step": step, "kl_coef": 0.0})
            if step == last_step:
                break
    found["final"] = [actor.digest(), critic.digest()]
    return found
