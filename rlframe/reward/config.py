"""The reward sections: `custom_reward_function` (a user's scorer file) and the dapo manager's `reward_kwargs`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlframe.config.schema import Section, key, section

# what a sample whose scorer failed gets (rlframe/reward/manager.py)
ON_SCORER_ERROR = ("zero", "drop")


def _positive(value) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"must be > 0 seconds or null (no limit), got {value}")


@dataclass
class CustomRewardFunctionConfig(Section):
    path: Optional[str] = key(None, "python file with a scorer")
    name: str = key(
        "compute_score", "function name: compute_score(data_source, solution_str, ground_truth, extra_info)"
    )
    timeout_s: Optional[float] = key(
        None,
        "rlframe: seconds one batch's scoring may take (any scorer, run in a child process); samples not "
        "scored by then score 0 and count in reward/num_scorer_timeouts; null = no limit",
        check=_positive,
    )
    on_scorer_error: str = key(
        "zero",
        "rlframe: a sample whose scorer raised, returned NaN/inf, a malformed value or one beyond ±2**48, or timed "
        "out: zero = score 0 and train on it; drop = no weight in the advantages and the loss, left out of the "
        "reward metrics",
        choices=ON_SCORER_ERROR,
    )

    def check(self, path: str, root: Any) -> None:
        if self.on_scorer_error == "drop" and root.algorithm.filter_groups.enable:
            raise ValueError(
                f"{path}.on_scorer_error=drop with algorithm.filter_groups.enable=true is not implemented: dynamic "
                "sampling chooses groups by their scores before the dropped samples are taken out. Use "
                f"{path}.on_scorer_error=zero, or turn dynamic sampling off."
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        inactive = {} if self.path else {f"{path}.name": f"{path}.path=null: the built-in scorers are used"}
        if root.reward_model.enable:
            reason = "reward_model.enable=true: the reward model's scores are the reward, not the scorer's"
            inactive[f"{path}.on_scorer_error"] = reason
        return inactive


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
