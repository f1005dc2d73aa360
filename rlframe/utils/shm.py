"""Where rlframe keeps files in shared memory, and their removal when the process ends.

`shm_dir()` is `/dev/shm` unless `RLFRAME_SHM_DIR` names another folder (a small tmpfs in the tests, or a
larger mount than a container's 64 MB `/dev/shm`). Files there hold RAM until removed, so what a process
makes there it registers with `remove_at_exit`: removed at interpreter exit, earlier by its owner with
`remove_now`, or when its worker group asks it to `remove_registered` before killing it (a killed process
runs no exit handler). What a process killed anyway leaves is named after its pid, and `remove_stale`
clears it when the next process sets up.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
from typing import IO

SHM_DIR_ENV = "RLFRAME_SHM_DIR"

_to_remove: set[str] = set()
_shared: dict[str, IO] = {}  # a copy several processes use -> this process's file holding a shared lock on it


def shm_dir() -> str:
    """The shared-memory folder: $RLFRAME_SHM_DIR, else /dev/shm."""
    return os.environ.get(SHM_DIR_ENV) or "/dev/shm"


def remove_at_exit(path: str) -> None:
    """Remove `path` (a file or folder) when this process exits normally."""
    _to_remove.add(path)


def remove_now(path: str) -> None:
    """Remove `path` now and forget it."""
    _to_remove.discard(path)
    _remove(path)


def hold_shared(path: str, lock: IO) -> None:
    """`path` is used by this process while `lock` holds a shared flock: when this process exits (or its group
    releases it) and no other process holds one, `path` is removed."""
    _shared[path] = lock


def remove_stale(folder: str, prefix: str) -> None:
    """Remove the entries of `folder` named `<prefix><pid>-...` whose process no longer runs."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not _runs(int(pid)):
            _remove(os.path.join(folder, name))


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


@atexit.register
def remove_registered() -> None:
    """Remove every path registered with `remove_at_exit` now."""
    for path in list(_to_remove):
        remove_now(path)
    for path, lock in list(_shared.items()):
        del _shared[path]
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only when no other process still uses it
            _remove(path)
        except BlockingIOError:
            pass
        finally:
            lock.close()
