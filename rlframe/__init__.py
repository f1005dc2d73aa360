"""rlframe: exact, transparent PPO/GRPO training for language models on Ray + PyTorch FSDP.

`rlframe.train(config)` trains from Python (`rlframe.trainer.entry`); `rlframe train key=value ...` from the shell.
"""

__version__ = "0.1.0"

__all__ = ["TrainResult", "train"]


def __getattr__(name: str):
    # imported on first use: `import rlframe` (the CLI, `rlframe explain`) stays free of torch and Ray
    if name in ("train", "TrainResult"):
        from rlframe.trainer import entry

        return getattr(entry, name)
    raise AttributeError(f"module 'rlframe' has no attribute {name!r}")
