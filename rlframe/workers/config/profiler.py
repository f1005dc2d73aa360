"""The profiler's sections: `global_profiler.*` (tool, steps, tool settings) and each role's `profiler.*`.

What each tool records and where it writes is described in `rlframe/workers/profiler.py`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any

from rlframe.config.checks import planned_device
from rlframe.config.schema import Section, each_of, key, section

TOOLS = ("torch", "torch_memory", "nsys")
TORCH_CONTENTS = ("cuda", "cpu", "memory", "shapes", "stack")
NSIGHT_OPTIONS = {  # verl 0.9.1's worker_nsight_options
    "trace": "cuda,nvtx,cublas,ucx",
    "cuda-memory-usage": "true",
    "cuda-graph-trace": "graph",
    "capture-range": "cudaProfilerApi",
    "capture-range-end": None,
    "kill": "none",
}


def _check_tool(tool: str | None) -> None:
    if tool == "npu":
        raise ValueError(
            "Ascend NPU profiling needs Ascend NPUs and torch_npu, which rlframe does not run on (trainer.device "
            "is auto, cpu or cuda); profile with tool=torch, torch_memory or nsys"
        )
    if tool == "precision_debugger":
        raise ValueError("msprobe's precision debugger (Ascend) is not implemented; profile with tool=torch")
    if tool is not None and tool not in TOOLS:
        raise ValueError(f"not a profiling tool; choose null, {', '.join(TOOLS)}")


def _check_steps(steps: list[int] | None) -> None:
    if steps is not None and any(step < 1 for step in steps):
        raise ValueError("steps are global steps, counted from 1")


@dataclass
class NsysToolConfig(Section):
    discrete: bool = key(False, "one capture range per stage (worker call) instead of one per profiled step")
    worker_nsight_options: dict[str, Any] = key(NSIGHT_OPTIONS, "nsys profile options of every worker process")


@dataclass
class TorchMemoryToolConfig(Section):
    trace_alloc_max_entries: int = key(100000, "allocation events the memory history keeps (CUDA)")
    memory_snapshot_num_steps: int = key(1, "profiled steps per snapshot")
    context: str = key("all", "memory history events: state | alloc | all (CUDA)", choices=("state", "alloc", "all"))
    stacks: str = key("all", "stacks recorded with each event: python | all (CUDA)", choices=("python", "all"))


@dataclass
class GlobalToolConfig(Section):
    nsys: NsysToolConfig = section(NsysToolConfig)
    torch_memory: TorchMemoryToolConfig = section(TorchMemoryToolConfig)


@dataclass
class GlobalProfilerConfig(Section):
    tool: str | None = key(None, "null (off) | torch | torch_memory | nsys (docs/profiling.md)", check=_check_tool)
    steps: list[int] | None = key(None, "global steps to profile, from 1 (null = none)", check=_check_steps)
    profile_continuous_steps: bool = key(
        False, "consecutive listed steps form one window (one trace) instead of one each"
    )
    save_path: str = key("outputs/profile", "folder of the traces and snapshots")
    global_tool_config: GlobalToolConfig = section(GlobalToolConfig)

    def check(self, path: str, root: Any) -> None:
        if self.tool == "nsys" and shutil.which("nsys") is None:
            raise ValueError(
                f"{path}.tool=nsys: nsys is not installed (not on PATH); install NVIDIA Nsight Systems on every "
                "node, or use tool=torch"
            )
        if self.tool == "nsys" and planned_device(root.trainer.device) != "cuda":
            raise ValueError(f"{path}.tool=nsys captures CUDA profiler ranges; the device here is cpu: use tool=torch")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if self.tool is None:
            return {
                f"{path}.{name}": f"{path}.tool=null"
                for name in ("steps", "profile_continuous_steps", "save_path", "global_tool_config")
            }
        out = {}
        if not self.steps:
            out[f"{path}.tool"] = f"{path}.steps lists no step"
        for name in ("nsys", "torch_memory"):
            if self.tool != name:
                out[f"{path}.global_tool_config.{name}"] = f"{path}.tool={self.tool}"
        return out


@dataclass
class TorchToolConfig(Section):
    contents: list[str] = key(
        [],
        "what a torch trace records besides CPU ops: cuda, memory, shapes, stack ([] = cuda)",
        check=each_of(TORCH_CONTENTS),
    )
    discrete: bool = key(False, "one trace per stage (worker call) instead of one per profiled step")


@dataclass
class RoleToolConfig(Section):
    torch: TorchToolConfig = section(TorchToolConfig)


@dataclass
class RoleProfilerConfig(Section):
    enable: bool = key(False, "profile this role on global_profiler.steps")
    all_ranks: bool = key(False, "profile every rank")
    ranks: list[int] = key([], "ranks to profile; [] and all_ranks=false: rank 0")
    tool_config: RoleToolConfig = section(RoleToolConfig)

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        tool = root.global_profiler.tool
        if tool is None or not self.enable:
            if tool is None:
                return {path: "global_profiler.tool=null"}
            return {f"{path}.{name}": f"{path}.enable=false" for name in ("all_ranks", "ranks", "tool_config")}
        out = {f"{path}.tool_config.torch": f"global_profiler.tool={tool}"} if tool != "torch" else {}
        if self.all_ranks:
            out[f"{path}.ranks"] = f"{path}.all_ranks=true"
        return out


@dataclass
class RolloutProfilerConfig(RoleProfilerConfig):
    # verl's defaults: the actor's choice (the rollout pool of separate_async reads them; colocated, the actor's do)
    enable: bool = key("${actor_rollout_ref.actor.profiler.enable}", "profile the rollout pool (default: the actor's)")
    all_ranks: bool = key("${actor_rollout_ref.actor.profiler.all_ranks}", "profile every rank of the rollout pool")
    ranks: list[int] = key(
        "${actor_rollout_ref.actor.profiler.ranks}", "rollout pool ranks to profile; [] and all_ranks=false: rank 0"
    )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if root.trainer.v1.trainer_mode == "separate_async":  # the rollout pool's processes profile with these
            return super().inactive(path, root)
        # verl colocated does the same: the hybrid worker profiles with the actor's settings
        return {path: "the rollout runs in the actor's worker processes: actor_rollout_ref.actor.profiler profiles it"}
