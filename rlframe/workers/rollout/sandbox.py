"""Runs code a policy wrote so that nothing it does outlives the call or reaches past its folder.

Three layers, each doing one job (what each contains is in docs/multi_turn.md, Tools):

- **bubblewrap** (`bwrap`, when present and it passes a self-check): new PID, network, IPC, UTS and user
  namespaces; a root file system of read-only binds (`/usr`, the interpreter's prefixes); the call's folder a
  tmpfs of `disk_mb`, the only writable place; `--die-with-parent`, `--new-session`. When the program ends or is
  killed, the PID namespace dies with it, so even a grandchild that called `setsid` is gone.
- **a launcher** (`python -I -c LAUNCHER`): joins the pids cgroup, sets the rlimits (CPU, address space, file
  size, processes, no core) and execs bwrap or the program. It replaces `preexec_fn`, which Python documents as
  unsafe in a process with threads (the agent loop has them).
- **a pids cgroup**, where this process may create one (cgroup v1 `pids`, or v2 with `pids` delegated): caps the
  number of processes and threads of the call, and lets the parent kill every member, even one that escaped the
  process group. As root the kernel ignores RLIMIT_NPROC, so this is then the only bound on a fork bomb.

The parent always runs in its own session (`start_new_session`) and kills the group (and the cgroup) on every
exit path: normal end (leftover detached children), its own timeout, and cancellation by an outer timeout.
Output is read in chunks; at most `max_output_bytes` are kept, the rest is read and dropped (the program keeps
running until it ends or times out, so the exit status stays meaningful), and the result says it was cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "bwrap", "none")
READ_CHUNK_BYTES = 64 * 1024
EXIT_POLL_S = 0.01
MAX_FILE_BYTES = 2**20  # RLIMIT_FSIZE: a program may write files of at most 1 MiB

# Runs in the child before anything of the user's: argv = cpu_s memory_bytes file_bytes processes cgroup_procs cmd...
LAUNCHER = """
import os, resource, sys
cpu, memory, file_size, processes, cgroup_procs = sys.argv[1:6]
if cgroup_procs:
    with open(cgroup_procs, "w") as handle:
        handle.write(str(os.getpid()))
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, file_size),
                     (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_CORE, "0")):
    resource.setrlimit(limit, (int(value), int(value)))
os.execv(sys.argv[6], sys.argv[6:])
"""

NOT_CONTAINED_WITHOUT_BWRAP = (
    "the program can read every file this user can read, write where this user can write (outside its "
    "temporary folder too), open network connections, and a grandchild that calls setsid survives the call "
    "unless a pids cgroup is available"
)


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    max_processes: int
    disk_mb: int = 64


@dataclass
class SandboxResult:
    """What one run gave back: its output (cut to the cap), whether it was cut, its exit status, its timeout."""

    output: bytes
    truncated: bool
    exit_status: int | None
    timed_out: bool


def resolve_mode(mode: str, where: str) -> str:
    """`bwrap` or `none` for a configured `sandbox` value; `auto` picks bwrap when its self-check passes."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"{where}: sandbox={mode!r} is not one of {list(SANDBOX_MODES)}")
    if mode == "none":
        return "none"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if mode == "bwrap":
        raise ValueError(f"{where}: sandbox='bwrap' but bubblewrap cannot run here: {problem}")
    _warn_unsandboxed(problem)
    return "none"


@functools.cache
def _warn_unsandboxed(problem: str) -> None:
    logger.warning("PythonTool runs without bubblewrap (%s): %s", problem, NOT_CONTAINED_WITHOUT_BWRAP)


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox here (absent, or its self-check fails), or None when it can."""
    if not _bwrap_path():
        return "bwrap is not installed (Debian package `bubblewrap`)"
    probe = "import socket; socket.socket().connect(('127.0.0.1', 9))"  # must fail: no network inside
    check = f"print('ok')\ntry: {probe}\nexcept OSError: pass\nelse: print('network reachable')"
    try:
        with tempfile.TemporaryDirectory(prefix="rlframe_bwrap_check_") as folder:
            command = [*bwrap_command(os.path.realpath(folder)), sys.executable, "-I", "-c", check]
            done = subprocess.run(command, capture_output=True, timeout=30, env={})
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap self-check failed: {err}"
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        return f"bwrap self-check failed (exit {done.returncode}): {done.stderr.decode(errors='replace')[-300:]}"
    return None


def _bwrap_path() -> str | None:
    from shutil import which

    return which("bwrap")


def bwrap_command(folder: str, disk_mb: int = 64) -> list[str]:
    """The bwrap prefix: read-only system and interpreter, no network, and at `folder` a tmpfs of `disk_mb` (the
    only writable place, so a program cannot fill the host's disk) holding a read-only copy of `program.py`."""
    command = [_bwrap_path() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    command += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    prefixes.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    for prefix in sorted(prefixes):
        if not prefix.startswith("/usr"):
            command += ["--ro-bind", prefix, prefix]
    if sys.prefix != os.path.realpath(sys.prefix):  # a venv reached through a symlink keeps its own path
        command += ["--ro-bind", sys.prefix, sys.prefix]
    command += ["--size", str(disk_mb * 2**20), "--tmpfs", folder]
    program = os.path.join(folder, "program.py")
    if os.path.exists(program):
        command += ["--ro-bind", program, program]
    command += ["--chdir", folder]  # bwrap also sets PWD (to `folder`)
    return command


class PidsCgroup:
    """A pids cgroup of its own for one run: caps processes + threads and lets the parent kill every member."""

    def __init__(self, path: str):
        self.path = path
        self.procs = os.path.join(path, "cgroup.procs")

    @classmethod
    def create(cls, max_processes: int) -> PidsCgroup | None:
        """A new cgroup under this process's own pids cgroup, or None where it cannot be made (no v1 `pids`
        hierarchy or v2 delegation, no permission)."""
        parent = _pids_cgroup_parent()
        if parent is None:
            return None
        path = os.path.join(parent, f"rlframe_sandbox_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as handle:
                handle.write(str(max_processes))
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return None
        return cls(path)

    def kill_all(self) -> None:
        """SIGKILL every member listed now."""
        try:
            with open(self.procs) as handle:
                pids = [int(line) for line in handle if line.strip()]
        except OSError:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, wait_s: float = 2.0) -> None:
        """Kill the members and delete the cgroup; repeated while members fork or die (the kernel refuses to
        remove a cgroup that still lists one), for at most `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            self.kill_all()
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    logger.warning("could not remove the sandbox cgroup %s: a member did not die", self.path)
                    return
                time.sleep(0.005)


@functools.cache
def _pids_cgroup_parent() -> str | None:
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidate = os.path.join("/sys/fs/cgroup/pids", path.lstrip("/"))
        elif controllers == "":
            candidate = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            try:
                with open(os.path.join(candidate, "cgroup.subtree_control")) as handle:
                    if "pids" not in handle.read().split():
                        continue
            except OSError:
                continue
        else:
            continue
        if os.access(candidate, os.W_OK):
            return candidate
    return None


async def run_python(code: str, folder: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    """Run `code` with the interpreter in `folder` (mode `bwrap` | `none`), every process of it dead on return."""
    program = os.path.join(folder, "program.py")
    with open(program, "w") as handle:
        handle.write(code)
    cgroup = PidsCgroup.create(limits.max_processes)
    cpu_s = int(limits.timeout_s) + 1
    launcher = [sys.executable, "-I", "-c", LAUNCHER, str(cpu_s), str(limits.memory_mb * 2**20), str(MAX_FILE_BYTES)]
    launcher += [str(limits.max_processes), cgroup.procs if cgroup else ""]
    target = [sys.executable, "-I", program]
    command = launcher + (bwrap_command(folder, limits.disk_mb) + target if mode == "bwrap" else target)
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=folder,
            env={},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except BaseException:
        if cgroup:
            cgroup.remove()
        raise
    sink = _CappedSink(limits.max_output_bytes)
    timed_out = False
    try:
        await asyncio.wait_for(_collect(process, sink, cgroup), limits.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:  # also on cancellation by an outer timeout
        _kill_tree(process, cgroup)
    return SandboxResult(bytes(sink.kept), sink.truncated, process.returncode, timed_out)


class _CappedSink:
    """Keeps the first `limit` bytes of a stream and counts the rest away."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.truncated = False

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.kept)
        if len(chunk) > room:
            self.truncated = True
        if room > 0:
            self.kept += chunk[:room]


async def _collect(process: asyncio.subprocess.Process, sink: _CappedSink, cgroup: PidsCgroup | None) -> None:
    """Read the output while the program runs; when it exits, kill what it left (which may hold the pipe open)."""
    reader = asyncio.ensure_future(_pump(process.stdout, sink))
    try:
        # not process.wait(): in Python 3.11 it also waits for the pipe, which a leftover child may hold open
        while process.returncode is None:
            await asyncio.sleep(EXIT_POLL_S)
        _kill_tree(process, cgroup)
        await reader
    finally:
        reader.cancel()


async def _pump(stream: asyncio.StreamReader, sink: _CappedSink) -> None:
    while chunk := await stream.read(READ_CHUNK_BYTES):
        sink.feed(chunk)


def _kill_tree(process: asyncio.subprocess.Process, cgroup: PidsCgroup | None) -> None:
    """SIGKILL the run's process group (the program's session) and every member of its cgroup."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if cgroup:
        cgroup.remove()
