"""The driver's side of profiling: which global steps are profiled, and the calls that start and stop them.

As verl 0.9.1's trainer: a step in `global_profiler.steps` is profiled from its first generation to the
end of its validation and checkpoint; with `profile_continuous_steps` a run of consecutive listed steps
is one window (started on its first step, stopped after its last). The workers decide per role and rank
whether they take part (`rlframe.workers.profiler`). With `tool=nsys` the workers are started under
Nsight Systems (`nsight_runtime_env`).
"""

from __future__ import annotations

from omegaconf import OmegaConf


class StepProfiler:
    """`begin(step)` before a step's first generation, `end(step, is_last)` after the step is logged, `close()` once
    the loop is done.

    `queued_groups` (separate_async's rollout pool; under colocate_async the training processes) generate while the
    driver goes on: their start and stop are queued behind the calls already sent to them instead of waited for, so a
    profiled window covers their calls sent between its begin and its end (with η = 0 exactly the step's generation),
    and `close` waits for the last stop (the traces are written then)."""

    def __init__(self, global_cfg, worker_groups: list, queued_groups: list = ()):
        self.steps = set(global_cfg.steps or []) if global_cfg.tool is not None else set()
        self.continuous = global_cfg.profile_continuous_steps
        self.groups = [group for group in worker_groups if group is not None]
        self.queued_groups = [group for group in queued_groups if group is not None]
        self.queued_calls: list = []  # PendingCalls of the queued starts and stops not yet waited for
        self.running = False

    def begin(self, step: int) -> None:
        if step in self.steps and not self.running:
            for group in self.groups:
                group.start_profile(step)
            self.queued_calls += [group.submit("start_profile", step) for group in self.queued_groups]
            self.running = True

    def end(self, step: int, is_last: bool) -> None:
        window_goes_on = self.continuous and step + 1 in self.steps and not is_last
        if self.running and not window_goes_on:
            for group in self.groups:
                group.stop_profile()
            self.queued_calls += [group.submit("stop_profile") for group in self.queued_groups]
            self.running = False

    def close(self) -> None:
        """Wait for the queued groups' starts and stops (a failure surfaces here)."""
        calls, self.queued_calls = self.queued_calls, []
        for call in calls:
            call.result()


def nsight_runtime_env(cfg) -> dict:
    """Ray's `nsight` runtime_env for the workers with tool=nsys and listed steps, else {} (verl's rule)."""
    profiler = cfg.global_profiler
    if profiler.tool != "nsys" or not profiler.steps:
        return {}
    options = OmegaConf.to_container(profiler.global_tool_config.nsys.worker_nsight_options)
    if options.get("capture-range-end") is None:  # verl: room for every capture range of the listed steps
        options["capture-range-end"] = f"repeat-shutdown:{6 * len(profiler.steps)}"
    return {"nsight": options}
