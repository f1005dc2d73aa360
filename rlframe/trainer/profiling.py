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
    """`begin(step)` before a step's first generation, `end(step, is_last)` after the step is logged."""

    def __init__(self, global_cfg, worker_groups: list):
        self.steps = set(global_cfg.steps or []) if global_cfg.tool is not None else set()
        self.continuous = global_cfg.profile_continuous_steps
        self.groups = [group for group in worker_groups if group is not None]
        self.running = False

    def begin(self, step: int) -> None:
        if step in self.steps and not self.running:
            for group in self.groups:
                group.start_profile(step)
            self.running = True

    def end(self, step: int, is_last: bool) -> None:
        window_goes_on = self.continuous and step + 1 in self.steps and not is_last
        if self.running and not window_goes_on:
            for group in self.groups:
                group.stop_profile()
            self.running = False


def nsight_runtime_env(cfg) -> dict:
    """Ray's `nsight` runtime_env for the workers with tool=nsys and listed steps, else {} (verl's rule)."""
    profiler = cfg.global_profiler
    if profiler.tool != "nsys" or not profiler.steps:
        return {}
    options = OmegaConf.to_container(profiler.global_tool_config.nsys.worker_nsight_options)
    if options.get("capture-range-end") is None:  # verl: room for every capture range of the listed steps
        options["capture-range-end"] = f"repeat-shutdown:{6 * len(profiler.steps)}"
    return {"nsight": options}
