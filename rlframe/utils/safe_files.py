"""Writing and removing checkpoint files without following a symlink out of the folder they belong to.

A file is written under a fresh name made with `O_CREAT | O_EXCL | O_NOFOLLOW` (a name planted in advance, a
symlink included, is never opened) and renamed over its target with `os.replace`, which replaces a symlink
rather than writing through it. A folder is filled under a fresh name made by `mkdir` (which never follows a
symlink either) and renamed the same way. A removal first resolves where the thing really lies and refuses
anything outside the root it belongs to; a symlink itself is unlinked, never followed.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from typing import BinaryIO


class UnsafePathError(ValueError):
    """A path in a checkpoint leads out of its folder through a symlink; the message names it and the fix."""


def _fresh_name(path: str) -> str:
    """A name next to `path` that nothing can have planted: random, hidden, ending `.tmp`."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")


def write_file_atomically(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` through a fresh temporary file (synced) and an atomic rename; nothing is left on failure."""
    tmp = _fresh_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)  # 0o666: the umask decides
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def replace_folder(path: str, fill: Callable[[str], object]) -> None:
    """Fill a fresh temporary folder with `fill(tmp)`, then rename it to `path`; nothing is left on failure.

    An existing folder at `path` is replaced; a symlink at `path` is refused (UnsafePathError), never written through.
    """
    refuse_symlink(path, "remove the link or choose another output folder")
    tmp = _fresh_name(path)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    os.mkdir(tmp)
    try:
        fill(tmp)
        remove_under(path, os.path.dirname(os.path.abspath(path)))
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def refuse_symlink(path: str, fix: str, name: str | None = None) -> None:
    """Raise UnsafePathError naming `path` (as `name`, e.g. its config key) and its target when it is a symlink."""
    if os.path.islink(path):
        raise UnsafePathError(
            f"{name or path} is a symlink (to {os.readlink(path)}); rlframe does not follow it, so that nothing "
            f"outside the folder is written, read or deleted: {fix}"
        )


def remove_under(path: str, root: str) -> None:
    """Remove the file, folder or symlink `path` (if any), refused unless it really lies inside `root`.

    A symlink at `path` is unlinked and what it points to stays; a folder on the way to `path` that is a
    symlink out of `root` makes the removal an UnsafePathError (it would delete files elsewhere).
    """
    real_root = os.path.realpath(root)
    path = os.path.normpath(os.path.abspath(path))
    where = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    if where == real_root or os.path.commonpath([where, real_root]) != real_root:
        raise UnsafePathError(
            f"refusing to remove {path}: it lies at {where}, outside {root} (a folder on its way is a symlink out "
            "of it); move that checkpoint into the folder, or remove the link yourself"
        )
    if os.path.islink(where) or os.path.isfile(where):
        os.unlink(where)
    elif os.path.isdir(where):
        shutil.rmtree(where)  # never follows a link inside the tree: links are unlinked
