"""The GPU tests' fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from helpers.gpu_models import smollm2_or_stand_in

    path, which = smollm2_or_stand_in(str(tmp_path_factory.mktemp("smollm2")))
    print(f"model: {which} ({path})")
    return path
