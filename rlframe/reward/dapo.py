"""DAPO's reward manager (`reward_model.reward_manager=dapo`) and its overlong reward shaping.

As verl 0.9.1's `dapo` manager: each response gets its scorer's score plus a soft overlong penalty
(DAPO paper, Yu et al. 2025, eq. 13). With L_max = `reward_kwargs.max_resp_len`, a buffer of
L_cache = `overlong_buffer_cfg.len` tokens and factor f = `overlong_buffer_cfg.penalty_factor`,
a response of |y| valid tokens gets

    penalty(|y|) = min(0, −(|y| − (L_max − L_cache)) / L_cache · f)

(0 up to L_max − L_cache tokens, falling linearly to −f at L_max). Per-sample extra info, as verl's:
"acc" is the score (a dict score's own "acc" when it gives one; verl raises then), "overlong_reward"
and "overlong" (penalty < 0) when `overlong_buffer_cfg.log`. The keys are reached as
`reward_model.reward_kwargs.*` (and `+reward_model.reward_kwargs.*`, as verl's scripts write them,
or `reward.reward_kwargs.*`, verl 0.9.1's newer spelling); their defaults are DAPO recipe's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlframe.config.schema import Section, key, section
from rlframe.protocol import DataProto
from rlframe.reward.manager import REWARD_MANAGERS, NaiveRewardManager, response_lengths


@dataclass
class OverlongBufferConfig(Section):
    enable: bool = key(False, "dapo manager: soft penalty for responses longer than max_resp_len - len")
    len: int = key(0, "dapo manager: tokens of the buffer over which the penalty grows to -penalty_factor")
    penalty_factor: float = key(0.0, "dapo manager: the penalty at max_resp_len tokens (negated)")
    log: bool = key(False, "dapo manager: report overlong_reward and overlong (fraction) per step")


@dataclass
class RewardKwargsConfig(Section):
    overlong_buffer_cfg: OverlongBufferConfig = section(OverlongBufferConfig)
    max_resp_len: int | None = key(None, "dapo manager: L_max of the overlong penalty (usually max_response_length)")

    def check(self, path: str, root: Any) -> None:
        buffer = self.overlong_buffer_cfg
        if not buffer.enable:
            return
        where = f"{path}.overlong_buffer_cfg"
        if self.max_resp_len is None:
            raise ValueError(f"{where}.enable=true needs {path}.max_resp_len (the response length the penalty ends at)")
        if buffer.len <= 0:
            raise ValueError(f"{where}.len={buffer.len} must be > 0 when {where}.enable=true")
        if self.max_resp_len < buffer.len:
            raise ValueError(f"{path}.max_resp_len={self.max_resp_len} must be >= {where}.len={buffer.len}")
        if root.reward_model.reward_manager != "dapo":
            raise ValueError(
                f"{where}.enable=true is read by the dapo reward manager only; "
                f"reward_model.reward_manager={root.reward_model.reward_manager!r}: set it to dapo"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        manager = root.reward_model.reward_manager
        if manager != "dapo":
            return {path: f"reward_model.reward_manager={manager}: only the dapo manager reads reward_kwargs"}
        if self.overlong_buffer_cfg.enable:
            return {}
        names = (
            "max_resp_len",
            "overlong_buffer_cfg.len",
            "overlong_buffer_cfg.penalty_factor",
            "overlong_buffer_cfg.log",
        )
        return {f"{path}.{name}": f"{path}.overlong_buffer_cfg.enable=false" for name in names}


def overlong_penalty(lengths: torch.Tensor, max_resp_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong penalty per response: 0 up to max_resp_len − buffer_len tokens, then linear to −factor."""
    exceed = lengths.double() - (max_resp_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


class DAPORewardManager(NaiveRewardManager):
    """One scorer call per sample; the score plus the overlong penalty is the reward (verl's `dapo`)."""

    def __init__(
        self,
        tokenizer,
        compute_score=None,
        reward_fn_key: str = "data_source",
        num_examine: int = 0,
        on_scorer_error: str = "zero",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: dict | None = None,
    ):
        super().__init__(tokenizer, compute_score, reward_fn_key, num_examine, on_scorer_error)
        self.max_resp_len = max_resp_len
        self.overlong = dict(overlong_buffer_cfg or {})

    @classmethod
    def config_kwargs(cls, config) -> dict:
        """The manager's arguments from the trainer config: `reward_model.reward_kwargs`."""
        kwargs = config.reward_model.reward_kwargs
        return {"max_resp_len": kwargs.max_resp_len, "overlong_buffer_cfg": dict(kwargs.overlong_buffer_cfg)}

    def __call__(self, data: DataProto, return_dict: bool = False):
        """The base manager's scores, "acc", and the overlong penalty added at each response's last token."""
        result = super().__call__(data, return_dict=True)
        reward_tensor, extra = result["reward_tensor"], result["reward_extra_info"]
        scores = extra["score"]
        own_acc = extra.get("acc", [math.nan] * len(scores))  # NaN where a dict score has no "acc"
        extra["acc"] = [score if math.isnan(acc) else acc for score, acc in zip(scores, own_acc)]
        if self.overlong.get("enable"):
            lengths = response_lengths(data)
            penalty = overlong_penalty(
                lengths, self.max_resp_len, int(self.overlong["len"]), float(self.overlong["penalty_factor"])
            )
            last = (lengths - 1).clamp(min=0)
            rows = torch.arange(len(lengths))
            reward_tensor[rows, last] = (reward_tensor[rows, last].double() + penalty).float()
            if self.overlong.get("log"):
                extra["overlong_reward"] = penalty.tolist()
                extra["overlong"] = (penalty < 0).tolist()
        if not return_dict:
            return reward_tensor
        return result


REWARD_MANAGERS["dapo"] = DAPORewardManager
