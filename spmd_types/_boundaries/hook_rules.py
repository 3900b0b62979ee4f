"""Type-only operations for ``spmd_typecheck`` hooks: the published API's ``spmd_types.rules``.

Each operation takes typed tensors or ``NdimWithSpmdType`` values and returns
an ``NdimWithSpmdType``: the type the corresponding computation would give,
with no data. ``einsum`` types an einsum-shaped kernel from its equation (a
contracted sharded label makes the result P; ``_`` marks a dim that must not be
sharded; ``linear_in`` names the operands a P may pass through); the
collectives and ``reinterpret`` / ``convert`` follow seed 003's table
(``_local/transitions.py``), exactly: a rule that reduces a V value says
``src=V``. ``ignore`` declares tensors the forward value does not depend on.

Types are keyed by regions (:class:`spmd.MeshAxis`); partition specs hold
regions. An axis is checked globally (sharded labels, partial contractions)
when checking is global on it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._checker.published import get_local_type, get_partition_spec
from .._core.errors import SpmdTypeError
from .._core.mesh import current_mesh
from .._core.phantom import NdimWithSpmdType, touch
from .._core.regions import normalize_axis
from .._core.state import STATE
from .._core.types import AxisType, I, P, PartitionSpec, R, Shard, V, check_type_value
from .._local.transitions import allowed, find
from .einsum_rule import einsum_type

__all__ = ["einsum", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reinterpret", "convert", "ignore",
           "output", "typed_value"]


def typed_value(value: Any, what: str) -> tuple[int, dict, list[tuple]]:
    """(ndim, ``{MeshAxis: local type}``, per dim the axes sharding it) of a typed tensor or an NdimWithSpmdType."""
    if isinstance(value, NdimWithSpmdType):
        ndim, local, spec = value.ndim, dict(value.local_type or {}), value.partition_spec
    elif isinstance(value, torch.Tensor):
        ndim, local, spec = value.dim(), dict(get_local_type(value)), get_partition_spec(value)
    else:
        raise TypeError(f"{what}: takes a tensor or an NdimWithSpmdType, got {type(value).__name__}; write a "
                        "separate rule for the None case")
    dims: list[tuple] = [() for _ in range(ndim)]
    for d, entry in enumerate(spec or ()):
        if d < ndim and entry is not None:
            dims[d] = tuple(normalize_axis(a) for a in (entry if isinstance(entry, tuple) else (entry,)))
    return ndim, local, dims


def make(ndim: int, local: dict, dims: Sequence[tuple]) -> NdimWithSpmdType:
    spec = None
    if any(dims):
        spec = PartitionSpec(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in dims))
    return NdimWithSpmdType(ndim, dict(local), spec)


def global_axes(regions: Any) -> set:
    """The regions among ``regions`` that are checked in global SPMD now."""
    if not STATE.global_mode:
        return set()
    mesh = current_mesh()
    if mesh is None:
        return set(regions)
    local_names = STATE.local_axes | mesh.local_axes
    out = set()
    for region in regions:
        names = mesh.axes_for_region(region)
        if not names or not any(n in local_names for n in names):
            out.add(region)
    return out


def einsum(equation: str, *operands: Any, linear_in: Sequence[Any] = (), out: torch.Tensor | None = None) -> Any:
    """The type of an einsum-shaped kernel: ``rules.einsum("mk,nk->mn", x, w)``.

    Single-letter labels, ``_`` for a dim that must not be sharded, ``...`` for
    passed-through dims, one output. Per axis: the standard rule (R with R is
    R, V with R or V is V, I only with I); a sharded label that reaches no output
    makes the result P there (global axes); an operand that lacks a sharded
    label must not be V there. A P operand passes only through ``linear_in``:
    ``(0, 1)`` linear in each, ``((0, 1),)`` jointly linear (an add). With
    ``out=`` the type is given to that real output tensor, which is returned.

    Example::

        y = rules.einsum("mk,nk->mn", x, weight)
        y = rules.einsum("mn,mn->mn", a, b, linear_in=((0, 1),))   # an add: a P passes through both
    """
    touch(*operands, rule=True)
    values = [typed_value(v, f"rules.einsum: {equation!r}: operand {i}") for i, v in enumerate(operands)]
    ndim, local, dims = einsum_type(equation, values, linear_in, global_axes)
    return _finish(make(ndim, local, dims), out)


def _finish(result: NdimWithSpmdType, out: Any) -> Any:
    if out is None:
        return result
    output(out, result)
    return out


def _transition(op: str, x: Any, axis: Any, src: Any, dst: Any) -> tuple[int, dict, list, Any, AxisType, AxisType]:
    """The checks every type-only collective shares: the pair is in seed 003's table, and ``x`` is ``src``."""
    what = f"rules.{op}"
    touch(x, rule=True)
    src = check_type_value(src, f"{what}: src")
    dst = check_type_value(dst, f"{what}: dst")
    table_src = V if src.is_varying else src
    table_dst = V if dst.is_varying else dst
    if find(op, table_src, table_dst) is None:
        shown = ", ".join(f"{s} -> {d}" for s, d in allowed(op))
        raise SpmdTypeError(f"{what}: no src={src} -> dst={dst} (allowed: {shown})")
    ndim, local, dims = typed_value(x, what)
    region = normalize_axis(axis)
    have = local.get(region)
    want = V if src.is_varying else src
    if region.size() > 1 and have is not want and not (have in (R, I) and want in (R, I) and not _needs_grad(x)):
        raise SpmdTypeError(f"{what}: src={src}, but the value is {have} on axis {region!r}")
    return ndim, local, dims, region, src, dst


def _needs_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _set(local: dict, region: Any, dst: AxisType) -> dict:
    if region.size() > 1:
        local[region] = V if dst.is_varying else dst
    return local


def _unshard(dims: list, region: Any) -> list:
    return [tuple(a for a in e if a != region) for e in dims]


def _shard_on(dims: list, region: Any, d: int, ndim: int, what: str) -> list:
    if not -ndim <= d < ndim:
        raise SpmdTypeError(f"{what}: S({d}) names dim {d} of a value with {ndim} dims")
    dims = list(dims)
    dims[d % ndim] = dims[d % ndim] + (region,)
    return dims


def all_reduce(x: Any, axis: Any, *, src: Any = P, dst: Any, out: Any = None) -> Any:
    """``spmd.all_reduce``'s type: P (or, said explicitly, V) to R or I on ``axis``."""
    ndim, local, dims, region, _, dst = _transition("all_reduce", x, axis, src, dst)
    return _finish(make(ndim, _set(local, region, dst), dims), out)


def all_gather(x: Any, axis: Any, *, src: Any = V, dst: Any, out: Any = None) -> Any:
    """``spmd.all_gather``'s type: V (stacked on a new dim 0) or S(d) (its shards joined) to R or I."""
    ndim, local, dims, region, src, dst = _transition("all_gather", x, axis, src, dst)
    if isinstance(src, Shard):
        dims = _unshard(dims, region)
    else:
        ndim, dims = ndim + 1, [()] + list(dims)
    return _finish(make(ndim, _set(local, region, dst), dims), out)


def reduce_scatter(x: Any, axis: Any, *, src: Any = P, dst: Any = V, out: Any = None) -> Any:
    """``spmd.reduce_scatter``'s type: P to V (dim 0, one entry per rank, taken) or S(d)."""
    ndim, local, dims, region, _, dst = _transition("reduce_scatter", x, axis, src, dst)
    if isinstance(dst, Shard):
        dims = _shard_on(dims, region, dst.dim, ndim, "rules.reduce_scatter")
    else:
        ndim, dims = ndim - 1, list(dims[1:])
    return _finish(make(ndim, _set(local, region, dst), dims), out)


def all_to_all(x: Any, axis: Any, *, src: Any = V, dst: Any = V, out: Any = None) -> Any:
    """``spmd.all_to_all``'s type: V or S(i) to V or S(j) on ``axis``."""
    ndim, local, dims, region, src, dst = _transition("all_to_all", x, axis, src, dst)
    dims = _unshard(dims, region)
    if isinstance(dst, Shard):
        dims = _shard_on(dims, region, dst.dim, ndim, "rules.all_to_all")
    return _finish(make(ndim, _set(local, region, dst), dims), out)


def reinterpret(x: Any, axis: Any, *, src: Any, dst: Any, out: Any = None) -> Any:
    """``spmd.reinterpret``'s type: the data as it is, typed ``dst`` on ``axis``."""
    ndim, local, dims, region, _, dst = _transition("reinterpret", x, axis, src, dst)
    return _finish(make(ndim, _set(local, region, dst), _unshard(dims, region)), out)


def convert(x: Any, axis: Any, *, src: Any, dst: Any, out: Any = None) -> Any:
    """``spmd.convert``'s type: the same meaning typed ``dst`` on ``axis`` (S(d) shards dim d)."""
    ndim, local, dims, region, _, dst = _transition("convert", x, axis, src, dst)
    dims = _unshard(dims, region)
    if isinstance(dst, Shard):
        dims = _shard_on(dims, region, dst.dim, ndim, "rules.convert")
    return _finish(make(ndim, _set(local, region, dst), dims), out)


def ignore(*tensors: Any) -> None:
    """Declare tensors the forward value does not depend on (saved for backward only): they are covered."""
    touch(*tensors, rule=True)


def output(out: Any, typed: Any) -> None:
    """Give the real output(s) ``out`` the type(s) of ``typed`` (tensors or NdimWithSpmdType, matching tuples).

    A None output (an optional one) is skipped; ranks must agree.

    Example::

        rules.output(out, rules.einsum("mk,nk->mn", x, w))
    """
    from .._checker.asserts import assert_type

    if isinstance(out, (tuple, list)):
        if not isinstance(typed, (tuple, list)) or len(typed) != len(out):
            count = len(typed) if isinstance(typed, (tuple, list)) else 1
            raise SpmdTypeError(f"rules.output: {len(out)} output(s) but {count} type(s)")
        for o, t in zip(out, typed):
            output(o, t)
        return
    if out is None or (typed is None and not isinstance(out, torch.Tensor)):
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"rules.output: expected a tensor output, got {type(out).__name__}")
    ndim, local, dims = typed_value(typed, "rules.output")
    if ndim != out.dim():
        raise SpmdTypeError(f"rules.output: the type has {ndim} dim(s), the output {out.dim()}")
    spec = make(ndim, local, dims).partition_spec
    assert_type(out, local, partition_spec=spec)


