"""`builtin://NAME` model paths: built offline on first use into the cache, then used as a folder."""

from __future__ import annotations

import functools
import os

from rlframe.models.tiny import BUILTIN_MODEL, make_tiny_model
from rlframe.utils.cache import cache_dir


def resolve_model_path(path: str) -> str:
    """`builtin://tiny` is built offline on first use; anything else is used as given."""
    if not path.startswith("builtin://"):
        return os.path.expanduser(path)
    if path != BUILTIN_MODEL:
        raise ValueError(f"model path {path!r} is not a built-in model; the built-in one is {BUILTIN_MODEL}")
    target = os.path.join(cache_dir(), "models", "tiny-qwen2-v1")
    if not os.path.isfile(os.path.join(target, "config.json")):
        tmp = f"{target}.tmp.{os.getpid()}"
        make_tiny_model(tmp)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(tmp, target)
    return target


SHM_ROOT = "/dev/shm"


@functools.cache  # actor, reference and rollout of a worker load the same folder
def copy_to_shm(path: str, shm_root: str = SHM_ROOT) -> str:
    """A copy of the model folder in shared memory (`model.use_shm`, as verl): later loads read RAM, not disk.

    One copy per folder version and node: the name hashes the path and every file's size and
    modification time, and a lock makes the other workers of the node wait for the first one's copy
    instead of making their own (each copy costs the model's size in RAM).
    """
    import fcntl
    import hashlib
    import shutil

    source = os.path.abspath(path)
    stamp = [source] + [
        f"{name}:{os.path.getsize(os.path.join(source, name))}:{os.path.getmtime(os.path.join(source, name))}"
        for name in sorted(os.listdir(source))
    ]
    folder = os.path.join(shm_root, "rlframe-models")
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, hashlib.sha1("\n".join(stamp).encode()).hexdigest()[:16])
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not os.path.isdir(target):
            tmp = f"{target}.tmp.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp)
            os.replace(tmp, target)
    return target
