"""The end-to-end tests' shared fixture: one local Ray per module for the runs that go in this process."""

import logging
import os

import pytest


@pytest.fixture(scope="module")
def module_ray(cache_dir):
    """One local Ray this module's in-process runs (`helpers.runs.run_in_process`: the trainer joins it and leaves it
    running) train in, the driver and workers reading the built-in models and tasks from `cache_dir`. A run in this
    process skips a subprocess's Python, imports and Ray start, ~10 s each."""
    import ray

    from rlframe.single_controller.ray import init_ray
    from rlframe.trainer.launch import QUIET_WORKER_ENV
    from rlframe.workers.fsdp_workers import worker_env

    previous = os.environ.get("RLFRAME_CACHE")
    os.environ["RLFRAME_CACHE"] = str(cache_dir)
    env = {**worker_env(), **QUIET_WORKER_ENV, "RLFRAME_CACHE": str(cache_dir)}
    init_ray(num_cpus=4, runtime_env={"env_vars": env}, logging_level=logging.ERROR)
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RLFRAME_CACHE", None)
        else:
            os.environ["RLFRAME_CACHE"] = previous
