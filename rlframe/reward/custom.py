"""Load a user's scoring function from `custom_reward_function.path` / `.name`."""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable


def load_custom_reward_function(path: str | None, name: str = "compute_score") -> Callable | None:
    """The function `name` defined in the python file `path`; None when `path` is None.

    With the naive manager it is called per sample as `fn(data_source=, solution_str=, ground_truth=,
    extra_info=)`; with the batch manager once per batch as `fn(data_sources=, solution_strs=,
    ground_truths=, extra_infos=)`. It returns a float or a dict with a "score" key (or a list of them).
    """
    if path is None:
        return None
    if str(path) == "builtin://math_verify":  # rlframe's math-verify scorer (rlframe/reward/math_verify.py)
        if str(name) != "compute_score":
            raise ValueError(f"custom_reward_function.name={name!r}: builtin://math_verify provides compute_score only")
        from rlframe.reward.math_verify import compute_score

        return compute_score
    full_path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full_path):
        raise FileNotFoundError(
            f"custom_reward_function.path={path!r}: no such file ({full_path}; "
            f"relative paths are resolved from the working directory {os.getcwd()})"
        )
    # Not registered in sys.modules on purpose: a function from an unregistered module is pickled by
    # value (cloudpickle), so Ray workers can call it without the file being importable there.
    module_name = f"rlframe_custom_reward_{abs(hash(full_path)):x}"
    spec = importlib.util.spec_from_file_location(module_name, full_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # errors inside the user's file surface with their own traceback
    fn = getattr(module, str(name), None)
    if fn is None or not callable(fn):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        raise ValueError(
            f"custom_reward_function.name={name!r} is not a function in {full_path}; "
            f"functions defined there: {defined or 'none'}"
        )
    return fn
