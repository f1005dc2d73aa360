"""rlframe.models.weight_check: which tensors count as non-finite, and how they are named."""

from __future__ import annotations

import pytest
import torch

from rlframe.models.weight_check import first_non_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_value_is_found_and_counted(dtype, value):
    bad = torch.zeros(3, 5, dtype=dtype)
    bad[2, 4] = value
    tensors = [("ids", torch.arange(4)), ("empty", torch.empty(0, dtype=dtype)), ("ok", torch.ones(7)), ("w", bad)]
    assert first_non_finite(tensors) == ("w", 1, 15)


def test_large_finite_values_and_integer_tensors_pass():
    tensors = [
        (str(dtype), torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, 0.0], dtype=dtype))
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ]
    assert first_non_finite([*tensors, ("ids", torch.arange(9))]) is None
