"""Runs code a policy wrote so that nothing it does outlives the call or reaches past its folder, even when the
trainer runs as root.

- `isolation.py`: the unprivileged user, bubblewrap's namespaces, the seccomp filter, the self-check's probe;
- `cgroups.py`: the run's pids and memory cgroups;
- `launcher.py`: the first process of a run (cgroups, binds for the user, rlimits, the drop, the exec);
- `run.py`: one run: its command, its capped output, its process tree killed on every exit path.

`resolve_isolation` decides once, when the tool is built, how its runs are isolated, and refuses (fails closed)
where the bubblewrap sandbox cannot be had, unless the operator chose `sandbox: none`. docs/multi_turn.md (Tools)
says what each layer contains and what `none` leaves open.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import tempfile

from rlframe.workers.rollout.sandbox import isolation
from rlframe.workers.rollout.sandbox.run import Isolation, SandboxLimits, SandboxResult, prepare, run_python

__all__ = ["SANDBOX_MODES", "Isolation", "SandboxLimits", "SandboxResult", "resolve_isolation", "run_python"]

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "bwrap", "none")
NOT_CONTAINED_WITHOUT_BWRAP = (
    "the program runs as the trainer's user ({user}) with its files, secrets, network and processes in reach; only "
    "rlimits, the timeout and the pids and memory cgroups (where they can be made) bound it"
)


def resolve_isolation(mode: str, user: str | None, where: str) -> Isolation:
    """How a tool's runs are isolated for a configured `sandbox` (`auto`, the default, and `bwrap`, its explicit
    name: bubblewrap, refused where its self-check fails; `none`: the launcher alone, with one warning) and
    `sandbox_user`."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"{where}: sandbox={mode!r} is not one of {list(SANDBOX_MODES)}")
    if mode == "none":
        if user is not None:
            raise ValueError(
                f"{where}: sandbox_user={user!r} is read only by the bubblewrap sandbox, not sandbox='none'"
            )
        _warn_uncontained()
        return Isolation("none")
    policy = Isolation("bwrap", isolation.sandbox_ids(user, where))
    problem = sandbox_problem(policy)
    if problem is not None:
        raise ValueError(
            f"{where}: sandbox={mode!r} cannot contain the program here: {problem}. The tool refuses to run "
            "uncontained; sandbox: none runs it without isolation (docs/multi_turn.md says what that leaves open)"
        )
    return policy


@functools.cache
def _warn_uncontained() -> None:
    user = "root: everything" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    logger.warning("PythonTool runs with sandbox: none: %s", NOT_CONTAINED_WITHOUT_BWRAP.format(user=user))


@functools.cache
def sandbox_problem(policy: Isolation) -> str | None:
    """Why the bubblewrap sandbox does not hold here (a missing piece, or what the self-check's probe could do), or
    None when every check passed. The probe runs through the same launch as a tool call (cgroups included), once
    per process."""
    missing = isolation.missing_piece()
    if missing is not None:
        return missing
    limits = SandboxLimits(timeout_s=30, memory_mb=512, max_output_bytes=2**16, max_processes=64)
    with tempfile.TemporaryDirectory(prefix="rlframe_sandbox_check_") as folder:
        launch = prepare(isolation.PROBE, folder, limits, policy)
        try:
            status, out, err = isolation.probe_subprocess(launch.command, launch.pass_fds)
        except (OSError, subprocess.TimeoutExpired) as failure:
            return f"the self-check could not run: {failure}"
        finally:
            launch.release()
    lines = out.strip().splitlines()
    if status != 0 or not lines:
        said = (err or out).strip()[-400:]
        fix = f" ({isolation.NAMESPACE_FIX})" if "namespace" in said.lower() else ""
        return f"the self-check failed (exit {status}): {said}{fix}"
    failures = isolation.probe_failures(lines[-1])
    return f"the self-check's program {'; '.join(failures)}" if failures else None
