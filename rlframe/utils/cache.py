"""Where rlframe keeps what it builds on first use (tiny model, built-in task data)."""

import os


def cache_dir() -> str:
    """$RLFRAME_CACHE, else ~/.cache/rlframe."""
    return os.environ.get("RLFRAME_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlframe")
