"""Rule-based rewards: scorers chosen by data source, and the managers that apply them to a batch."""

from rlframe.reward.custom import load_custom_reward_function
from rlframe.reward.dapo import DAPORewardManager  # registers reward_manager=dapo
from rlframe.reward.manager import (
    REWARD_MANAGERS,
    BatchRewardManager,
    NaiveRewardManager,
    RewardManager,
    get_reward_manager_cls,
    load_reward_manager,
)
from rlframe.reward.scorers import KNOWN_DATA_SOURCES, default_compute_score

__all__ = [
    "KNOWN_DATA_SOURCES",
    "REWARD_MANAGERS",
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "RewardManager",
    "default_compute_score",
    "get_reward_manager_cls",
    "load_custom_reward_function",
    "load_reward_manager",
]
