"""The `custom_reward_function` section: a user's scorer file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlframe.config.schema import Section, key

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
        "rlframe: a sample whose scorer raised, returned NaN/inf or a malformed value, or timed out: zero = score 0 "
        "and train on it; drop = no weight in the advantages and the loss, left out of the reward metrics",
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
