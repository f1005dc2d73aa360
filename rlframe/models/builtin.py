"""`builtin://NAME` model paths: built offline on first use into the cache, then used as a folder."""

from __future__ import annotations

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


def copy_to_shm(path: str, shm_root: str = SHM_ROOT) -> str:
    """A copy of the model folder in shared memory (`model.use_shm`, as verl): later loads read RAM, not disk.

    One copy per folder and node, named by the folder's path and modification time; concurrent
    workers race harmlessly (each copies to a private name, the first rename wins).
    """
    import hashlib
    import shutil

    source = os.path.abspath(path)
    stamp = f"{source}:{os.path.getmtime(source)}".encode()
    target = os.path.join(shm_root, "rlframe-models", hashlib.sha1(stamp).hexdigest()[:16])
    if not os.path.isdir(target):
        tmp = f"{target}.tmp.{os.getpid()}"
        shutil.copytree(source, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another worker on this node finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target
