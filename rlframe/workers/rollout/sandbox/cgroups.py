"""A cgroup of its own for each sandboxed run: a bound on its processes and on its total memory, and a handle that
kills every member, even one that left the process group.

cgroup v1 keeps each controller in its own hierarchy (`/sys/fs/cgroup/pids/...`, `/sys/fs/cgroup/memory/...`), so a
run gets one folder per controller; cgroup v2 has one folder holding both, where the current cgroup delegates them
(`cgroup.subtree_control`). Creating either usually needs root. Where a controller cannot be had, the run goes
without it and the tool's documentation says what is then unbounded.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import time
import uuid

logger = logging.getLogger(__name__)

CONTROLLERS = ("pids", "memory")


class RunCgroups:
    """The cgroup folders of one run (one per controller on v1, one for all on v2)."""

    def __init__(self, folders: dict[str, str]):
        self.folders = folders  # controller -> folder; on v2 both controllers name the same folder

    @classmethod
    def create(cls, max_processes: int, memory_bytes: int) -> RunCgroups:
        """New cgroups under this process's own, with `pids.max` and the memory limit set; controllers that
        cannot be created here are left out (`bounds` says which were had)."""
        limits = {"pids": {"pids.max": str(max_processes)}, "memory": _memory_limits(memory_bytes)}
        name = f"rlframe_sandbox_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        folders: dict[str, str] = {}
        for controller in CONTROLLERS:
            parent = controller_parent(controller)
            if parent is None:
                continue
            folder = os.path.join(parent, name)
            try:
                if folder not in folders.values():
                    os.mkdir(folder)
                _write_limits(folder, limits[controller])
            except OSError:
                with contextlib.suppress(OSError):
                    if folder not in folders.values():
                        os.rmdir(folder)
                continue
            folders[controller] = folder
        return cls(folders)

    @property
    def bounds(self) -> tuple[str, ...]:
        """The controllers this run is bounded by."""
        return tuple(self.folders)

    @property
    def procs_files(self) -> list[str]:
        """The `cgroup.procs` files a member writes its pid into (once per distinct folder)."""
        return [os.path.join(folder, "cgroup.procs") for folder in dict.fromkeys(self.folders.values())]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a member for going past the memory limit."""
        folder = self.folders.get("memory")
        if folder is None:
            return False
        for events in ("memory.events", "memory.oom_control"):  # v2, v1: both carry an `oom_kill N` line
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(folder, events)) as handle:
                    counts = dict(line.split() for line in handle if len(line.split()) == 2)
                return int(counts.get("oom_kill", 0)) > 0
        return False

    def kill_all(self) -> None:
        """SIGKILL every member listed now."""
        for procs in self.procs_files:
            try:
                with open(procs) as handle:
                    pids = [int(line) for line in handle if line.strip()]
            except OSError:
                continue
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def remove(self, wait_s: float = 2.0) -> None:
        """Kill the members and delete the folders; repeated while members fork or die (the kernel refuses to
        remove a cgroup that still lists one), for at most `wait_s`."""
        deadline = time.monotonic() + wait_s
        for folder in dict.fromkeys(self.folders.values()):
            while True:
                self.kill_all()
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        logger.warning("could not remove the sandbox cgroup %s: a member did not die", folder)
                        break
                    time.sleep(0.005)


def _memory_limits(memory_bytes: int) -> dict[str, str]:
    # v2 names; v1 names are mapped in _write_limits. No swap: memory past the limit is an OOM kill, not a crawl
    return {"memory.max": str(memory_bytes), "memory.swap.max": "0"}


_V1_NAMES = {"memory.max": "memory.limit_in_bytes", "memory.swap.max": None}


def _write_limits(folder: str, limits: dict[str, str]) -> None:
    v1 = not os.path.exists(os.path.join(folder, "cgroup.controllers"))
    for name, value in limits.items():
        target = _V1_NAMES.get(name, name) if v1 else name
        if target is None:
            continue
        path = os.path.join(folder, target)
        if name == "memory.swap.max" and not os.path.exists(path):
            continue  # a kernel without swap accounting: nothing to bound
        with open(path, "w") as handle:
            handle.write(value)


@functools.cache
def controller_parent(controller: str) -> str | None:
    """The writable cgroup folder of this process for `controller` (v1 hierarchy first, then v2), or None."""
    mounts = _cgroup_mounts()
    lines = _proc_lines("/proc/self/cgroup")
    if lines is None:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root = mounts.get("cgroup2")
            if root is None:
                continue
            candidate = os.path.join(root, path.lstrip("/"))
            try:
                with open(os.path.join(candidate, "cgroup.subtree_control")) as handle:
                    if controller not in handle.read().split():
                        continue
            except OSError:
                continue
        elif controller in controllers.split(","):
            root = mounts.get(controller)
            if root is None:
                continue
            candidate = os.path.join(root, path.lstrip("/"))
        else:
            continue
        if os.access(candidate, os.W_OK):
            return candidate
    return None


def _cgroup_mounts() -> dict[str, str]:
    """Mount points by controller (v1) and `cgroup2` for the unified hierarchy, read from /proc/self/mounts."""
    found: dict[str, str] = {}
    lines = _proc_lines("/proc/self/mounts")
    if lines is None:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        mount_point, kind, options = fields[1], fields[2], fields[3].split(",")
        if kind == "cgroup2":
            found.setdefault("cgroup2", mount_point)
        elif kind == "cgroup":
            for controller in CONTROLLERS:
                if controller in options:
                    found.setdefault(controller, mount_point)
    return found


def _proc_lines(path: str) -> list[str] | None:
    """The lines of a /proc file, or None where it cannot be read."""
    try:
        with open(path) as handle:
            return handle.read().splitlines()
    except OSError:
        return None
