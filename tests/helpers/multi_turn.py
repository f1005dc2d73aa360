"""Multi-turn rollouts: a scripted engine, tool calls, prompts and the rollout config."""

from __future__ import annotations

import numpy as np
import torch

from helpers.rollout import typed_rollout
from rlframe.config.loader import load_config
from rlframe.protocol import DataProto
from rlframe.workers.rollout.base import BaseRollout, ServedModel
from rlframe.workers.rollout.config import RolloutConfig

PROMPT_LEN, RESPONSE_LEN = 48, 160


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


# ------------------------------------------------------------------------------------------ the rollout
class ScriptedEngine(BaseRollout):
    """Replies by conversation: `script[user text][turn]`; records every batch it was asked to generate."""

    def __init__(self, config: RolloutConfig, tokenizer, model_path, script: dict[str, list[str]]):
        super().__init__(config, ServedModel(model_path), tokenizer, "cpu")
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def _generate(self, prompts, params, eos_ids, pad_id, seeds):
        rows, log_probs = [], []
        for ids, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"]):
            context = self.tokenizer.decode(ids[mask.bool()].tolist())
            user = next(text for text in self.script if text in context)
            turn = context.count("<|im_start|>assistant") - 1
            reply = self.tokenizer.encode(self.script[user][turn], add_special_tokens=False) + [eos_ids[0]]
            rows.append(reply[: params.response_length])
        self.calls.append(len(rows))
        width = max(len(r) for r in rows)
        tokens = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        lengths = torch.tensor([len(r) for r in rows])
        log_probs = -torch.arange(1, width + 1, dtype=torch.float32).repeat(len(rows), 1) / 10
        return tokens, lengths, log_probs

    def update_weights(self, named_tensors):
        pass


def rollout_cfg(*overrides: str) -> RolloutConfig:
    cfg = load_config([f"data.max_prompt_length={PROMPT_LEN}", f"data.max_response_length={RESPONSE_LEN}", *overrides])
    return typed_rollout(cfg)


def make_prompts(tokenizer, users: list[str], **non_tensor) -> DataProto:
    ids = torch.ones(len(users), 4, dtype=torch.long)
    mask = torch.ones_like(ids)
    raw = np.empty(len(users), dtype=object)
    raw[:] = [[{"role": "user", "content": u}] for u in users]
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1},
        {"raw_prompt": raw, "uid": np.array(users, dtype=object), **non_tensor},
    )
