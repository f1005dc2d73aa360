"""The end-to-end tests' shared fixture: one local Ray per module for the runs that go in this process."""

import pytest
from helpers.runs import local_ray


@pytest.fixture(scope="module")
def module_ray(cache_dir):
    """One local Ray this module's in-process runs (`helpers.runs.run_in_process`) train in."""
    with local_ray(cache_dir):
        yield
