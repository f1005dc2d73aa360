"""The Python tool's sandbox is a boundary when the trainer runs as root (as CI and the GPU nodes do).

Each case is an attempt an adversarial policy made against the sandbox of main 09485a7, where bubblewrap started by
root left the program host uid 0 with every capability. The tests run as whatever user runs the suite; the
assertions about the host user hold for root (the program runs as `rlframe-sandbox`, which scripts/test.sh creates)
and for a non-root user (the program runs as that user, never root).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sysconfig
import threading
import time
import uuid

import pytest

from rlframe.workers.rollout import sandbox
from rlframe.workers.rollout.sandbox import isolation
from rlframe.workers.rollout.sandbox.cgroups import RunCgroups
from rlframe.workers.rollout.tools import PythonTool


def require_cgroup(controller: str) -> None:
    """Fail naming the controller where this machine cannot give a run that cgroup (the case cannot be shown)."""
    probe = RunCgroups.create(16, 2**30)
    probe.remove()
    if controller not in probe.bounds:
        pytest.fail(f"no {controller} cgroup can be made here: this case needs one (docs/multi_turn.md says what then)")


def run_code(code: str, **config) -> str:
    """The text PythonTool answers for `code`."""
    tool = PythonTool({"timeout_s": 10, **config}, None)
    return asyncio.run(tool.execute("i", {"code": code}))[0].text


def status_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as handle:
        return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)


def test_the_program_holds_no_root_id_and_no_capability_seen_from_the_host():
    marker = f"rlframe_boundary_{uuid.uuid4().hex}"
    inner = f"# {marker}\nimport time\nprint('up', flush=True)\ntime.sleep(5)"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-c', {inner!r}])"
    answer: list[str] = []
    worker = threading.Thread(target=lambda: answer.append(run_code(code)))
    worker.start()
    status = None
    deadline = time.monotonic() + 10
    while status is None and time.monotonic() < deadline:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        status = status_of(int(entry))
            except OSError:
                continue
        time.sleep(0.02)
    worker.join()
    assert answer == ["up\n"] and status is not None, "the program's process was not seen from the host"
    assert all(int(uid) != 0 for uid in status["Uid"].split()), status["Uid"]
    assert all(int(gid) != 0 for gid in status["Gid"].split()), status["Gid"]
    assert status["Groups"].strip() == ""
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[field], 16) == 0, (field, status[field])
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"


def test_remounts_new_mounts_namespaces_and_ptrace_are_refused():
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "calls = {'remount /usr rw': lambda: libc.mount(None, b'/usr', None, 0x20 | 0x1000, None),\n"
        "         'mount tmpfs': lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None),\n"
        "         'unshare user': lambda: libc.unshare(0x10000000),\n"
        "         'unshare mount': lambda: libc.unshare(0x00020000),\n"
        "         'ptrace attach 1': lambda: libc.ptrace(16, 1, None, None)}\n"
        "for name, call in calls.items():\n    print(name, call(), os.strerror(ctypes.get_errno()))"
    )
    lines = run_code(code).strip().splitlines()
    assert len(lines) == 5
    for line in lines:
        assert line.endswith("-1 Operation not permitted"), lines


def test_proc_sys_writes_are_refused_and_the_host_value_stays():
    path = "/proc/sys/kernel/printk_ratelimit"
    with open(path) as handle:
        before = handle.read()
    code = (
        f"try:\n    open({path!r}, 'w').write('17')\n    print('written')\n"
        "except OSError as err:\n    print('refused', err.strerror)"
    )
    assert run_code(code).startswith("refused")
    with open(path) as handle:
        assert handle.read() == before


def test_nothing_a_call_writes_reaches_the_host_or_the_next_call(tmp_path):
    site_packages = sysconfig.get_paths()["purelib"]
    payload = f"import os; open({str(tmp_path / 'ran')!r}, 'w')"
    targets = [os.path.join(site_packages, "rlframe_evil.pth"), "/usr/lib/rlframe_evil.pth", "/rlframe_evil"]
    code = (
        f"for path in {targets!r}:\n    try:\n        open(path, 'w').write({payload!r})\n"
        "        print('wrote', path)\n"
        "    except OSError as err:\n        print('refused', err.strerror)\n"
        "open('/tmp/left_behind.txt', 'w').write('x')\nprint(sorted(__import__('os').listdir('/tmp')))"
    )
    first = run_code(code).strip().splitlines()
    assert [line.split()[0] for line in first[:3]] == ["refused"] * 3, first
    assert "left_behind.txt" in first[3]
    second = run_code("import os\nprint(sorted(os.listdir('/tmp')), os.path.exists('/tmp/left_behind.txt'))")
    assert second.strip() == "['program.py'] False"
    assert not any(os.path.exists(path) for path in targets) and not (tmp_path / "ran").exists()


def test_the_environment_the_trainer_and_ray_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123456")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_value_123456")
    trainer = os.getpid()
    ray_home = os.path.expanduser("~/.ray")  # where Ray keeps the cluster's auth token
    paths = [f"/proc/{trainer}/environ", "/proc/1/environ", ray_home, "/tmp/ray", "/etc/passwd"]
    code = (
        "import json, os, signal\n"
        "found = {'environ': dict(os.environ), 'pids': sorted(p for p in os.listdir('/proc') if p.isdigit())}\n"
        f"for path in {paths!r}:\n"
        "    try:\n        found[path] = open(path, 'rb').read()[:20].decode(errors='replace')\n"
        "    except OSError as err:\n        found[path] = type(err).__name__\n"
        f"try:\n    os.kill({trainer}, signal.SIGKILL)\n    found['kill'] = 'sent'\n"
        "except OSError as err:\n    found['kill'] = type(err).__name__\n"
        "print(json.dumps(found))"
    )
    found = json.loads(run_code(code))
    assert "secret" not in json.dumps(found)
    assert set(found["environ"]) <= {"PATH", "HOME", "PWD", "LC_CTYPE"}, found["environ"]
    assert found["pids"] == ["1", "2"]  # bubblewrap's init and the program: nothing of the host
    assert found[f"/proc/{trainer}/environ"] == "FileNotFoundError"
    assert "HF_TOKEN" not in found["/proc/1/environ"]  # pid 1 is bubblewrap's own init, with the scrubbed environment
    assert found["kill"] == "ProcessLookupError"
    assert [found[path] for path in (ray_home, "/tmp/ray", "/etc/passwd")] == ["FileNotFoundError"] * 3


def test_memory_is_bounded_for_the_whole_tree_and_shared_memory_inside_disk_mb():
    require_cgroup("memory")
    tree = (
        "import subprocess, sys\n"
        "child = \"b = bytearray(200 * 2**20); import time; time.sleep(2); print('kept', flush=True)\"\n"
        "children = [subprocess.Popen([sys.executable, '-c', child]) for _ in range(4)]\n"
        "print([c.wait() for c in children], flush=True)"
    )
    text = run_code(tree, memory_mb=256, disk_mb=64)  # each child is under memory_mb; together they are not
    assert "used more memory than it may and was killed" in text and text.count("kept") < 4, text
    shm = (
        "import os\ntry:\n    for i in range(320):\n        with open(f'/dev/shm/f{i}', 'wb') as handle:\n"
        "            handle.write(b'x' * 2**20)\nexcept OSError as err:\n    print('stopped at', i, err.strerror)\n"
        "print(os.path.realpath('/dev/shm'))"
    )
    text = run_code(shm, disk_mb=8)
    assert "No space left on device" in text and int(text.split("stopped at ")[1].split()[0]) <= 8, text
    assert text.strip().endswith("/tmp")


def test_files_and_pipes_are_bounded():
    require_cgroup("memory")  # what bounds the number of files
    pipes = (
        "import os\nfds = []\ntry:\n    for _ in range(20000):\n        fds.append(os.pipe())\n"
        "except OSError as err:\n    print(len(fds), err.strerror)"
    )
    count, reason = run_code(pipes).split(maxsplit=1)
    assert int(count) < 200 and "Too many open files" in reason
    files = (
        "n = 0\ntry:\n    while n < 150000:\n        open(f'f{n}', 'w').close()\n        n += 1\n"
        "except OSError as err:\n    print('stopped', n, err.strerror)\nprint('made', n)"
    )
    text = run_code(files, memory_mb=64, disk_mb=8)
    assert "made 150000" not in text, text


def test_without_bubblewrap_the_default_refuses_naming_the_fix_and_none_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(isolation, "bwrap_path", lambda: None)
    sandbox.sandbox_problem.cache_clear()
    sandbox._warn_uncontained.cache_clear()
    try:
        for config in ({}, {"sandbox": "auto"}, {"sandbox": "bwrap"}):
            with pytest.raises(
                ValueError,
                match=r"cannot contain the program here: bubblewrap is not installed: `apt-get install bubblewrap`",
            ):
                PythonTool(config, None)
        with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
            assert PythonTool({"sandbox": "none"}, None).isolation.mode == "none"
            PythonTool({"sandbox": "none"}, None)
        warnings = [record.getMessage() for record in caplog.records if "sandbox: none" in record.getMessage()]
        assert len(warnings) == 1 and "network and processes in reach" in warnings[0], warnings
    finally:
        sandbox.sandbox_problem.cache_clear()


def _without_seccomp(argv: list[str]) -> list[str]:
    at = argv.index("--seccomp")
    return argv[:at] + argv[at + 2 :]


@pytest.mark.parametrize(
    "hole, named",
    [
        (_without_seccomp, r"runs without the seccomp filter \(seccomp='0'\)"),
        (lambda argv: [*argv, "--share-net"], r"shares a network with the host"),
    ],
    ids=["no-seccomp", "host-network"],
)
def test_a_self_check_that_finds_a_hole_refuses_the_tool_naming_it(monkeypatch, hole, named):
    real_args = isolation.bwrap_args
    monkeypatch.setattr(isolation, "bwrap_args", lambda *args: hole(real_args(*args)))
    sandbox.sandbox_problem.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"the self-check's program .*" + named):
            PythonTool({}, None)
    finally:
        sandbox.sandbox_problem.cache_clear()


def test_a_missing_sandbox_user_as_root_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(isolation.os, "geteuid", lambda: 0)
    with pytest.raises(
        ValueError, match=r"unprivileged user 'no_such_user_x', which does not exist; create it \(`useradd"
    ):
        PythonTool({"sandbox_user": "no_such_user_x"}, None)
    with pytest.raises(ValueError, match=r"sandbox_user='root' has uid 0, gid 0: it must not be root"):
        PythonTool({"sandbox_user": "root"}, None)
