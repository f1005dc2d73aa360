"""The `custom_reward_function` section: a user's scorer file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlframe.config.schema import Section, key


@dataclass
class CustomRewardFunctionConfig(Section):
    path: Optional[str] = key(None, "python file with a scorer")
    name: str = key(
        "compute_score", "function name: compute_score(data_source, solution_str, ground_truth, extra_info)"
    )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        return {} if self.path else {f"{path}.name": f"{path}.path=null: the built-in scorers are used"}
