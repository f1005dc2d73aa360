"""rlframe: exact, transparent PPO/GRPO training for language models on Ray + PyTorch FSDP."""

__version__ = "0.1.0"
