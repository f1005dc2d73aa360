"""Profiling the workers on chosen steps, with verl 0.9.1's keys: `global_profiler.*` and each role's `profiler.*`.

`global_profiler.tool` picks the tool and `global_profiler.steps` the global steps (1-based); a role
(`actor_rollout_ref.actor`, `.ref`, `critic`) takes part when its `profiler.enable` is true, on
`profiler.ranks` (all of them with `all_ranks`, rank 0 when neither is set). Per profiled step and rank:

- `torch`: a `torch.profiler` chrome trace, `SAVE_PATH/{role}_step{N}_rank{r}-of-{W}_pid{p}.json.gz`,
  covering the whole step (every worker call is a `record_function` range named after its stage);
  with the role's `tool_config.torch.discrete` one trace per stage instead
  (`{role}_{stage}_step{N}_...`). `tool_config.torch.contents` picks cuda, memory, shapes, stack (CPU
  activity is always recorded).
- `torch_memory`: on CUDA, the allocator's memory history (`torch.cuda.memory._record_memory_history`)
  dumped as `SAVE_PATH/step{N}/torch_memory_rank{r}_pid{p}.pickle` every `memory_snapshot_num_steps`
  profiled steps (`steps{a}-{b}/` for a window of several), for pytorch.org/memory_viz. torch keeps no
  allocator history on CPU: there the file is `torch_memory_rank{r}_pid{p}.json` with the process's
  resident memory at the window's start and end and its peak so far.
- `nsys`: the workers run under Nsight Systems (Ray's `nsight` runtime_env with
  `global_tool_config.nsys.worker_nsight_options`); a profiled step is one CUDA profiler capture range
  (one per stage with `nsys.discrete`), each stage an NVTX range.

torch.profiler, the memory history and the CUDA profiler are per process, and rlframe's roles share
the worker processes: when two roles of one process are profiled on a step, they share one trace,
named after both (`actor_rollout_ref+critic_step3_...`). The keys are declared in
`rlframe/workers/config/profiler.py`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import torch

from rlframe.single_controller import Dispatch, Worker, register


class ProfileSession:
    """The running step-long trace (torch) or capture range (nsys) of one worker process, shared by its roles.

    Owned by the worker process (`Worker.process_state`, one for the roles a ColocatedWorker hosts); the
    first role to start a profiled step opens it, the last one out writes it, named after every role in it.
    """

    def __init__(self):
        self.state: dict = {}  # {"roles": joined, "open": still in it, "step": first step, "trace": profile or None}

    def join(self, role: str, step: int, make_trace) -> None:
        """Start the process's trace (torch) or capture range (nsys), or join the one another role started."""
        if self.state:
            self.state["roles"].append(role)
            self.state["open"].add(role)
            return
        trace = make_trace() if make_trace is not None else None
        self.state.update(roles=[role], open={role}, step=step, trace=trace)
        if trace is not None:
            trace.start()
        else:
            torch.cuda.profiler.start()

    def leave(self, role: str, trace_path) -> None:
        """Leave the process's session; the last role out writes the trace (named after every role in it)."""
        if not self.state or role not in self.state["open"]:
            return
        self.state["open"].discard(role)
        if self.state["open"]:
            return
        session = dict(self.state)
        self.state.clear()
        if session["trace"] is not None:
            session["trace"].stop()
            session["trace"].export_chrome_trace(trace_path("+".join(session["roles"]), session["step"]))
        else:
            torch.cuda.profiler.stop()


class ProfiledWorker(Worker):
    """A worker whose roles profile on global_profiler.steps: the driver's `start_profile` / `stop_profile`.

    A role makes its profiler with `_profiler` (its `profiler` section and the name its traces carry); the
    worker needs `config.global_profiler` and `device_type`."""

    def __init__(self):
        super().__init__()
        self.profilers: list[Profiler] = []  # the roles' profilers of this worker

    def _profiler(self, role_cfg, role: str, stages_only: bool = False) -> Profiler:
        global_cfg = self.config.global_profiler
        session = self.process_state("profile_session", ProfileSession)  # the roles of this process share it
        profiler = Profiler(
            global_cfg, role_cfg, role, self.rank, self.world_size, self.device_type, stages_only, session
        )
        self.profilers.append(profiler)
        return profiler

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, step: int) -> None:
        """Global step `step` is profiled (global_profiler.steps): start where this rank's roles profile."""
        for profiler in self.profilers:
            profiler.start(step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> None:
        """The profiled step (or window) ended: write its traces or snapshots."""
        for profiler in reversed(self.profilers):
            profiler.stop()


class Profiler:
    """One role's profiler in one worker process (verl's DistProfiler): `start(step)`, `stage(name)`, `stop()`."""

    def __init__(
        self,
        global_cfg,
        role_cfg,
        role: str,
        rank: int,
        world_size: int,
        device_type: str,
        stages_only=False,
        session: ProfileSession | None = None,
    ):
        """`stages_only`: the role never opens the process's step-long trace, only its stages' own (discrete).
        `session`: the process's, shared by its roles (without it, the profiler's own)."""
        self.stages_only = stages_only
        self.session = session if session is not None else ProfileSession()
        selected = role_cfg is not None and role_cfg.enable
        selected = selected and (role_cfg.all_ranks or rank in (list(role_cfg.ranks) or [0]))
        self.tool = global_cfg.tool if selected else None
        self.role, self.rank, self.world_size, self.device_type = role, rank, world_size, device_type
        self.save_path = str(global_cfg.save_path)
        if self.tool is not None:
            self.torch_cfg = role_cfg.tool_config.torch
            self.memory_cfg = global_cfg.global_tool_config.torch_memory
            self.discrete = self.tool == "torch" and bool(self.torch_cfg.discrete)
            self.discrete |= self.tool == "nsys" and bool(global_cfg.global_tool_config.nsys.discrete)
        self.step = None  # the step being profiled, between start and stop
        self.window: list[int] = []  # torch_memory: profiled steps since the last snapshot
        self.rss_at_window_start = 0

    def start(self, step: int) -> None:
        """The trainer starts a profiled step (or a window of consecutive ones)."""
        if self.tool is None:
            return
        self.step = step
        if self.stages_only:
            return
        if self.tool == "torch_memory":
            self._start_memory_window(step)
        elif not self.discrete:
            self.session.join(self.role, step, self._torch_profile if self.tool == "torch" else None)

    def stop(self) -> None:
        """The trainer ends the profiled step (or window): write what was recorded."""
        if self.tool is None or self.step is None:
            return
        if self.tool == "torch_memory" and not self.stages_only:
            self._end_memory_window()
        elif not self.discrete and not self.stages_only:
            self.session.leave(self.role, self._trace_path)
        self.step = None

    @contextlib.contextmanager
    def stage(self, name: str):
        """One worker call: a named range in the step's trace, or its own trace / capture range (discrete)."""
        active = self.tool is not None and self.step is not None
        # a trace (torch) or capture range (nsys) of its own, unless another role's step-long one is running
        own = active and self.discrete and not self.session.state
        if own and self.tool == "torch":
            trace = self._torch_profile()
            trace.start()
        elif own:
            torch.cuda.profiler.start()
        nvtx = active and self.tool == "nsys"
        try:
            if nvtx:
                torch.cuda.nvtx.range_push(name)
            with torch.profiler.record_function(name):  # a named range in any running trace of the process
                yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()
            if own and self.tool == "torch":
                trace.stop()
                trace.export_chrome_trace(self._trace_path(f"{self.role}_{name}", self.step))
            elif own:
                torch.cuda.profiler.stop()

    # ------------------------------------------------------------------ torch
    def _torch_profile(self) -> torch.profiler.profile:
        contents = set(self.torch_cfg.contents)
        activities = [torch.profiler.ProfilerActivity.CPU]  # stage ranges are CPU events: always on
        if self.device_type == "cuda" and (not contents or "cuda" in contents):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities,
            record_shapes="shapes" in contents,
            profile_memory="memory" in contents,
            with_stack="stack" in contents,
        )

    def _trace_path(self, name: str, step: int) -> str:
        os.makedirs(self.save_path, exist_ok=True)
        file = f"{name}_step{step}_rank{self.rank}-of-{self.world_size}_pid{os.getpid()}.json.gz"
        return os.path.join(self.save_path, file)

    # ------------------------------------------------------------------ torch_memory
    def _start_memory_window(self, step: int) -> None:
        if not self.window:
            if self.device_type == "cuda":
                torch.cuda.memory._record_memory_history(
                    context=self.memory_cfg.context,
                    stacks=self.memory_cfg.stacks,
                    max_entries=int(self.memory_cfg.trace_alloc_max_entries),
                )
            self.rss_at_window_start = _proc_status_bytes("VmRSS")
        self.window.append(step)

    def _end_memory_window(self) -> None:
        if len(self.window) < int(self.memory_cfg.memory_snapshot_num_steps):
            return
        first, last = self.window[0], self.window[-1]
        folder = os.path.join(self.save_path, f"step{first}" if first == last else f"steps{first}-{last}")
        os.makedirs(folder, exist_ok=True)
        name = f"torch_memory_{self.role}_rank{self.rank}_pid{os.getpid()}"
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.memory._dump_snapshot(os.path.join(folder, name + ".pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            record = {
                "device": "cpu",
                "what": "torch keeps no allocator history on CPU: the worker process's resident memory instead",
                "steps": self.window,
                "rss_bytes_at_window_start": self.rss_at_window_start,
                "rss_bytes_at_window_end": _proc_status_bytes("VmRSS"),
                "peak_rss_bytes_of_process": _proc_status_bytes("VmHWM"),
            }
            with open(os.path.join(folder, name + ".json"), "w") as f:
                json.dump(record, f, indent=1)
        self.window = []


def _proc_status_bytes(field: str) -> int:
    """A memory field of this process from Linux's /proc/self/status (VmRSS: resident now, VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # the kernel reports kB


def profiled(stage: str, profiler: str = "profiler"):
    """Run a worker method as the stage `stage` of the role's profiler (the attribute `profiler` of the worker)."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            with getattr(self, profiler).stage(stage):
                return method(self, *args, **kwargs)

        return wrapper

    return decorate
