"""An engine's declaration: what the rest of rlframe may ask about a rollout engine without naming it.

Each engine module (`hf_rollout.py`, `vllm_rollout.py`, `sglang_rollout.py`) exports one `EngineSpec` and the
registry (`registry.py`) keys it by `(name, mode)`. Code outside the engines asks the declaration
(`engine_for(name, mode).capabilities.partial_rollout`), never compares `rollout.name` with an engine's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlframe.config.keys import ROLLOUT

# (rollout section, its dotted path, the root config) -> None, or {dotted key: why it has no effect}
SectionCheck = Callable[[Any, str, Any], None]
SectionInactive = Callable[[Any, str, Any], "dict[str, str]"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, as the worker, the trainer's checks and `rlframe explain` need to know it."""

    lora: str = "merged"  # a LoRA actor reaches it as "merged" weights, or as its "adapter" after the base once
    sleep: bool = True  # `release`/`resume` free and restore its memory around training (free_cache_engine)
    images: bool = True  # generates for vision-language rows (their images reach the engine)
    partial_rollout: bool = False  # a push cuts its running generation and its cut rows continue (partial rollout)
    tp_cut: bool = False  # a TP group stops at the same decoding step on every rank when cut (TP replicas on the pool)
    tensor_parallel: bool = True  # shards a replica over a TP group of consecutive ranks
    micro_batches: bool = False  # generates `rollout.micro_batch_size` sequences at a time (else: by tokens)
    pools_cpu_generation: bool = False  # on CPU without TP, one machine's ranks may generate on the first
    continuous_batching: bool = False  # its rollout server schedules requests as they come (mode=async)


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine: its name, modes, capabilities, `engine_kwargs` table, launch checks and constructor."""

    name: str  # the value of `actor_rollout_ref.rollout.name`
    build: Callable[..., Any]  # (rollout section, ServedModel, tokenizer, device_type, tp_group) -> BaseRollout
    capabilities: Capabilities = Capabilities()
    modes: tuple[str, ...] = ("async", "sync")  # rollout.mode values it runs under (async: agent loops)
    setting: str = ""  # how its own keys read when another engine runs ("a vLLM setting")
    # engine_kwargs.<name>: engine arguments rlframe sets itself -> what to use instead (refused when passed)
    owned_args: Mapping[str, str] = field(default_factory=dict)
    check: SectionCheck | None = None  # launch checks of the rollout section, before Ray starts
    inactive: SectionInactive | None = None  # rollout keys this engine does not read, with the reason
    check_machine: Callable[[Any], None] | None = None  # after the config checks: does the machine fit it?

    def check_engine_kwargs(self, engine_kwargs: dict) -> None:
        """Refuse arguments rlframe sets itself, naming what to use instead."""
        check_owned_args(self.name, self.owned_args, engine_kwargs)


def check_owned_args(engine: str, owned_args: Mapping[str, str], engine_kwargs: dict) -> None:
    """Refuse `engine_kwargs.<engine>` arguments that rlframe sets itself (`owned_args`), naming what to use."""
    owned = [name for name in engine_kwargs if name in owned_args]
    if owned:
        uses = "; ".join(f"{name}: use {owned_args[name]}" for name in owned)
        raise ValueError(
            f"rlframe sets {', '.join(owned)} itself and cannot take it from engine_kwargs ({uses}); "
            f"remove it from {ROLLOUT}.engine_kwargs.{engine}"
        )
