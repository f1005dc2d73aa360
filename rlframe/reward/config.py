"""The `custom_reward_function` section: a user's scorer file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlframe.config.schema import Section, key


@dataclass
class CustomRewardFunctionConfig(Section):
    path: Optional[str] = key(None, "python file with a scorer")
    name: str = key(
        "compute_score", "function name: compute_score(data_source, solution_str, ground_truth, extra_info)"
    )
