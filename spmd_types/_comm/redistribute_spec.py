"""Partition-spec redistribute: plan the collectives between two layouts, then run them typed.

``spmd.plan_redistribute`` returns the plan (``_planner``); ``spmd.redistribute(x,
src_spec, dst_spec)`` runs it (``_planner_exec``) and types the result: V on
the axes ``dst_spec`` places, P on ``dst_partial``, R on the axes that were
gathered or reduced, and the input's own type on the axes nobody touched.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._checker.tensor import make_typed
from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.mesh import require_mesh
from .._core.spec import Spec, axes_of, normalize, to_partition_spec
from .._core.state import STATE
from .._core.types import AxisType, P, R, SpmdType, TypeMap, V
from .._torch.private import DisableTorchFunctionSubclass
from .call import unwrap
from .planner import Plan
from .planner import plan_redistribute as _plan
from .planner_exec import execute_plan

__all__ = ["plan_redistribute", "redistribute_spec"]


def _device_mesh(what: str):
    mesh = require_mesh(what)
    if mesh.device_mesh is None:
        raise TypeError(f"{what} needs the current mesh to be a DeviceMesh (it plans over flattened mesh axes)")
    return mesh.device_mesh


def plan_redistribute(x_or_shape: Any, src_spec: Sequence[Any], dst_spec: Sequence[Any], mesh: Any = None, *,
                      src_partial: Sequence[str] = (), dst_partial: Sequence[str] = (),
                      itemsize: int | None = None) -> Plan:
    """The collectives that take ``x`` (or a global shape) from ``src_spec`` to ``dst_spec``; runs nothing.

    ``mesh`` defaults to the current mesh. ``print(plan)`` shows each step with
    its bytes per rank; ``plan.total_bytes`` and ``plan.naive_bytes`` compare it
    with the naive per-axis plan.

    Example::

        plan = spmd.plan_redistribute((8, 4), ("tp", None), (None, "tp"), {"tp": 4})
        plan.collectives    # [('all_to_all', ('tp',))]
    """
    mesh = _device_mesh("plan_redistribute") if mesh is None else mesh
    return _plan(x_or_shape, src_spec, dst_spec, mesh, src_partial=src_partial, dst_partial=dst_partial,
                 itemsize=itemsize)


def redistribute_spec(x: torch.Tensor, src_spec: Sequence[Any], dst_spec: Sequence[Any], *,
                      src_partial: Sequence[str] = (), dst_partial: Sequence[str] = ()) -> torch.Tensor:
    """Move ``x`` from layout ``src_spec`` to ``dst_spec``, keeping its global value."""
    _refuse_a_type_for_a_spec(x, src_spec, dst_spec)
    device_mesh = _device_mesh("spmd.redistribute")
    src_partial = (src_partial,) if isinstance(src_partial, str) else tuple(src_partial)
    dst_partial = (dst_partial,) if isinstance(dst_partial, str) else tuple(dst_partial)
    plan = _plan(x, src_spec, dst_spec, device_mesh, src_partial=src_partial, dst_partial=dst_partial)
    types: TypeMap | None = getattr(x, "_spmd_types", None) if STATE.checking else None
    if types is None:
        return execute_plan(x, plan, device_mesh)
    with DisableTorchFunctionSubclass():
        ndim = x.dim()
    src = normalize(src_spec, ndim, "src_spec")
    _check_source(x, types, src, src_partial)
    out = execute_plan(unwrap(x), plan, device_mesh)
    dst = normalize(dst_spec, ndim, "dst_spec")
    typed = make_typed(out, _result_types(types, src, src_partial, dst, dst_partial))
    typed._spmd_spec = dst
    return typed


def _refuse_a_type_for_a_spec(x: Any, src_spec: Any, dst_spec: Any) -> None:
    """``spmd.redistribute(x, 'tp', spmd.R)``: a type given where the partition-spec form takes ``dst_spec``."""
    if not isinstance(dst_spec, AxisType):
        return
    have = getattr(x, "_spmd_types", None)
    src = have.get(src_spec) if (have is not None and isinstance(src_spec, str)) else None
    axis = repr(src_spec) if isinstance(src_spec, str) else "axis"
    raise TypeError(
        f"spmd.redistribute: dst_spec takes a partition spec, got the SPMD type {dst_spec}; a change of type on "
        f"one axis takes src= and dst= by keyword: spmd.redistribute(x, {axis}, src="
        f"{src.code() if src is not None else '...'}, dst={dst_spec.code()})"
    )


def _check_source(x: torch.Tensor, types: TypeMap, src: Spec, src_partial: tuple[str, ...]) -> None:
    placed = axes_of(src)
    have = getattr(x, "_spmd_spec", None)
    for axis, t in types.items:
        want = V if axis in placed else (P if axis in src_partial else None)
        bad = (want is V and not t.is_varying) or (want is P and t is not P) or (want is None and (t.is_varying or t is P))
        shard = getattr(t, "dim", None)  # S(d) says which dim, in local SPMD too (V may be any)
        where = [d for d, entry in enumerate(src) if axis in entry]
        if shard is not None and where != [shard]:
            bad, seen = True, f"'{axis}': the tensor is {t}, and src_spec places '{axis}' on " + (
                f"dim {where[0]}" if where else "no dim")
        else:
            seen = f"'{axis}': the tensor is {t}"
        if bad or (STATE.global_mode and have is not None and tuple(have) != tuple(src)):
            raise SpmdTypeError(
                Rejection(
                    "spmd.redistribute: src_spec (and src_partial) must describe the tensor as it is.",
                    [("tensor", types.format()), ("tensor's spec", repr(to_partition_spec(have)) if have else "none"),
                     ("src_spec", repr(to_partition_spec(src))), ("src_partial", str(src_partial)),
                     ("axis", seen)],
                    ["pass the tensor's own layout as src_spec (spmd.get_partition_spec(x))"],
                ),
                user_source_line(),
            )


def _result_types(types: TypeMap, src: Spec, src_partial: tuple[str, ...], dst: Spec,
                  dst_partial: tuple[str, ...]) -> TypeMap:
    moved = axes_of(src) | set(src_partial)
    out: dict[str, SpmdType] = {}
    for axis, t in types.items:
        if axis in axes_of(dst):
            out[axis] = V
        elif axis in dst_partial:
            out[axis] = P
        elif axis in moved:
            out[axis] = R
        else:
            out[axis] = t
    return TypeMap.of(out)
