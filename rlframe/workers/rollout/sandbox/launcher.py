"""The first process of every sandboxed run: `python -I launcher.py SPEC_JSON` (standard library only).

In this order, each step needing what the previous one still has:
1. joins the run's cgroups (writing its pid needs the trainer's user, often root);
2. where the program will run as another user: in a mount namespace of its own, binds the folders the program
   needs (the interpreter, maybe under a home folder that user cannot enter) onto mount points inside the run's
   folder, which that user owns, so bubblewrap, started as that user, can bind them in turn;
3. sets the rlimits (before the drop: an unprivileged process cannot raise a hard limit again);
4. drops to that user (no supplementary groups), and checks that no id of root is left;
5. execs bubblewrap or the program.
A failure prints one line and exits 126, which the tool reports with the program's output.

Python documents `preexec_fn` as unsafe in a process with threads (the agent loop has them): this replaces it.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args}: {os.strerror(err)}")


def bind_in_private_namespace(binds: list) -> None:
    """Bind each (source, mount point) pair in a new mount namespace that propagates nothing back to the host."""
    _libc_call("unshare", CLONE_NEWNS)
    _libc_call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    for source, mount_point in binds:
        _libc_call("mount", source.encode(), mount_point.encode(), None, MS_BIND | MS_REC, None)


def drop_to(uid: int, gid: int) -> None:
    """Become `uid`:`gid` for good (real, effective and saved ids), with no supplementary groups."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if 0 in os.getresuid() or 0 in os.getresgid() or os.getgroups():
        raise OSError(f"still holding a root id after the drop: uids {os.getresuid()}, gids {os.getresgid()}")


def main(spec: dict) -> None:
    """Steps 1-5 of the module docstring for one run."""
    for procs in spec["cgroup_procs"]:
        with open(procs, "w") as handle:
            handle.write(str(os.getpid()))
    if spec["binds"]:
        bind_in_private_namespace(spec["binds"])
    for name, value in spec["rlimits"]:
        resource.setrlimit(getattr(resource, name), (value, value))
    if spec["user"]:
        drop_to(*spec["user"])
    os.execv(spec["argv"][0], spec["argv"])


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except Exception as err:  # anything: the run must not go on half set up
        print(f"rlframe sandbox launcher: {type(err).__name__}: {err}", flush=True)
        sys.exit(126)
