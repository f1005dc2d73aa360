"""`@register` and the dispatch modes: how one driver call becomes one call per worker.

A registered method is called once on the driver (`wg.compute_log_prob(data)`). Its dispatch
mode decides which ranks run it with which arguments (`plan_call`), and how their outputs
become the driver's return value (`CallPlan.collect`). Data-parallel dispatch gives every
worker its own `1 / world_size` of the batch; tensor/sequence-parallel peers that need the same
data all-gather their shares inside the worker (docs/single_controller.md says why).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlframe.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

REGISTER_ATTR = "_rlframe_register"


class Dispatch(enum.Enum):
    """How arguments are split across workers and outputs gathered."""

    ONE_TO_ALL = "one_to_all"  # every rank gets the same args; returns the list of all outputs
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProtos split in world_size chunks; outputs concatenated
    RANK_ZERO = "rank_zero"  # every executing rank gets the same args; returns rank 0's output


class Execute(enum.Enum):
    """Which ranks run the method."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class RegisterSpec:
    dispatch_mode: Dispatch
    execute_mode: Execute


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, execute_mode: Execute = Execute.ALL):
    """Mark a Worker method as callable from the driver through a worker group.

    The method itself is unchanged (calling it inside the worker is a plain call); the worker
    group binds a driver-side method of the same name that fans out according to
    `dispatch_mode` and blocks until every executing rank has answered.
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise ValueError(
            f"dispatch_mode must be a Dispatch member ({', '.join(d.name for d in Dispatch)}), got {dispatch_mode!r}"
        )
    if not isinstance(execute_mode, Execute):
        raise ValueError(f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}")
    if execute_mode is Execute.RANK_ZERO and dispatch_mode is Dispatch.DP_COMPUTE_PROTO:
        raise ValueError(
            "Execute.RANK_ZERO runs one rank, which cannot take DP_COMPUTE_PROTO's per-rank "
            "shards; use Dispatch.ONE_TO_ALL or Dispatch.RANK_ZERO with it"
        )
    spec = RegisterSpec(dispatch_mode, execute_mode)

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


def plan_call(spec: RegisterSpec, method: str, args: tuple, kwargs: dict, world_size: int) -> CallPlan:
    """Split one driver call into per-rank calls. Raises before anything is sent to a worker."""
    ranks = [0] if spec.execute_mode is Execute.RANK_ZERO else list(range(world_size))
    if spec.dispatch_mode is Dispatch.ONE_TO_ALL:
        return CallPlan(ranks, [args] * len(ranks), [kwargs] * len(ranks), list)
    if spec.dispatch_mode is Dispatch.RANK_ZERO:
        return CallPlan(ranks, [args] * len(ranks), [kwargs] * len(ranks), lambda outputs: outputs[0])
    return _plan_dp_compute_proto(method, args, kwargs, world_size)


def _plan_dp_compute_proto(method: str, args: tuple, kwargs: dict, world_size: int) -> CallPlan:
    """Pad the DataProtos to a multiple of world_size, chunk r to rank r; concatenate, unpad."""
    length = _check_protos(method, args, kwargs)
    # Equal chunks keep every rank at the same number of micro-batches, so collectives stay in step.
    pad_size = 0 if length is None else (-length) % world_size
    shards = {
        name: pad_dataproto_to_divisor(value, world_size)[0].chunk(world_size) for name, value in _named(args, kwargs)
    }
    return CallPlan(
        ranks=list(range(world_size)),
        args=[tuple(shards[i][r] for i in range(len(args))) for r in range(world_size)],
        kwargs=[{k: shards[k][r] for k in kwargs} for r in range(world_size)],
        collect=lambda outputs: _concat_unpad(method, outputs, length, pad_size),
        outputs_are_copied=True,
    )


def _named(args: tuple, kwargs: dict):
    yield from enumerate(args)
    yield from kwargs.items()


def _describe(name) -> str:
    return f"positional argument {name}" if isinstance(name, int) else f"argument {name!r}"


def _check_protos(method: str, args: tuple, kwargs: dict) -> int | None:
    """Every argument must be a DataProto of one common length; return that length."""
    lengths = {}
    for name, value in _named(args, kwargs):
        if not isinstance(value, DataProto):
            raise TypeError(
                f"{method}() is Dispatch.DP_COMPUTE_PROTO: {_describe(name)} must be a DataProto "
                f"(it is split across data-parallel ranks), got {type(value).__name__}"
            )
        lengths[name] = len(value)
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"{method}() is Dispatch.DP_COMPUTE_PROTO: its DataProto arguments must have one "
            f"length to be split alike, got lengths {lengths}"
        )
    return next(iter(lengths.values()), None)


def _concat_unpad(method: str, outputs: list, length: int | None, pad_size: int):
    """Concatenate DataProto outputs in rank order and strip the dispatch padding."""
    if all(out is None for out in outputs):
        return None
    if not all(isinstance(out, DataProto) for out in outputs):
        kinds = sorted({type(out).__name__ for out in outputs})
        raise TypeError(
            f"{method}() is Dispatch.DP_COMPUTE_PROTO: every rank must return a DataProto "
            f"(or all None) to be concatenated, got {kinds}"
        )
    merged = DataProto.concat(outputs)
    if pad_size == 0:
        return merged
    padded = length + pad_size
    if len(merged) % padded:
        raise ValueError(
            f"{method}() returned {len(merged)} samples for {padded} dispatched ({length} + "
            f"{pad_size} padding); outputs must have one (or k) samples per input sample "
            f"for the padding to be stripped"
        )
    return unpad_dataproto(merged, pad_size * (len(merged) // padded))
