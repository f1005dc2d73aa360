"""Rollout builders: the tokenizer, a rollout config, prompts, a free port."""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig, OmegaConf

from rlframe.config.loader import load_config, resolved
from rlframe.config.schema import sections_of
from rlframe.protocol import DataProto
from rlframe.workers.rollout.config import RolloutConfig

PROMPT_LEN, RESPONSE_LEN = 8, 6

PROMPT_LENGTHS = (8, 3, 5, 1, 7)


def typed_rollout(cfg: DictConfig) -> RolloutConfig:
    """The rollout section of a whole loaded config, resolved and typed as a worker hands it to the engine."""
    section = OmegaConf.merge(OmegaConf.structured(RolloutConfig), resolved(cfg).actor_rollout_ref.rollout)
    OmegaConf.set_readonly(section, True)
    return section


def rollout_config(*overrides: str) -> RolloutConfig:
    cfg = load_config(
        [
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            "actor_rollout_ref.rollout.micro_batch_size=2",
            *overrides,
        ]
    )
    return typed_rollout(cfg)


def make_prompts(lengths=PROMPT_LENGTHS, width: int = PROMPT_LEN, seed: int = 0, **meta) -> DataProto:
    """Left-padded prompts (pad id 0) of the given real lengths, with a uid per row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        mask[i, width - length :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids * mask, "attention_mask": mask, "position_ids": position_ids},
        {"uid": [f"p{i}" for i in range(len(lengths))]},
        meta,
    )


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def one_process_rollout_worker(model_path: str, rendezvous: str, *overrides: str):
    """A RolloutWorker in this process, joined to a one-process group through a rendezvous file, as its worker
    group sets it up (the group is destroyed and the environment restored on exit)."""
    import os

    import torch.distributed as dist

    from rlframe.single_controller.worker import RENDEZVOUS_FILE_ENV
    from rlframe.trainer.main_ppo import check_config
    from rlframe.workers.rollout_worker import RolloutWorker

    from .small_config import SMALL

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", RENDEZVOUS_FILE_ENV: rendezvous}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    _, cfg, _, plan = check_config(
        [
            *SMALL,
            f"actor_rollout_ref.model.path={model_path}",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            "trainer.device=cpu",
            *overrides,
        ],
        check_files=False,
    )
    worker = RolloutWorker(sections_of(OmegaConf.to_object(cfg), RolloutWorker.SECTIONS), plan)
    worker.init_model(torch.get_rng_state())
    try:
        yield worker
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


class CutAfter:
    """An `interrupt` that says True from its (calls + 1)-th question on (asked at a micro-batch's start, then after
    each decoding step)."""

    def __init__(self, calls: int):
        self.calls, self.asked = calls, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked > self.calls


def teacher_forced_log_probs(engine, rows: DataProto) -> torch.Tensor:
    """log p(response token) under the engine's current weights (0 off the response mask), from one forward over
    prompt + response at the engine's sampling temperature."""
    temperature = engine.sampling_for({}).temperature
    width = rows.batch["prompts"].shape[1]
    with torch.no_grad():
        logits = engine.model(
            input_ids=rows.batch["input_ids"],
            attention_mask=rows.batch["attention_mask"],
            position_ids=rows.batch["position_ids"],
        ).logits[:, width - 1 : -1]
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, rows.batch["responses"][..., None]).squeeze(-1) * rows.batch["response_mask"]
