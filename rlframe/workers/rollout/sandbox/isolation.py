"""What keeps a sandboxed program away from the host: bubblewrap's namespaces, an unprivileged user, a seccomp
filter, and the self-check that proves each of them before the first run.

- **The user.** As root the program runs as a dedicated unprivileged user (`sandbox_user`, default
  `rlframe-sandbox`): bubblewrap started by root maps the program to host uid 0, which owns `/proc/sys` and every
  file of the system whatever capabilities are dropped. Started by that user, bubblewrap builds its namespaces
  unprivileged, as it was designed to. A trainer that is not root runs the program as itself.
- **bubblewrap**: new user, PID, network, IPC, UTS and cgroup namespaces; a read-only root holding only `/usr`, the
  `/lib*`, `/bin`, `/sbin` folders and the interpreter's prefixes; `/tmp` a tmpfs of `disk_mb` (the program's folder
  and `/dev/shm`, the only writable place); a minimal `/dev`; no environment but `PATH` and `HOME`; every capability
  dropped, no new privileges, no nested user namespaces; `--die-with-parent`, `--new-session`.
- **seccomp** (libseccomp, through `pyseccomp`): `mount`, `pivot_root`, `ptrace`, `bpf`, `keyctl`, namespace
  creation and entry, module loading, `perf_event_open` and the other calls in `DENIED_SYSCALLS` fail with EPERM.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile

SANDBOX_USER = "rlframe-sandbox"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
# the calls a Python program never needs and an escape always does; each fails with EPERM
DENIED_SYSCALLS = (
    # file systems and the root: remounting a bind read-write, mounting a tmpfs outside disk_mb, leaving the root
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
    "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # other processes and the kernel
    "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
    "request_key", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "vhangup", "lookup_dcookie",
    # namespaces: no new ones and no joining others'
    "unshare", "setns",
)  # fmt: skip
# clone() flags that make namespaces: clone is allowed (threads, fork) unless one of them is set
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


def sandbox_ids(user: str | None, where: str) -> tuple[int, int] | None:
    """The (uid, gid) the program runs as: `user` (default `rlframe-sandbox`) when the trainer is root, or None
    (the trainer's own ids) otherwise; an error naming the fix where that user is missing or privileged."""
    if os.geteuid() != 0:
        own = pwd.getpwuid(os.geteuid()).pw_name if _has_passwd_entry(os.geteuid()) else str(os.geteuid())
        if user not in (None, own):
            raise ValueError(f"{where}: sandbox_user={user!r} needs a trainer running as root (it runs as {own!r})")
        return None
    name = user or SANDBOX_USER
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(
            f"{where}: the trainer runs as root, so the program runs as the unprivileged user {name!r}, which does "
            f"not exist; create it (`useradd --system --no-create-home --shell /usr/sbin/nologin {name}`) or set "
            "sandbox_user to another unprivileged user"
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise ValueError(
            f"{where}: sandbox_user={name!r} has uid {entry.pw_uid}, gid {entry.pw_gid}: it must not be root"
        )
    return entry.pw_uid, entry.pw_gid


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def bwrap_path() -> str | None:
    """Where bubblewrap is installed, or None."""
    return shutil.which("bwrap")


@functools.cache
def bwrap_version() -> tuple[int, ...]:
    """bubblewrap's version, e.g. (0, 8, 0); (0,) where it cannot be read."""
    try:
        out = subprocess.run([bwrap_path() or "bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(part) for part in out.split()[-1].split("."))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return (0,)


def system_binds() -> list[str]:
    """The host folders the program's root holds, read-only: /usr, the /lib*, /bin, /sbin folders that are not
    symlinks, and the interpreter's prefixes (a venv and its base Python)."""
    folders = ["/usr"]
    folders += [
        top for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64") if os.path.isdir(top) and not os.path.islink(top)
    ]
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    prefixes.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    if sys.prefix != os.path.realpath(sys.prefix):  # a venv reached through a symlink keeps its own path
        prefixes.add(sys.prefix)
    folders += sorted(p for p in prefixes if not p.startswith("/usr/") and p != "/usr")
    return folders


def bwrap_args(binds: list[tuple[str, str]], disk_mb: int, program: str, seccomp_fd: int) -> list[str]:
    """bubblewrap's arguments: `binds` (source on the host, path inside) read-only, `/tmp` a tmpfs of `disk_mb`
    holding a read-only `program.py`, the seccomp filter read from `seccomp_fd`."""
    args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    if bwrap_version() >= (0, 8):  # older ones lack the flag; the seccomp filter refuses new namespaces either way
        args.append("--disable-userns")
    args += ["--cap-drop", "ALL", "--clearenv", "--setenv", "PATH", SAFE_PATH, "--setenv", "HOME", "/tmp"]
    args += ["--proc", "/proc"]
    for source, inside in binds:
        args += ["--ro-bind", source, inside]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
    args += ["--size", str(disk_mb * 2**20), "--tmpfs", "/tmp", "--ro-bind", program, "/tmp/program.py"]
    args += _minimal_dev()
    args += ["--chdir", "/tmp", "--remount-ro", "/", "--seccomp", str(seccomp_fd)]
    return args


def _minimal_dev() -> list[str]:
    """/dev with the five character devices, the stdio links and `/dev/shm` pointing into `/tmp` (so shared memory
    counts against `disk_mb` too), then read-only. No pts: the program has no terminal."""
    args = ["--size", str(2**16), "--tmpfs", "/dev"]
    for device in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    args += ["--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "/tmp", "/dev/shm"]
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{number}", f"/dev/{name}"]
    return args + ["--remount-ro", "/dev"]


@functools.cache
def seccomp_program() -> bytes:
    """The compiled BPF filter (built once): DENIED_SYSCALLS and namespace-making clone() fail with EPERM;
    clone3 fails with ENOSYS, so the C library falls back to clone, whose flags the filter can read."""
    import pyseccomp

    deny = pyseccomp.ERRNO(errno.EPERM)
    program = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        program.add_rule(deny, name)
    for flag in NAMESPACE_FLAGS:
        program.add_rule(deny, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    program.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as handle:
        program.export_bpf(handle)
        handle.seek(0)
        return handle.read()


def seccomp_fd() -> int:
    """A new memfd holding the filter, at offset 0, inheritable (bubblewrap reads it with --seccomp)."""
    fd = os.memfd_create("rlframe_seccomp", 0)
    os.write(fd, seccomp_program())
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd


# ------------------------------------------------------------------------------------------------ self-check
PROBE = r"""
import ctypes, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
def opens(path, flags):
    try:
        os.close(os.open(path, flags))
        return True
    except OSError:
        return False
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(),
    "capabilities": {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
    "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
    "mount_tmpfs": libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0,
    "remount_rw": libc.mount(None, b"/usr", None, 0x20 | 0x1000, None) == 0,
    "new_user_namespace": libc.unshare(0x10000000) == 0,
    "proc_sys_write": opens("/proc/sys/kernel/printk_ratelimit", os.O_WRONLY),
    "root_write": opens("/rlframe_probe", os.O_WRONLY | os.O_CREAT),
    "network": [name for _, name in socket.if_nameindex()],
    "processes": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "environment": sorted(os.environ),
}))
"""
# what the probe must report, and how each failure is named
EXPECTED = {
    "uid": ("runs as root (uid 0)", lambda v: v != 0),
    "gid": ("runs with group root (gid 0)", lambda v: v != 0),
    "capabilities": ("holds capabilities", lambda v: all(int(x, 16) == 0 for x in v.values())),
    "no_new_privs": ("may gain privileges (no_new_privs is not set)", lambda v: v == "1"),
    "seccomp": ("runs without the seccomp filter", lambda v: v == "2"),
    "mount_tmpfs": ("could mount a tmpfs", lambda v: not v),
    "remount_rw": ("could remount a read-only bind read-write", lambda v: not v),
    "new_user_namespace": ("could create a user namespace", lambda v: not v),
    "proc_sys_write": ("could open /proc/sys for writing", lambda v: not v),
    "root_write": ("could create a file in its root", lambda v: not v),
    "network": ("shares a network with the host (interfaces beyond its own loopback)", lambda v: v in ([], ["lo"])),
    "processes": ("sees processes outside its own", lambda v: len(v) <= 2),
    "environment": ("inherits environment variables", lambda v: set(v) <= {"PATH", "HOME", "PWD", "LC_CTYPE"}),
}


def probe_failures(report_json: str) -> list[str]:
    """What the self-check probe's report shows is not contained (empty when everything holds)."""
    report = json.loads(report_json)
    return [f"{what} ({key}={report[key]!r})" for key, (what, holds) in EXPECTED.items() if not holds(report[key])]


def missing_piece() -> str | None:
    """The missing prerequisite of the bubblewrap sandbox (bubblewrap, libseccomp), with its fix, or None."""
    if bwrap_path() is None:
        return "bubblewrap is not installed: `apt-get install bubblewrap` (Debian/Ubuntu)"
    try:
        seccomp_program()
    except (ImportError, RuntimeError, OSError) as err:
        return (
            f"the seccomp filter cannot be built ({type(err).__name__}: {err}): rlframe's `pyseccomp` dependency "
            "needs libseccomp (`apt-get install libseccomp2`)"
        )
    return None


def probe_subprocess(command: list[str], pass_fds: tuple[int, ...]) -> tuple[int, str, str]:
    """Run the probe's full launch command; (exit status, stdout, stderr)."""
    done = subprocess.run(command, capture_output=True, timeout=60, env={}, pass_fds=pass_fds, start_new_session=True)
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


# what bubblewrap's own error means when it cannot build the namespaces, and the fix
NAMESPACE_FIX = (
    "bubblewrap needs unprivileged user namespaces: on the host, `sysctl kernel.unprivileged_userns_clone=1` (Debian "
    "before 12) or an AppArmor profile for bwrap (Ubuntu 24.04, `kernel.apparmor_restrict_unprivileged_userns`); in "
    "Docker, a seccomp profile that allows `clone`/`unshare` with CLONE_NEWUSER (Docker's default refuses them)"
)
