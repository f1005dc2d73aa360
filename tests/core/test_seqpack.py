"""Sequence balancing: partition properties, capacity packing, micro-batching and its DP agreement."""

import heapq
import logging
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers.world import spawned_world
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlframe.seqpack import (
    calculate_workload,
    ffd_allocate,
    get_allocate_fn,
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    karmarkar_karp,
    kk_allocate,
    packing_metrics,
    rearrange_micro_batches,
)

FAST = settings(max_examples=60, deadline=None)
lengths = st.lists(st.integers(0, 3000), min_size=1, max_size=120)


def spread(values, groups):
    sums = [sum(values[i] for i in group) for group in groups]
    return max(sums) - min(sums)


def assert_partition(groups, num_items):
    flat = [i for group in groups for i in group]
    assert sorted(flat) == list(range(num_items)), "every index exactly once"
    assert all(type(i) is int for i in flat), "indices are plain Python ints"


def reference_ldm_sums(values, k, equal_size):
    """One-merge-at-a-time largest differencing with the module's tie rules; sorted final sums."""
    xs = sorted(values, reverse=True)
    heap, rows = [], {}
    if equal_size:
        for r in range(len(xs) // k):
            rows[r] = xs[r * k : (r + 1) * k]
            heap.append((rows[r][-1] - rows[r][0], -rows[r][0], 0, r))
    else:  # a singleton [x, 0, ...] loses ties to rows; among singletons, sorted order
        heap = [(-x, -x, 1, pos) for pos, x in enumerate(xs)]
        rows = {("s", pos): [x] + [0] * (k - 1) for pos, x in enumerate(xs)}
    heapq.heapify(heap)
    num_rows = len(rows) if equal_size else 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        row_a = rows.pop(("s", a[3]) if a[2] else a[3])
        row_b = rows.pop(("s", b[3]) if b[2] else b[3])
        merged = sorted((p + q for p, q in zip(row_a, reversed(row_b))), reverse=True)
        if a[2] and b[2]:
            row_id, num_rows = num_rows, num_rows + 1
        else:
            row_id = b[3] if a[2] else a[3]
        rows[row_id] = merged
        heapq.heappush(heap, (merged[-1] - merged[0], -merged[0], 0, row_id))
    return sorted(next(iter(rows.values())))


# ─────────────────────────────── Karmarkar–Karp ───────────────────────────────


@FAST
@given(values=lengths, k=st.integers(1, 9), equal_size=st.booleans())
def test_karmarkar_karp_is_a_partition(values, k, equal_size):
    if equal_size:
        values = values[: len(values) // k * k]
    groups = karmarkar_karp(values, k, equal_size)
    assert len(groups) == k
    assert_partition(groups, len(values))
    assert sum(values[i] for g in groups for i in g) == sum(values)
    if equal_size:
        assert all(len(g) == len(values) // k for g in groups)
    assert groups == karmarkar_karp(list(values), k, equal_size), "deterministic"
    assert all(g == sorted(g) for g in groups)


@pytest.mark.parametrize("equal_size", [False, True])
@pytest.mark.parametrize("k", [2, 3, 8])
def test_karmarkar_karp_matches_sequential_differencing(equal_size, k):
    rng = np.random.default_rng(k)
    for trial in range(25):
        n = k * int(rng.integers(1, 30))
        values = rng.integers(0, [5, 3000, 10**6][trial % 3], n).tolist()
        groups = karmarkar_karp(values, k, equal_size)
        sums = sorted(sum(values[i] for i in g) for g in groups)
        assert sums == reference_ldm_sums(values, k, equal_size)


def test_karmarkar_karp_balances_bimodal_lengths_to_the_token():
    rng = np.random.default_rng(0)
    is_long = rng.random(4096) < 0.3
    values = np.where(is_long, rng.integers(800, 2049, 4096), rng.integers(50, 201, 4096))
    for k, equal_size in [(16, True), (16, False)]:
        assert spread(values, karmarkar_karp(values, k, equal_size)) <= 2


def test_karmarkar_karp_accepts_tensors_and_floats():
    assert karmarkar_karp(torch.tensor([5, 1, 4, 2]), 2, True) == karmarkar_karp([5, 1, 4, 2], 2, True)
    groups = karmarkar_karp([0.5, 2.25, 1.75, 1.0], 2, False)
    assert spread([0.5, 2.25, 1.75, 1.0], groups) == 0.0  # {2.25, 0.5} and {1.75, 1.0}


def test_karmarkar_karp_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of k_partitions"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="non-negative"):
        karmarkar_karp([1, -2], 2, equal_size=False)
    with pytest.raises(ValueError, match="k_partitions"):
        karmarkar_karp([1, 2], 0, equal_size=False)


def test_karmarkar_karp_with_more_partitions_than_items_leaves_some_empty():
    groups = karmarkar_karp([3, 1], 4, equal_size=False)
    assert sorted(map(len, groups)) == [0, 0, 1, 1]


@FAST
@given(values=lengths, k=st.integers(1, 9), equal_size=st.booleans())
def test_balanced_partitions_are_non_empty_and_never_worse_than_kk(values, k, equal_size):
    if equal_size:
        values = values[: len(values) // k * k]
    if len(values) < k:
        with pytest.raises(ValueError, match="non-empty"):
            get_seqlen_balanced_partitions(values, k, equal_size)
        return
    groups = get_seqlen_balanced_partitions(values, k, equal_size)
    assert_partition(groups, len(values))
    assert all(groups), "no empty partition"
    if equal_size:
        assert all(len(g) == len(values) // k for g in groups)
    assert spread(values, groups) <= spread(values, karmarkar_karp(values, k, equal_size))


def test_balanced_partitions_fix_heavy_tailed_equal_size_weights():
    # Attention workloads are heavy-tailed; plain differencing leaves thousands of units of spread.
    rng = np.random.default_rng(0)
    values = (rng.lognormal(6, 1, 1024)).astype(np.int64) + 1
    raw = spread(values, karmarkar_karp(values, 32, True))
    polished = spread(values, get_seqlen_balanced_partitions(values, 32, True))
    assert raw > 1000 and polished <= 2


def test_calculate_workload_scales_linear_term_with_hidden_size():
    lengths_ = torch.tensor([1, 100, 4096])
    expected = [12 * 1024 * s + s * s for s in (1, 100, 4096)]
    assert calculate_workload(lengths_, hidden_size=1024).tolist() == expected
    assert isinstance(calculate_workload([1, 2]), np.ndarray)
    # A small model is more attention-bound: long sequences weigh relatively more.
    small, large = calculate_workload([512, 8192], 896), calculate_workload([512, 8192], 8192)
    assert small[1] / small[0] > large[1] / large[0]


# ─────────────────────────────── capacity allocation ───────────────────────────────


allocation_cases = st.tuples(
    st.lists(st.integers(0, 1000), min_size=1, max_size=80),
    st.integers(1000, 4000),  # capacity >= any single item
    st.integers(0, 6),
    st.integers(1, 4),
)


@FAST
@given(case=allocation_cases, name=st.sampled_from(["kk", "ffd"]))
def test_allocation_respects_capacity_min_groups_and_divisor(case, name):
    values, capacity, min_groups, divisor = case
    allocate = get_allocate_fn(name)
    needed = -(-max(min_groups, 1) // divisor) * divisor
    if needed > len(values):
        with pytest.raises(ValueError, match="non-empty groups"):
            allocate(values, capacity, min_groups, divisor)
        return
    try:
        groups = allocate(values, capacity, min_groups, divisor)
    except ValueError as error:  # indivisible items can need more groups than there are items
        assert "non-empty groups" in str(error)
        return
    assert_partition(groups, len(values))
    assert all(groups)
    assert len(groups) >= max(min_groups, 1) and len(groups) % divisor == 0
    assert all(sum(values[i] for i in g) <= capacity for g in groups)
    assert allocate(values, capacity, min_groups, divisor) == groups, "deterministic"


@FAST
@given(values=st.lists(st.integers(1, 4096), min_size=4, max_size=60), k=st.integers(2, 8))
def test_kk_allocate_is_never_less_balanced_than_ffd(values, k):
    if len(values) < k:
        return
    kk, ffd = kk_allocate(values, 10**9, k), ffd_allocate(values, 10**9, k)
    assert len(kk) == len(ffd) == k
    assert spread(values, kk) <= spread(values, ffd)


def test_kk_allocate_equal_size_picks_a_group_count_dividing_the_items():
    groups = kk_allocate([100] * 12, capacity=350, min_groups=1, equal_size=True)
    assert len(groups) == 4 and {len(g) for g in groups} == {3}  # ceil(1200/350)=4 divides 12


def test_kk_allocate_falls_back_to_ffd_when_a_group_overflows(caplog):
    with caplog.at_level(logging.WARNING, logger="rlframe.seqpack"):
        groups = kk_allocate([6, 6, 6], capacity=10, min_groups=1)
    assert "falling back" in caplog.text
    assert len(groups) == 3 and all(sum(6 for _ in g) <= 10 for g in groups)


def test_ffd_puts_each_item_in_the_least_loaded_group_that_fits():
    assert ffd_allocate([5, 4, 3, 3], capacity=8, min_groups=2) == [[0, 3], [1, 2]]
    assert ffd_allocate([6, 6, 2], capacity=8, min_groups=1) == [[0, 2], [1]]
    assert ffd_allocate([7, 7, 2], capacity=8, min_groups=1) == [[0], [1], [2]]


def test_allocation_rejects_an_item_over_capacity():
    with pytest.raises(ValueError, match="exceeds the capacity"):
        ffd_allocate([5, 11], capacity=10, min_groups=1)


def test_get_allocate_fn_lists_the_valid_names():
    assert get_allocate_fn("kk") is kk_allocate and get_allocate_fn("ffd") is ffd_allocate
    with pytest.raises(ValueError, match="kk, ffd"):
        get_allocate_fn("greedy")


# ─────────────────────────────── micro-batching ───────────────────────────────


def make_batch(seqlens, width=None):
    width = width or max(seqlens)
    mask = torch.zeros(len(seqlens), width, dtype=torch.int64)
    for row, length in enumerate(seqlens):
        mask[row, width - length :] = 1  # left padding, as prompts have
    return TensorDict({"attention_mask": mask, "row": torch.arange(len(seqlens))}, batch_size=[len(seqlens)])


@pytest.mark.parametrize("packing_algorithm", ["kk", "ffd"])
def test_rearrange_micro_batches_respects_budget_and_restores_order(packing_algorithm):
    rng = np.random.default_rng(1)
    seqlens = rng.integers(1, 512, 37).tolist()
    batch = make_batch(seqlens)
    micro_batches, index_lists = rearrange_micro_batches(batch, 1024, packing_algorithm=packing_algorithm)
    assert len(micro_batches) >= math.ceil(sum(seqlens) / 1024)
    assert all(mb["attention_mask"].sum() <= 1024 and len(mb) > 0 for mb in micro_batches)
    for mb, idx in zip(micro_batches, index_lists):
        assert mb["row"].tolist() == idx
    outputs = torch.cat([mb["row"] * 10 for mb in micro_batches])
    restored = outputs[get_reverse_idx(index_lists)]
    assert restored.tolist() == [10 * i for i in range(len(seqlens))]


def test_rearrange_micro_batches_uses_the_token_lower_bound_when_it_fits():
    micro_batches, index_lists = rearrange_micro_batches(make_batch([300] * 8 + [100] * 8), 1000)
    assert len(micro_batches) == 4  # ceil(3200 / 1000)
    assert sorted(sum(300 if i < 8 else 100 for i in idx) for idx in index_lists) == [800, 800, 800, 800]


def test_rearrange_micro_batches_min_count_and_divisor():
    batch = make_batch([10] * 12)
    assert len(rearrange_micro_batches(batch, 1000, min_num_micro_batch=3)[0]) == 3
    assert len(rearrange_micro_batches(batch, 1000, min_num_micro_batch=3, num_batches_divided_by=2)[0]) == 4


def test_rearrange_micro_batches_too_long_sequence_names_numbers_and_key():
    with pytest.raises(ValueError) as error:
        rearrange_micro_batches(make_batch([100, 700]), 512, config_key="critic.ppo_max_token_len_per_gpu")
    assert "700" in str(error.value) and "512" in str(error.value)
    assert "critic.ppo_max_token_len_per_gpu" in str(error.value)


def test_rearrange_micro_batches_more_micro_batches_than_sequences_is_an_error():
    with pytest.raises(ValueError, match="only 2 sequences"):
        rearrange_micro_batches(make_batch([5, 5]), 100, min_num_micro_batch=3)


def _skewed_ranks_worker(rank: int) -> list[int]:
    # Rank 0 holds short sequences (1 micro-batch alone), rank 1 long ones (5 alone).
    seqlens = [20] * 8 if rank == 0 else [400, 380, 350, 300, 300, 250, 200, 180]
    micro_batches, _ = rearrange_micro_batches(make_batch(seqlens), 512, dp_group=dist.group.WORLD)
    assert all(mb["attention_mask"].sum() <= 512 for mb in micro_batches)
    counts = [None, None]
    dist.all_gather_object(counts, len(micro_batches))
    return counts


@pytest.mark.slow
def test_dynamic_bsz_same_micro_count_on_skewed_ranks():
    counts = spawned_world(2).run(_skewed_ranks_worker, timeout=60)[0]
    assert counts[0] == counts[1] >= 5


# ─────────────────────────────── reverse index, metrics, config ───────────────────────────────


@FAST
@given(perm=st.permutations(list(range(30))))
def test_reverse_idx_round_trips(perm):
    reverse = get_reverse_idx(perm)
    assert [perm[i] for i in reverse] == list(range(30))
    data = torch.arange(30) * 3
    assert data[perm][reverse].tolist() == data.tolist()


def test_reverse_idx_rejects_non_permutations():
    with pytest.raises(ValueError, match="permutation"):
        get_reverse_idx([0, 0, 2])


def test_packing_metrics_hand_checked():
    metrics = packing_metrics([6, 8, 10], capacity=10)
    assert metrics["spread"] == 4 and metrics["mean"] == 8
    assert metrics["imbalance_ratio"] == pytest.approx(0.5)
    assert metrics["std"] == pytest.approx(math.sqrt(8 / 3))
    assert metrics["cv"] == pytest.approx(math.sqrt(8 / 3) / 8)
    assert metrics["max_over_mean"] == pytest.approx(1.25)
    assert metrics["utilization"] == pytest.approx(0.8) and metrics["wasted_tokens"] == 6
    assert "utilization" not in packing_metrics([1, 1])
    assert packing_metrics([0, 0])["imbalance_ratio"] == 0.0
