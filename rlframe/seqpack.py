"""Sequence balancing: Karmarkar–Karp and FFD partitioning, micro-batch packing, balance metrics.

Two users: the driver balances a whole batch across DP ranks (`get_seqlen_balanced_partitions`
with `equal_size=True`), and every worker cuts its share into micro-batches under a token budget
(`rearrange_micro_batches`, free-size groups). Both rest on `karmarkar_karp`, the largest
differencing method (Korf, "Multi-Way Number Partitioning", IJCAI 2009), implemented here over
numpy rows instead of Python objects; see docs/seqpack.md for the algorithm and the numbers.
"""

from __future__ import annotations

import heapq
import logging
import math
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# what errors name when the caller does not pass its config key (the workers always pass their role's)
DEFAULT_TOKEN_LEN_KEY = "max_token_len"


# ───────────────────────────── Karmarkar–Karp (largest differencing) ─────────────────────────────


def karmarkar_karp(seqlen_list, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split the indices of `seqlen_list` into `k_partitions` groups with near-equal weight sums.

    Partitions come heaviest first, each a sorted list of Python ints. With `equal_size=True`
    every partition holds exactly `n / k_partitions` items. The same input always gives the same
    output (ties are broken by index).
    """
    return _groups_from_labels(_kk_labels(_as_weights(seqlen_list), k_partitions, equal_size), k_partitions)


def _kk_labels(weights: np.ndarray, k_partitions: int, equal_size: bool) -> np.ndarray:
    """Karmarkar–Karp partition label of every item (0 = heaviest partition)."""
    num_items = len(weights)
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be >= 1, got {k_partitions}")
    if equal_size and num_items % k_partitions:
        raise ValueError(
            f"equal_size=True needs the item count ({num_items}) to be a multiple of k_partitions ({k_partitions})"
        )
    order = _argsort_descending(weights)
    labels = np.empty(num_items, dtype=np.int64)
    labels[order] = _largest_differencing(weights[order], k_partitions, equal_size)
    return labels


def _largest_differencing(xs: np.ndarray, k: int, equal_size: bool) -> np.ndarray:
    """Run largest differencing on weights sorted descending; return each position's partition.

    A partial solution is a row of k subset sums kept in descending order, plus an id per subset.
    The two states with the largest spread (max - min) are merged first, pairing the heaviest
    subsets of one with the lightest of the other. Free-size items enter as singletons (spread =
    weight) streamed in sorted order rather than materialised as rows. A merge records which
    subset each absorbed subset joined (`parents`); assignments are resolved once at the end.
    """
    n = len(xs)
    if k == 1 or n <= 1:
        return np.zeros(n, dtype=np.int64)
    parents = _SubsetParents(n)  # subset ids: item positions, then virtual ids for empty subsets
    if equal_size:  # rows of k consecutive sorted items; no singletons
        sums = xs.reshape(n // k, k).copy()
        ids = np.arange(n, dtype=np.int64).reshape(n // k, k)
        heap = list(zip((sums[:, -1] - sums[:, 0]).tolist(), (-sums[:, 0]).tolist(), range(n // k)))
        heapq.heapify(heap)
        next_single = n
    else:
        sums = np.zeros((n // 2 + 1, k), dtype=xs.dtype)
        ids = np.empty((n // 2 + 1, k), dtype=np.int64)
        heap, next_single = [], 0
    # Heap entries are (-spread, -max, row); a row beats a singleton of weight x iff spread >= x.
    num_rows = len(heap)
    weights = xs.tolist()

    def push(row: int) -> None:
        top, bottom = sums[row, 0].item(), sums[row, -1].item()
        heapq.heappush(heap, (bottom - top, -top, row))

    while next_single < n and (heap or next_single + 1 < n):
        x = weights[next_single]
        best_spread = -heap[0][0] if heap else -math.inf
        if len(heap) >= 2 and -min(heap[1:3])[0] >= x:  # the two best states are rows
            first, second = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
            heapq.heappush(heap, (*_merge_rows(sums, ids, parents.array, first, second), first))
        elif heap and (best_spread >= x or next_single + 1 == n or weights[next_single + 1] <= best_spread):
            row = heapq.heappop(heap)[2]  # the best row and singleton x: x joins its lightest subset
            _add_to_lightest(sums[row], ids[row], x, next_single, parents.array)
            next_single += 1
            push(row)
        else:
            # Two singletons open a new row, and the following singletons fill its empty subsets
            # for as long as each one beats every other row (the new row itself stays the best).
            row, num_rows = num_rows, num_rows + 1
            end = min(next_single + k, n)
            fill = next_single + 2 + int(np.count_nonzero(xs[next_single + 2 : end] > best_spread))
            width = fill - next_single
            sums[row, :width] = xs[next_single:fill]
            ids[row, :width] = np.arange(next_single, fill)
            ids[row, width:] = parents.new_ids(k - width)
            next_single = fill
            push(row)
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        heapq.heappush(heap, (*_merge_rows(sums, ids, parents.array, first, second), first))

    root_of = parents.resolve()
    label_of_id = np.full(len(root_of), -1, dtype=np.int64)
    label_of_id[ids[heap[0][2]]] = np.arange(k)
    return label_of_id[root_of[:n]]


def _merge_rows(sums, ids, parent, first: int, second: int) -> tuple:
    """Merge row `second` into row `first`, heaviest subsets with lightest; return the heap key."""
    merged = sums[first] + sums[second, ::-1]
    order = merged.argsort(kind="stable")[::-1]
    first_ids = ids[first]
    parent[ids[second, ::-1]] = first_ids
    sums[first] = merged = merged[order]
    ids[first] = first_ids[order]
    top, bottom = merged[:: len(merged) - 1].tolist()  # k >= 2 here
    return bottom - top, -top


def _add_to_lightest(row_sums: np.ndarray, row_ids: np.ndarray, weight, item: int, parent) -> None:
    """Put a singleton into a row's lightest subset, then move that subset up to keep the order."""
    new_sum = row_sums[-1] + weight
    subset = row_ids[-1]
    parent[item] = subset
    # Insert before equal sums, so that repeated zero weights spread over the empty subsets.
    pos = int(np.count_nonzero(row_sums[:-1] > new_sum))
    row_sums[pos + 1 :] = row_sums[pos:-1]
    row_ids[pos + 1 :] = row_ids[pos:-1]
    row_sums[pos] = new_sum
    row_ids[pos] = subset


class _SubsetParents:
    """Parent pointer per subset id: item positions first, then virtual ids for empty subsets."""

    def __init__(self, num_items: int) -> None:
        self.array = np.arange(num_items, dtype=np.int64)
        self.size = num_items

    def new_ids(self, count: int) -> np.ndarray:
        if self.size + count > len(self.array):
            grown = np.arange(2 * (self.size + count), dtype=np.int64)
            grown[: self.size] = self.array[: self.size]
            self.array = grown
        self.size += count
        return np.arange(self.size - count, self.size)

    def resolve(self) -> np.ndarray:
        """Root of every id, by pointer jumping (a logarithmic number of passes)."""
        root = self.array[: self.size]
        while True:
            jumped = root[root]
            if np.array_equal(jumped, root):
                return root
            root = jumped


def _argsort_descending(values: np.ndarray) -> np.ndarray:
    """Stable descending argsort (equal weights keep index order); radix sort for small integers."""
    if values.dtype.kind == "i" and len(values):
        flipped = values.max() - values  # ascending key, still stable on ties
        if flipped.max() < 2**16:  # typical token counts: numpy radix-sorts 16-bit keys in O(n)
            return np.argsort(flipped.astype(np.uint16), kind="stable")
        return np.argsort(flipped, kind="stable")
    return np.argsort(-values, kind="stable")


def _groups_from_labels(labels: np.ndarray, num_groups: int) -> list[list[int]]:
    """Turn a partition label per item into sorted index lists, one per label."""
    key = labels.astype(np.uint16) if num_groups <= 2**16 else labels  # radix sort when it fits
    flat = np.argsort(key, kind="stable").tolist()
    bounds = np.cumsum(np.bincount(labels, minlength=num_groups)).tolist()
    return [flat[start:end] for start, end in zip([0] + bounds[:-1], bounds)]


def _as_weights(values) -> np.ndarray:
    """Validate weights into a 1-D int64 (integers) or float64 array."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"weights must be a flat sequence, got shape {arr.shape}")
    if arr.dtype.kind in "biu":
        arr = arr.astype(np.int64, copy=False)
    elif arr.dtype.kind == "f" or arr.size == 0:
        arr = arr.astype(np.float64, copy=False)
        if not np.isfinite(arr).all():
            raise ValueError("weights must be finite")
    else:
        raise ValueError(f"weights must be numbers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"weights must be non-negative, got {arr.min()}")
    return arr


def get_seqlen_balanced_partitions(
    seqlen_list, k_partitions: int, equal_size: bool, max_exchanges: int = 256
) -> list[list[int]]:
    """Balanced, non-empty partitions of the given weights (lengths, or `calculate_workload` costs).

    Karmarkar–Karp, then an exchange polish that never raises the spread (at most
    `max_exchanges` steps, which bounds it to a few milliseconds). Each partition is a sorted
    list of indices.
    """
    weights = _as_weights(seqlen_list)
    if len(weights) < k_partitions:
        raise ValueError(f"cannot fill {k_partitions} non-empty partitions from {len(weights)} items")
    labels = _kk_labels(weights, k_partitions, equal_size)
    _fill_empty_groups(labels, weights, k_partitions)
    _polish(labels, weights, k_partitions, allow_moves=not equal_size, max_exchanges=max_exchanges)
    return _groups_from_labels(labels, k_partitions)


def _fill_empty_groups(labels: np.ndarray, weights: np.ndarray, num_groups: int) -> None:
    """Give each empty group the lightest item of the most populous group (in place).

    With at least as many items as groups only zero weights can leave a group empty (a subset of
    zero-weight items and an empty subset look alike to the differencing), so the moved item
    weighs nothing and no sum changes.
    """
    counts = np.bincount(labels, minlength=num_groups)
    for group in np.flatnonzero(counts == 0).tolist():
        donor = int(counts.argmax())
        candidates = np.flatnonzero(labels == donor)
        labels[candidates[weights[candidates].argmin()]] = group
        counts[donor] -= 1
        counts[group] = 1


def _polish(labels: np.ndarray, weights: np.ndarray, num_groups: int, allow_moves: bool, max_exchanges: int) -> None:
    """Move or swap items out of the heaviest group towards lighter ones (updates `labels`).

    Differencing leaves little to gain on typical lengths but can stall on heavy-tailed weights
    with equal counts (attention workloads). Each step shifts a weight 0 < δ < (heavy - light)
    from the heaviest group to a lighter one, as close to half the gap as possible, so the spread
    never grows and the sum of squared sums strictly falls. Swaps keep item counts; moves
    (free-size only) never empty a group.
    """
    integral = weights.dtype.kind == "i"
    sums = np.bincount(labels, weights=weights, minlength=num_groups)
    if integral:
        sums = sums.astype(np.int64)  # exact: float64 sums are exact below 2**53
    floor = int(sums.sum() % num_groups != 0) if integral else 0  # the spread of a perfect split
    if num_groups < 2 or sums.max() - sums.min() <= floor:
        return
    by_weight = np.argsort(weights, kind="stable")
    grouped = by_weight[np.argsort(labels[by_weight], kind="stable")]  # by group, light to heavy
    bounds = np.cumsum(np.bincount(labels, minlength=num_groups))[:-1]
    items = np.split(grouped, bounds)
    item_weights = [weights[group] for group in items]
    for _ in range(max_exchanges):
        heavy = int(sums.argmax())
        if sums[heavy] - sums.min() <= floor:
            break
        exchange = _find_exchange(sums, item_weights, heavy, allow_moves)
        if exchange is None:
            break
        light, i, j = exchange
        heavy_items, light_items = items[heavy].copy(), items[light].copy()
        if j is None:  # move item i to the light group
            light_items = np.append(light_items, heavy_items[i])
            heavy_items = np.delete(heavy_items, i)
        else:  # swap item i with the light group's item j
            heavy_items[i], light_items[j] = light_items[j], heavy_items[i]
        for group, group_items in ((heavy, heavy_items), (light, light_items)):
            group_items = group_items[np.argsort(weights[group_items], kind="stable")]
            items[group], item_weights[group] = group_items, weights[group_items]
            labels[group_items] = group
            sums[group] = item_weights[group].sum()


def _find_exchange(sums: np.ndarray, item_weights: list, heavy: int, allow_moves: bool):
    """The first lighter group, lightest first, that has an improving exchange with `heavy`."""
    lightest = int(sums.argmin())  # usually enough; sort the rest only when it is not
    gap = sums[heavy] - sums[lightest]
    exchange = _best_exchange(item_weights[heavy], item_weights[lightest], gap, allow_moves)
    if exchange is not None:
        return lightest, *exchange
    for light in np.argsort(sums, kind="stable").tolist()[1:]:
        gap = sums[heavy] - sums[light]
        if gap <= 0:
            return None
        exchange = _best_exchange(item_weights[heavy], item_weights[light], gap, allow_moves)
        if exchange is not None:
            return light, *exchange
    return None


def _best_exchange(heavy_weights: np.ndarray, light_weights: np.ndarray, gap, allow_moves: bool):
    """Best (i, j) swap, or (i, None) move, shifting 0 < δ < gap closest to gap / 2; else None."""
    half = gap / 2
    best_score, best = math.inf, None
    num_light = len(light_weights)
    if num_light:
        # For each heavy item the light partners nearest to (weight - half) are the best swaps.
        nearest = np.searchsorted(light_weights, heavy_weights - half)
        partners = np.stack([np.maximum(nearest - 1, 0), np.minimum(nearest, num_light - 1)], axis=1)
        delta = heavy_weights[:, None] - light_weights[partners]
        score = np.where((delta > 0) & (delta < gap), np.abs(delta - half), math.inf)
        flat = int(score.argmin())
        if score.flat[flat] < best_score:
            best_score, best = score.flat[flat], (flat // 2, int(partners.flat[flat]))
    if allow_moves and len(heavy_weights) > 1:
        nearest = int(np.searchsorted(heavy_weights, half))
        for i in (nearest - 1, nearest):
            if 0 <= i < len(heavy_weights) and 0 < heavy_weights[i] < gap:
                if abs(heavy_weights[i] - half) < best_score:
                    best_score, best = abs(heavy_weights[i] - half), (i, None)
    return best


def calculate_workload(seqlens, hidden_size: int = 4096):
    """Relative forward cost of each sequence: dense matmuls (∝ h·s) plus causal attention (∝ s²).

    Per layer and token the dense matmuls cost about 24·h² FLOPs (12·h² weights, 2 FLOPs each) and
    causal attention about 2·h·s (QKᵀ and AV over half the keys on average), so a sequence costs
    2·h·(12·h·s + s²) FLOPs; the common factor is dropped. Pass the model's `config.hidden_size`:
    the linear term then scales with the model instead of being tuned for one size (4096 ≈ 7B).
    Returns int64, as a tensor for tensor input and a numpy array otherwise.
    """
    if isinstance(seqlens, torch.Tensor):
        lengths = seqlens.to(torch.int64)
        return 12 * hidden_size * lengths + lengths * lengths
    lengths = np.asarray(seqlens, dtype=np.int64)
    return 12 * hidden_size * lengths + lengths * lengths


def balance_dp_partitions(seqlens, k_partitions: int, hidden_size: int = 4096) -> list[list[int]]:
    """The driver's `_balance_batch`: equal-count Karmarkar–Karp over attention-aware workloads."""
    workloads = calculate_workload(np.asarray(seqlens, dtype=np.int64), hidden_size=hidden_size)
    return get_seqlen_balanced_partitions(workloads.tolist(), k_partitions, equal_size=True)


# ─────────────────────────────── capacity-bounded group allocation ───────────────────────────────


def ffd_allocate(values, capacity, min_groups: int, n_groups_divisor: int = 1) -> list[list[int]]:
    """First-fit decreasing: heaviest first into the least-loaded group that fits, else a new group.

    Opens at least `min_groups` groups, and a multiple of `n_groups_divisor`; no group's sum
    exceeds `capacity` and none is empty. Groups hold sorted indices.
    """
    weights = _as_weights(values)
    _check_allocation_args(weights, capacity, min_groups, n_groups_divisor)
    num_groups = _round_up(max(min_groups, 1), n_groups_divisor) if len(weights) else 0
    while True:
        _check_enough_items(len(weights), num_groups)
        groups = _least_loaded_fit(weights, capacity, num_groups)
        if len(groups) % n_groups_divisor == 0:
            return groups
        num_groups = _round_up(len(groups), n_groups_divisor)


def _least_loaded_fit(weights: np.ndarray, capacity, num_groups: int) -> list[list[int]]:
    """FFD pass that starts with `num_groups` empty groups and opens more when nothing fits."""
    # Heap of (load, item count, group): an empty group is filled before a zero-load non-empty one.
    heap = [(0, 0, g) for g in range(num_groups)]
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    order = _argsort_descending(weights)
    for item, weight in zip(order.tolist(), weights[order].tolist()):
        load, count, g = heap[0]
        if load + weight <= capacity:  # the least-loaded group is the likeliest to fit
            heapq.heapreplace(heap, (load + weight, count + 1, g))
        else:
            g = len(groups)
            groups.append([])
            heapq.heappush(heap, (weight, 1, g))
        groups[g].append(item)
    return [sorted(group) for group in groups]


def kk_allocate(values, capacity, min_groups: int, n_groups_divisor: int = 1, equal_size: bool = False):
    """Karmarkar–Karp into k = max(min_groups, ceil(total / capacity)) groups (a divisor multiple).

    If a balanced group still exceeds `capacity` (items are indivisible), logs a warning and falls
    back to `ffd_allocate`, so no group ever exceeds it. With `equal_size=True`, k is raised to the
    next count that also divides the number of items; the FFD fallback cannot keep equal counts.
    """
    weights = _as_weights(values)
    _check_allocation_args(weights, capacity, min_groups, n_groups_divisor)
    num_items = len(weights)
    if num_items == 0:
        return []
    num_groups = _round_up(max(min_groups, _ceil_div(weights.sum().item(), capacity), 1), n_groups_divisor)
    if equal_size:
        while num_groups <= num_items and num_items % num_groups:
            num_groups += n_groups_divisor
    _check_enough_items(num_items, num_groups)
    groups = get_seqlen_balanced_partitions(weights, num_groups, equal_size)
    if not equal_size:
        # Differencing plus local exchanges still loses to plain greedy on a few percent of tiny
        # inputs (10-30 items); greedy is cheap there, so never return the worse of the two.
        greedy = _least_loaded_fit(weights, capacity, num_groups)
        greedy_spread = np.ptp(_group_sums(weights, greedy))
        if len(greedy) == num_groups and greedy_spread < np.ptp(_group_sums(weights, groups)):
            groups = greedy
    heaviest = _group_sums(weights, groups).max().item()
    if heaviest > capacity:
        logger.warning(
            "Karmarkar-Karp put %s into one of %d groups, over the capacity %s; falling back to "
            "first-fit decreasing (more groups%s).",
            heaviest,
            num_groups,
            capacity,
            ", unequal item counts" if equal_size else "",
        )
        return ffd_allocate(weights, capacity, num_groups, n_groups_divisor)
    return groups


ALLOCATE_FNS = {"kk": kk_allocate, "ffd": ffd_allocate}


def get_allocate_fn(name: str):
    """The allocator called `name`: "kk" (Karmarkar–Karp) or "ffd" (first-fit decreasing)."""
    if name not in ALLOCATE_FNS:
        raise ValueError(f"unknown packing algorithm {name!r}; valid names: {', '.join(ALLOCATE_FNS)}")
    return ALLOCATE_FNS[name]


def _check_allocation_args(weights: np.ndarray, capacity, min_groups: int, n_groups_divisor: int) -> None:
    if not capacity > 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if n_groups_divisor < 1:
        raise ValueError(f"n_groups_divisor must be >= 1, got {n_groups_divisor}")
    if min_groups < 0:
        raise ValueError(f"min_groups must be >= 0, got {min_groups}")
    if len(weights) and weights.max() > capacity:
        raise ValueError(f"an item of weight {weights.max()} exceeds the capacity {capacity} on its own")


def _group_sums(weights: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    return np.array([weights[group].sum() for group in groups])


def _check_enough_items(num_items: int, num_groups: int) -> None:
    if num_groups > num_items:
        raise ValueError(f"cannot fill {num_groups} non-empty groups from {num_items} items")


def _ceil_div(numerator, denominator) -> int:
    if isinstance(numerator, int) and isinstance(denominator, int):
        return -(-numerator // denominator)  # exact for large token counts
    return math.ceil(numerator / denominator)


def _round_up(value: int, multiple: int) -> int:
    return _ceil_div(value, multiple) * multiple


# ─────────────────────────────────── dynamic micro-batching ───────────────────────────────────


def rearrange_micro_batches(
    batch,
    max_token_len: int,
    dp_group=None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    num_batches_divided_by: int | None = None,
    packing_algorithm: str = "kk",
    config_key: str = DEFAULT_TOKEN_LEN_KEY,
):
    """Cut a TensorDict with `attention_mask` [bsz, seqlen] into micro-batches of <= max_token_len tokens.

    The count starts at ceil(total tokens / max_token_len) (at least `min_num_micro_batch`), is
    made equal on every rank of `dp_group` (all-reduce MAX: unequal counts deadlock FSDP) and a
    multiple of `num_batches_divided_by`, and grows only if indivisible sequences do not fit.
    Returns (micro_batches, index_lists); `get_reverse_idx` of the concatenated index lists
    restores the caller's order. `config_key` names the setting to raise in error messages.
    """
    seqlens = batch["attention_mask"].sum(dim=-1).to(torch.int64).cpu().numpy()
    num_seqs = len(seqlens)
    longest = int(seqlens.max()) if num_seqs else 0
    num_micro = max(_ceil_div(int(seqlens.sum()), max_token_len), min_num_micro_batch or 1)
    sync = dp_group is not None and same_micro_num_in_dp
    fewest_seqs = num_seqs
    if sync:  # agree on everything a rank could raise on, so that no rank is left waiting
        num_micro, longest, fewest_seqs = _all_reduce_max([num_micro, longest, -num_seqs], dp_group)
        fewest_seqs = -fewest_seqs
    if longest > max_token_len:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds max_token_len={max_token_len}; raise {config_key} "
            f"so that the per-micro-batch budget is at least {longest} tokens"
        )
    divisor = num_batches_divided_by or 1
    num_micro = _round_up(num_micro, divisor)
    allocate = get_allocate_fn(packing_algorithm)
    while True:
        if num_micro > fewest_seqs:
            raise ValueError(
                f"{num_micro} micro-batches are needed (max_token_len={max_token_len}, "
                f"min_num_micro_batch={min_num_micro_batch}, "
                f"num_batches_divided_by={num_batches_divided_by}, "
                f"max over the DP group), but a rank holds only {fewest_seqs} sequences and every "
                f"micro-batch must be non-empty"
            )
        groups = allocate(seqlens, max_token_len, min_groups=num_micro, n_groups_divisor=divisor)
        if not sync:
            break
        # A capacity fallback may open extra groups on some rank: repeat until every rank agrees.
        most_groups = _all_reduce_max([len(groups)], dp_group)[0]
        if most_groups == num_micro:
            break
        num_micro = most_groups
    micro_batches = [batch[torch.as_tensor(group, dtype=torch.long)] for group in groups]
    return micro_batches, groups


def _all_reduce_max(values: list[int], group) -> list[int]:
    """Element-wise MAX of small integers over `group` (CUDA tensors for NCCL, CPU otherwise)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def get_reverse_idx(index) -> list[int]:
    """Inverse permutation: `out[index[i]] = i`, so `reordered[out]` is back in the original order.

    `index` is a permutation of 0..n-1, or the index lists of `rearrange_micro_batches` (flattened).
    """
    if len(index) and isinstance(index[0], (list, tuple)):
        index = list(chain.from_iterable(index))
    perm = np.asarray(index, dtype=np.int64).reshape(-1)
    if not np.array_equal(np.sort(perm), np.arange(len(perm))):
        raise ValueError(f"index must be a permutation of 0..{len(perm) - 1}")
    reverse = np.empty(len(perm), dtype=np.int64)
    reverse[perm] = np.arange(len(perm))
    return reverse.tolist()


def packing_metrics(group_loads, capacity=None) -> dict:
    """Balance of per-group loads: spread, imbalance ratio, std, cv, max/mean (+ fill vs capacity)."""
    loads = np.asarray(group_loads, dtype=np.float64)
    if loads.size == 0:
        raise ValueError("packing_metrics needs at least one group load")
    mean = loads.mean()
    spread = loads.max() - loads.min()
    std = loads.std()

    def ratio(value) -> float:  # relative to the mean; all-zero loads count as balanced
        return float(value / mean) if mean > 0 else 0.0

    metrics = {
        "num_groups": int(loads.size),
        "min": float(loads.min()),
        "max": float(loads.max()),
        "mean": float(mean),
        "spread": float(spread),
        "imbalance_ratio": ratio(spread),
        "std": float(std),
        "cv": ratio(std),
        "max_over_mean": ratio(loads.max()),
    }
    if capacity is not None:
        budget = capacity * loads.size
        metrics["utilization"] = float(loads.sum() / budget)
        metrics["wasted_tokens"] = float(budget - loads.sum())
    return metrics
