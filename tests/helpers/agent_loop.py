"""The agent loop's output keys."""

from __future__ import annotations

KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs")
