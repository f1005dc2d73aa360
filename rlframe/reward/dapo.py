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
or `reward.reward_kwargs.*`, verl 0.9.1's newer spelling); their defaults are DAPO recipe's, declared in
`RewardKwargsConfig` (`rlframe/reward/config.py`).
"""

from __future__ import annotations

import math

import torch

from rlframe.protocol import DataProto
from rlframe.reward.manager import REWARD_MANAGERS, NaiveRewardManager, as_float, response_lengths


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
        # a sample whose "acc" is missing or not a number (None, text) gets its score as acc
        extra["acc"] = [score if math.isnan(as_float(acc)) else acc for score, acc in zip(scores, own_acc)]
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
