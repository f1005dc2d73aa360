"""`@register` and the dispatch modes: how one driver call becomes one call per worker.

A registered method is called once on the driver (`wg.compute_log_prob(data)`). Its dispatch
mode decides which ranks run it with which arguments (`plan_call`), and how their outputs
become the driver's return value (`CallPlan.collect`). Data-parallel modes use every worker's
`DpCoords`: peers in one tensor/sequence-parallel group share a dp rank, get the same shard,
and only the group's collector's output is kept.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

from rlframe.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

REGISTER_ATTR = "_rlframe_register"


class Dispatch(enum.Enum):
    """How arguments are split across workers and outputs gathered."""

    ONE_TO_ALL = "one_to_all"  # every rank gets the same args; returns the list of all outputs
    ALL_TO_ALL = "all_to_all"  # each arg is a list of world_size items, item i to rank i; list of outputs
    DP_COMPUTE = "dp_compute"  # each arg is a list of dp_size items, item d to dp rank d; collectors' outputs
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProtos split in dp_size chunks; outputs concatenated
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"  # same, first arg is a function sent to all
    DP_COMPUTE_METRIC = "dp_compute_metric"  # DataProtos split evenly; list of collectors' outputs
    RANK_ZERO = "rank_zero"  # every executing rank gets the same args; returns rank 0's output


class Execute(enum.Enum):
    """Which ranks run the method."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


DP_MODES = frozenset({Dispatch.DP_COMPUTE, Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_PROTO_WITH_FUNC,
                      Dispatch.DP_COMPUTE_METRIC})


@dataclass(frozen=True)
class RegisterSpec:
    dispatch_mode: Dispatch
    execute_mode: Execute
    blocking: bool


@dataclass(frozen=True)
class DpCoords:
    """Where a worker sits in data parallelism, as dispatch sees it."""

    dp_rank: int
    dp_size: int
    is_collector: bool  # whose output counts for this dp rank (one per TP/SP group)


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, execute_mode: Execute = Execute.ALL,
             blocking: bool = True):
    """Mark a Worker method as callable from the driver through a worker group.

    The method itself is unchanged (calling it inside the worker is a plain call); the worker
    group binds a driver-side method of the same name that fans out according to
    `dispatch_mode`. `blocking=False` makes the driver-side call return a `WorkerGroupFuture`.
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise ValueError(f"dispatch_mode must be a Dispatch member ({', '.join(d.name for d in Dispatch)}), "
                         f"got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise ValueError(f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}")
    if execute_mode is Execute.RANK_ZERO and dispatch_mode not in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        raise ValueError(f"Execute.RANK_ZERO runs one rank, which cannot take {dispatch_mode.name}'s per-rank "
                         f"shards; use Dispatch.ONE_TO_ALL or Dispatch.RANK_ZERO with it")
    spec = RegisterSpec(dispatch_mode, execute_mode, bool(blocking))

    def decorate(fn):
        setattr(fn, REGISTER_ATTR, spec)
        return fn

    return decorate


def registered_methods(cls: type) -> dict[str, RegisterSpec]:
    """Every `@register`-ed method of `cls` (inherited ones included), by name."""
    methods = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), REGISTER_ATTR, None)
        if isinstance(spec, RegisterSpec):
            methods[name] = spec
    return methods


# ---------------------------------------------------------------------------------- planning
@dataclass
class CallPlan:
    """What each executing rank receives, and how to turn their outputs into one result."""

    ranks: list[int]
    args: list[tuple]
    kwargs: list[dict]
    collect: Callable[[list], Any]  # outputs, in `ranks` order -> driver's return value
    outputs_are_copied: bool = False  # collect copies DataProto outputs, so they may stay zero-copy


def plan_call(spec: RegisterSpec, method: str, args: tuple, kwargs: dict, world_size: int,
              coords: list[DpCoords] | None = None) -> CallPlan:
    """Split one driver call into per-rank calls. Raises before anything is sent to a worker."""
    mode = spec.dispatch_mode
    ranks = [0] if spec.execute_mode is Execute.RANK_ZERO else list(range(world_size))
    if mode is Dispatch.ONE_TO_ALL:
        return CallPlan(ranks, [args] * len(ranks), [kwargs] * len(ranks), list)
    if mode is Dispatch.RANK_ZERO:
        return CallPlan(ranks, [args] * len(ranks), [kwargs] * len(ranks), lambda outputs: outputs[0])
    if mode is Dispatch.ALL_TO_ALL:
        _check_lists(method, mode, args, kwargs, world_size, f"world_size={world_size}")
        return CallPlan(ranks, [tuple(a[r] for a in args) for r in ranks],
                        [{k: v[r] for k, v in kwargs.items()} for r in ranks], list)

    dp_size, collectors = _check_coords(coords, world_size)
    dp_rank_of = [c.dp_rank for c in coords]
    if mode is Dispatch.DP_COMPUTE:
        _check_lists(method, mode, args, kwargs, dp_size, f"dp_size={dp_size} (world_size={world_size})")
        shard_args = [tuple(a[d] for a in args) for d in range(dp_size)]
        shard_kwargs = [{k: v[d] for k, v in kwargs.items()} for d in range(dp_size)]
        return _dp_plan(ranks, dp_rank_of, shard_args, shard_kwargs, _keep(collectors, list))

    func_args: tuple = ()
    if mode is Dispatch.DP_COMPUTE_PROTO_WITH_FUNC:
        if not args or not callable(args[0]):
            raise TypeError(f"{method}() is Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: its first argument must be "
                            f"a function, got {type(args[0]).__name__ if args else 'nothing'}")
        func_args, args = args[:1], args[1:]
    length = _check_protos(method, mode, args, kwargs)
    pad_size = 0
    if mode is Dispatch.DP_COMPUTE_METRIC:
        if length % dp_size:
            raise ValueError(f"{method}() is Dispatch.DP_COMPUTE_METRIC, which does not pad (duplicated samples "
                             f"would bias the metrics): {length} samples do not split over dp_size={dp_size}")
        collect = _keep(collectors, list)
    else:
        if length is not None:
            pad_size = (-length) % dp_size
        collect = _keep(collectors, lambda outputs: _concat_unpad(method, outputs, length, pad_size))
    shards = {name: _pad(value, dp_size).chunk(dp_size) for name, value in _named(args, kwargs)}
    shard_args = [func_args + tuple(shards[i][d] for i in range(len(args))) for d in range(dp_size)]
    shard_kwargs = [{k: shards[k][d] for k in kwargs} for d in range(dp_size)]
    plan = _dp_plan(ranks, dp_rank_of, shard_args, shard_kwargs, collect)
    plan.outputs_are_copied = mode is not Dispatch.DP_COMPUTE_METRIC
    return plan


def _dp_plan(ranks, dp_rank_of, shard_args, shard_kwargs, collect) -> CallPlan:
    # Peers with the same dp rank get the very same objects, so they are serialized once.
    return CallPlan(ranks, [shard_args[dp_rank_of[r]] for r in ranks],
                    [shard_kwargs[dp_rank_of[r]] for r in ranks], collect)


def _keep(collectors: list[int], then: Callable[[list], Any]) -> Callable[[list], Any]:
    """Keep the collectors' outputs, in dp-rank order, then apply `then`."""
    return lambda outputs: then([outputs[r] for r in collectors])


def _check_coords(coords: list[DpCoords] | None, world_size: int) -> tuple[int, list[int]]:
    """Validate the group's dp layout; return dp_size and the collector rank of each dp rank."""
    if coords is None or len(coords) != world_size:
        raise ValueError(f"data-parallel dispatch needs the dp coordinates of all {world_size} workers")
    sizes = sorted({c.dp_size for c in coords})
    layout = [(c.dp_rank, c.dp_size, c.is_collector) for c in coords]
    if len(sizes) != 1:
        raise ValueError(f"workers registered different dp sizes {sizes}; (dp_rank, dp_size, is_collector) "
                         f"by rank: {layout}")
    dp_size = sizes[0]
    collectors = [[r for r, c in enumerate(coords) if c.dp_rank == d and c.is_collector] for d in range(dp_size)]
    bad = [d for d, found in enumerate(collectors) if len(found) != 1]
    out_of_range = [r for r, c in enumerate(coords) if not 0 <= c.dp_rank < dp_size]
    if bad or out_of_range:
        raise ValueError(f"dp layout needs exactly one collector per dp rank 0..{dp_size - 1}; dp ranks "
                         f"{bad} break that (ranks out of range: {out_of_range}); (dp_rank, dp_size, "
                         f"is_collector) by rank: {layout}")
    return dp_size, [found[0] for found in collectors]


def _named(args: tuple, kwargs: dict):
    yield from enumerate(args)
    yield from kwargs.items()


def _describe(name) -> str:
    return f"positional argument {name}" if isinstance(name, int) else f"argument {name!r}"


def _check_lists(method, mode, args, kwargs, expected: int, what: str) -> None:
    for name, value in _named(args, kwargs):
        if not isinstance(value, (list, tuple)) or len(value) != expected:
            got = f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) \
                else f"a {type(value).__name__}"
            raise ValueError(f"{method}() is Dispatch.{mode.name}: {_describe(name)} must be a list with one "
                             f"item per shard, {expected} items for this group's {what}; got {got}")


def _check_protos(method, mode, args, kwargs) -> int | None:
    """Every argument must be a DataProto of one common length; return that length."""
    lengths = {}
    for name, value in _named(args, kwargs):
        if not isinstance(value, DataProto):
            raise TypeError(f"{method}() is Dispatch.{mode.name}: {_describe(name)} must be a DataProto "
                            f"(it is split across data-parallel ranks), got {type(value).__name__}")
        lengths[name] = len(value)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{method}() is Dispatch.{mode.name}: its DataProto arguments must have one length "
                         f"to be split alike, got lengths {lengths}")
    return next(iter(lengths.values()), None)


def _pad(data: DataProto, divisor: int) -> DataProto:
    return pad_dataproto_to_divisor(data, divisor)[0]


def _concat_unpad(method: str, outputs: list, length: int | None, pad_size: int):
    """Concatenate DataProto outputs in dp order and strip the dispatch padding."""
    if all(out is None for out in outputs):
        return None
    if not all(isinstance(out, DataProto) for out in outputs):
        kinds = sorted({type(out).__name__ for out in outputs})
        raise TypeError(f"{method}() is a DataProto dispatch: every collector must return a DataProto "
                        f"(or all None) to be concatenated, got {kinds}")
    merged = DataProto.concat(outputs)
    if pad_size == 0:
        return merged
    padded = length + pad_size
    if len(merged) % padded:
        raise ValueError(f"{method}() returned {len(merged)} samples for {padded} dispatched ({length} + "
                         f"{pad_size} padding); outputs must have one (or k) samples per input sample "
                         f"for the padding to be stripped")
    return unpad_dataproto(merged, pad_size * (len(merged) // padded))
