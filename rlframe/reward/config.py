"""The `custom_reward_function` section: a user's scorer file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlframe.config.schema import Section, key


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

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        return {} if self.path else {f"{path}.name": f"{path}.path=null: the built-in scorers are used"}
