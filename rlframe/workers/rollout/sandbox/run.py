"""One sandboxed run of a program: its launch command, its output read in capped chunks, its whole process tree killed
on every exit path.

The parent runs the program in its own session (`start_new_session`) and kills the group and the run's cgroups on
every exit path: normal end (leftover detached children), its own timeout, and cancellation by an outer timeout.
Output is read in chunks; at most `max_output_bytes` are kept, the rest is read and dropped (the program keeps
running until it ends or times out, so the exit status stays meaningful), and the result says it was cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass

from rlframe.workers.rollout.sandbox import isolation
from rlframe.workers.rollout.sandbox.cgroups import RunCgroups

READ_CHUNK_BYTES = 64 * 1024
EXIT_POLL_S = 0.01
MAX_FILE_BYTES = 2**20  # RLIMIT_FSIZE: a program may write files of at most 1 MiB
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE per process: bounds open files and pipes (a pipe is two)
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    max_processes: int
    disk_mb: int = 64


@dataclass(frozen=True)
class Isolation:
    """How a tool's runs are isolated, decided once (`resolve_isolation`): `mode` `bwrap` or `none`, and the
    (uid, gid) the program runs as (None: the trainer's own)."""

    mode: str
    ids: tuple[int, int] | None = None


@dataclass
class SandboxResult:
    """What one run gave back: its output (cut to the cap), whether it was cut, its exit status, its timeout, and
    whether the kernel killed it for going past the run's memory."""

    output: bytes
    truncated: bool
    exit_status: int | None
    timed_out: bool
    out_of_memory: bool = False


@dataclass
class Launch:
    """A prepared run: the command, the descriptors it inherits, and what to release afterwards."""

    command: list[str]
    pass_fds: tuple[int, ...]
    cgroups: RunCgroups

    def release(self) -> None:
        """Close the inherited descriptors and delete the cgroups (killing what is left in them)."""
        for fd in self.pass_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.cgroups.remove()


def prepare(code: str, folder: str, limits: SandboxLimits, policy: Isolation) -> Launch:
    """Write `code` to `folder`/program.py and build the launch command of a run (see launcher.py)."""
    program = os.path.join(folder, "program.py")
    with open(program, "w") as handle:
        handle.write(code)
    spec = {"binds": [], "user": policy.ids}
    pass_fds: tuple[int, ...] = ()
    if policy.mode == "bwrap":
        binds = [(path, path) for path in isolation.system_binds()]
        if policy.ids is not None:  # another user starts bwrap: bind what it needs into a folder it owns
            spec["binds"] = _stage(binds, folder, policy.ids)
            binds = [(staged, inside) for (_, staged), (_, inside) in zip(spec["binds"], binds)]
        pass_fds = (isolation.seccomp_fd(),)
        bwrap = [isolation.bwrap_path(), *isolation.bwrap_args(binds, limits.disk_mb, program, pass_fds[0])]
        spec["argv"] = [*bwrap, sys.executable, "-I", "/tmp/program.py"]
    else:
        spec["argv"] = [sys.executable, "-I", program]
    # last, so that nothing above can fail with a cgroup left behind
    cgroups = RunCgroups.create(limits.max_processes, (limits.memory_mb + limits.disk_mb) * 2**20)
    spec["cgroup_procs"] = cgroups.procs_files
    spec["rlimits"] = _rlimits(limits, policy, cgroups)
    # -S: no site module, so no .pth file of the venv runs in the launcher, which may be root
    command = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec)]
    return Launch(command, pass_fds, cgroups)


def _rlimits(limits: SandboxLimits, policy: Isolation, cgroups: RunCgroups) -> list[list]:
    """The launcher's rlimits (name, value), hard and soft alike."""
    rlimits = [
        ["RLIMIT_CPU", int(limits.timeout_s) + 1],
        ["RLIMIT_AS", limits.memory_mb * 2**20],
        ["RLIMIT_FSIZE", MAX_FILE_BYTES],
        ["RLIMIT_NOFILE", MAX_OPEN_FILES],
        ["RLIMIT_CORE", 0],
    ]
    if "pids" not in cgroups.bounds:
        # no pids cgroup: RLIMIT_NPROC is the bound. The kernel counts every process and thread of the user, the
        # trainer's included, so the limit leaves room for those that exist now
        uid = os.geteuid() if policy.ids is None else policy.ids[0]
        rlimits.append(["RLIMIT_NPROC", _tasks_of(uid) + limits.max_processes])
    return rlimits


def _stage(binds: list[tuple[str, str]], folder: str, ids: tuple[int, int]) -> list[list[str]]:
    """Mount points under `folder` for each bind's source, `folder` handed to the program's user."""
    staging = os.path.join(folder, ".binds")
    os.mkdir(staging)
    pairs = []
    for index, (source, _) in enumerate(binds):
        mount_point = os.path.join(staging, str(index))
        os.mkdir(mount_point)
        pairs.append([source, mount_point])
    os.chown(folder, *ids)
    return pairs


def _tasks_of(uid: int) -> int:
    """Processes + threads of `uid` now."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


async def run_python(code: str, folder: str, limits: SandboxLimits, policy: Isolation) -> SandboxResult:
    """Run `code` with the interpreter in `folder`, isolated as `policy` says, every process of it dead on return."""
    launch = prepare(code, folder, limits, policy)  # on the loop: a cancellation cannot orphan what it creates
    try:
        process = await asyncio.create_subprocess_exec(
            *launch.command,
            cwd=folder,
            env={},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            pass_fds=launch.pass_fds,
        )
    except BaseException:
        await asyncio.to_thread(launch.release)
        raise
    sink = _CappedSink(limits.max_output_bytes)
    timed_out = False
    try:
        await asyncio.wait_for(_collect(process, sink, launch.cgroups), limits.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:  # also on cancellation by an outer timeout
        _kill_tree(process, launch.cgroups)
        out_of_memory = launch.cgroups.oom_killed()
        # a release may wait for members to die: off the event loop (the thread finishes even if we are cancelled)
        await asyncio.to_thread(launch.release)
    return SandboxResult(bytes(sink.kept), sink.truncated, process.returncode, timed_out, out_of_memory)


class _CappedSink:
    """Keeps the first `limit` bytes of a stream and counts the rest away."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.truncated = False

    def feed(self, chunk: bytes) -> None:
        """Keep what fits of `chunk`; note that the stream was cut when it does not all fit."""
        room = self.limit - len(self.kept)
        if len(chunk) > room:
            self.truncated = True
        if room > 0:
            self.kept += chunk[:room]


async def _collect(process: asyncio.subprocess.Process, sink: _CappedSink, cgroups: RunCgroups | None) -> None:
    """Read the output while the program runs; when it exits, kill what it left (which may hold the pipe open)."""
    reader = asyncio.ensure_future(_pump(process.stdout, sink))
    try:
        # not process.wait(): in Python 3.11 it also waits for the pipe, which a leftover child may hold open
        while process.returncode is None:
            await asyncio.sleep(EXIT_POLL_S)
        _kill_tree(process, cgroups)
        await reader
    finally:
        reader.cancel()


async def _pump(stream: asyncio.StreamReader, sink: _CappedSink) -> None:
    while chunk := await stream.read(READ_CHUNK_BYTES):
        sink.feed(chunk)


def _kill_tree(process: asyncio.subprocess.Process, cgroups: RunCgroups | None) -> None:
    """SIGKILL the run's process group (the program's session) and every member of its cgroups."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if cgroups:
        cgroups.kill_all()
