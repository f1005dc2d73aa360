"""The rollout engines, keyed like verl's `(name, mode)`: `register` one, `engine_for` the one a config names.

The built-in engines are registered by the package (`rollout/__init__.py`, one line each), so they are known as soon
as any rollout module is imported; an engine is one module exporting an `EngineSpec` (`spec.py`) and one `register`
line (docs/rollout.md, "Adding an engine"). This module imports no engine, so the config can ask it. The config's
choices for `actor_rollout_ref.rollout.name` are the registered names.
"""

from __future__ import annotations

from rlframe.config.keys import ROLLOUT
from rlframe.workers.rollout.spec import EngineSpec

_ENGINES: dict[tuple[str, str], EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    """Make `spec` the engine of `(spec.name, mode)` for each of its modes (a later registration replaces it)."""
    for mode in spec.modes:
        _ENGINES[(spec.name, mode)] = spec
    return spec


def unregister(name: str) -> None:
    """Forget every mode of engine `name` (tests that register a toy engine clean up with it)."""
    for key in [key for key in _ENGINES if key[0] == name]:
        del _ENGINES[key]


def engine_names() -> tuple[str, ...]:
    """The registered engine names, in registration order."""
    return tuple(dict.fromkeys(name for name, _ in _ENGINES))


def check_rollout_name(name: str) -> None:
    """Raise a ValueError listing the valid engines when `name` is not one of them."""
    if name not in engine_names():
        raise ValueError(f"{ROLLOUT}.name={name!r} is not a rollout engine; choose one of {', '.join(engine_names())}")


def find_engine(name: str) -> EngineSpec | None:
    """The declaration of engine `name` in any mode (what it can do does not depend on the mode), else None."""
    return next((spec for (known, _), spec in _ENGINES.items() if known == name), None)


def engine_for(name: str, mode: str = "async") -> EngineSpec:
    """The declaration of engine `name` under `rollout.mode=mode`; a ValueError naming the choices otherwise."""
    check_rollout_name(name)
    if (name, mode) not in _ENGINES:
        modes = [known_mode for known, known_mode in _ENGINES if known == name]
        raise ValueError(f"{ROLLOUT}.name={name} runs under {ROLLOUT}.mode {' or '.join(modes)}, not {mode!r}")
    return _ENGINES[(name, mode)]
