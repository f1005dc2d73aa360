"""rlframe.distributed.tensor_buckets: a named state cut into byte-bounded buckets and back, bit for bit."""

import pytest
import torch

from rlframe.distributed.tensor_buckets import ALIGN, pack, plan_buckets, unpack


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(7, 5, generator=g, dtype=torch.float32),
        "norm": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 3, generator=g).to(torch.float16),
        "nan_and_inf": torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.float64),
        "count": torch.tensor(17, dtype=torch.int64),  # 0-d
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(11, dtype=torch.int32).reshape(11, 1),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }


@pytest.mark.parametrize("bucket_bytes", [1, 40, 100, 10_000])
def test_a_state_of_mixed_dtypes_comes_back_bit_for_bit_in_its_order(bucket_bytes):
    state = mixed_state()
    buckets = plan_buckets(state.items(), bucket_bytes)
    out = [item for bucket in buckets for item in unpack(bucket, pack(bucket, state))]
    assert [name for name, _ in out] == list(state)
    for name, tensor in out:
        expected = state[name]
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
        # bit for bit: NaN payloads and -0.0 included
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8))


def test_buckets_stay_within_their_bound_unless_one_tensor_alone_is_larger():
    state = mixed_state()
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    bound = 64
    buckets = plan_buckets(state.items(), bound)
    assert len(buckets) > 1
    for bucket in buckets:
        assert bucket.nbytes <= bound or len(bucket.slots) == 1
        for slot in bucket.slots:
            assert slot.offset % ALIGN == 0 and slot.nbytes == sizes[slot.name]
        last = bucket.slots[-1]
        assert bucket.nbytes == last.offset + last.nbytes
    # one bucket when the bound holds everything; a bucket per tensor at a bound of one byte
    assert len(plan_buckets(state.items(), 10_000)) == 1
    assert [len(b.slots) for b in plan_buckets(state.items(), 1)] == [1] * len(state)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        plan_buckets(state.items(), 0)


def test_packing_a_tensor_that_does_not_match_the_layout_is_refused():
    state = mixed_state()
    bucket = plan_buckets(state.items(), 10_000)[0]
    with pytest.raises(ValueError, match=r"embed: torch.float16 \(7, 5\) does not match"):
        pack(bucket, {**state, "embed": state["embed"].half()})
