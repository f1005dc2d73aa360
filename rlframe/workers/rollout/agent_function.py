"""Loading the agent function of `agent.default_agent_loop=openai_agent` from the user's file."""

from __future__ import annotations

import importlib.util
import inspect
import os

KEY = "actor_rollout_ref.rollout.agent.openai_agent"


def load_agent(path: str, name: str):
    """The agent function `name` of the Python file `path` (an `async def`)."""
    full_path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full_path):
        raise FileNotFoundError(f"{KEY}.path={path!r}: no such file ({full_path})")
    module_name = f"rlframe_openai_agent_{abs(hash(full_path)):x}"
    spec = importlib.util.spec_from_file_location(module_name, full_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, str(name), None)
    if not inspect.iscoroutinefunction(function):
        defined = sorted(n for n, v in vars(module).items() if inspect.iscoroutinefunction(v))
        raise ValueError(
            f"{KEY}.name={name!r} is not an async function in {full_path}; async functions there: {defined or 'none'}"
        )
    return function
