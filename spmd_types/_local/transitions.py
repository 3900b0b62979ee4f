"""Seed 003's type-changing operators as data: which (op, src, dst) exist, and each one's backward.

Read left to right, a row is ``forward op (src -> dst)``, then the op its
backward runs on the gradient, whose types are the backward types
(R <-> P swap). The collectives, the docs and the fix suggestions in error
messages all read this one table. ``V`` stands for "V or S(d)" here.
"""

from __future__ import annotations

from typing import NamedTuple

from .._core.types import I, P, R, SpmdType, V, base_type

__all__ = ["Transition", "TRANSITIONS", "ROUTE", "allowed", "backward_of"]


class Transition(NamedTuple):
    op: str
    src: SpmdType
    dst: SpmdType
    backward: tuple[str, SpmdType, SpmdType]
    comm: str  # what the forward moves: "none", "all_reduce", "all_gather", ...
    meaning: str


TRANSITIONS: tuple[Transition, ...] = (
    Transition("reinterpret", R, I, ("convert", I, P), "none", "same local data; the gradient is no longer summed"),
    Transition("reinterpret", R, V, ("reinterpret", V, P), "none", "same local data, now one value per rank"),
    Transition("reinterpret", R, P, ("reinterpret", R, P), "none", "same local data, now summed: the value is N times larger"),
    Transition("reinterpret", I, R, ("all_reduce", P, I), "none", "same value; the gradient becomes a pending sum"),
    Transition("reinterpret", I, V, ("all_reduce", V, I), "none", "same local data, now one value per rank"),
    Transition("reinterpret", V, P, ("reinterpret", R, V), "none", "the per-rank values become a pending sum"),
    Transition("convert", R, I, ("convert", I, P), "none", "same value (R and I hold the same data)"),
    Transition("convert", I, R, ("all_reduce", P, I), "none", "same value (R and I hold the same data)"),
    Transition("convert", R, V, ("convert", V, P), "none", "each rank keeps its slice"),
    Transition("convert", I, V, ("all_gather", V, I), "none", "each rank keeps its slice"),
    Transition("convert", R, P, ("convert", R, P), "none", "all ranks but rank 0 zero their copy"),
    Transition("convert", I, P, ("reinterpret", R, I), "none", "all ranks but rank 0 zero their copy"),
    Transition("convert", V, P, ("convert", R, V), "none", "each rank places its slice in zeros"),
    Transition("all_reduce", P, R, ("all_reduce", P, R), "all_reduce", "sum the pending sum; the gradient stays pending"),
    Transition("all_reduce", P, I, ("reinterpret", I, R), "all_reduce", "sum the pending sum; the gradient is already summed"),
    Transition("all_gather", V, R, ("reduce_scatter", P, V), "all_gather", "gather the slices; the gradient is reduce-scattered"),
    Transition("all_gather", V, I, ("convert", I, V), "all_gather", "gather the slices; the gradient is sliced locally"),
    Transition("reduce_scatter", P, V, ("all_gather", V, R), "reduce_scatter", "sum and keep one slice"),
    Transition("all_to_all", V, V, ("all_to_all", V, V), "all_to_all", "re-slice on another dim"),
)

_BY_KEY = {(t.op, t.src, t.dst): t for t in TRANSITIONS}

# The semantics-preserving route from one type to another: what redistribute
# runs, and what an error message suggests when a value has the wrong type.
ROUTE: dict[tuple[SpmdType, SpmdType], str] = {
    (R, I): "convert", (R, V): "convert", (R, P): "convert",
    (I, R): "convert", (I, V): "convert", (I, P): "convert",
    (V, R): "all_gather", (V, I): "all_gather", (V, P): "convert", (V, V): "all_to_all",
    (P, R): "all_reduce", (P, I): "all_reduce", (P, V): "reduce_scatter",
}


def allowed(op: str) -> list[tuple[SpmdType, SpmdType]]:
    """The (src, dst) pairs ``op`` accepts (V standing for V or S(d))."""
    return [(t.src, t.dst) for t in TRANSITIONS if t.op == op]


def find(op: str, src: SpmdType, dst: SpmdType) -> Transition | None:
    return _BY_KEY.get((op, base_type(src), base_type(dst)))


# src=V on a reduction is shorthand for reinterpret(V, P) first (CONTRACT 4). Where the two
# backwards compose into one op, it is named here, so every backward the table names can
# itself be looked up: all_reduce(V -> I) is JAX's psum_invariant, whose transpose is pvary.
_SHORTHAND_BACKWARD = {("all_reduce", V, I): ("reinterpret", I, V)}


def backward_of(op: str, src: SpmdType, dst: SpmdType) -> tuple[str, SpmdType, SpmdType]:
    """The op the backward of ``op(src -> dst)`` runs, with its (src, dst).

    Example::

        >>> backward_of("all_gather", V, R)
        ('reduce_scatter', P, V)
    """
    t = find(op, src, dst)
    if t is not None:
        return t.backward
    shorthand = _SHORTHAND_BACKWARD.get((op, base_type(src), base_type(dst)))
    if shorthand is None:
        raise KeyError((op, src, dst))
    return shorthand


def route_call(x: str, axis: str, have: SpmdType, want: SpmdType) -> str | None:
    """The call that turns ``x`` from ``have`` into ``want`` keeping its meaning, as code."""
    op = ROUTE.get((base_type(have), base_type(want)))
    if op is None:
        return None
    return f"spmd.{op}({x}, '{axis}', src={have.code()}, dst={want.code()})"
