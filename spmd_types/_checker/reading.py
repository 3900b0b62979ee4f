"""Reading a tensor's type, as presented on the current mesh.

A tensor typed on another presentation of the same ranks (a flattened or an
expert mesh) is read on the current mesh by ``_core/spaces.py``'s rule,
compared by regions of ranks, never by names; the published API's readers
(``get_local_type``, ``get_axis_local_type``) and ours (``get_type``) live here.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.axes import MeshAxis, region_of_group
from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.mesh import Axis, current_mesh, resolve_axes
from .._core.spaces import move_types, rehome
from .._core.spec import to_partition_spec
from .._core.traced import routed
from .._core.traced_args import RESOLVERS, SpecRef, TypeRef, unknown_in_trace
from .._core.types import PartitionSpec, SpmdType, TypeMap, V

__all__ = ["get_type", "get_partition_spec", "get_local_type", "has_local_type", "get_axis_local_type",
           "maybe_get_axis_local_type", "present", "rehome_here", "by_region"]


def present(t: torch.Tensor, who: str, *, strict: bool = True) -> tuple[TypeMap, list | None]:
    """``t``'s type presented on the current mesh, with the groups that moved (None when nothing moved).

    A tensor typed on another presentation of the same ranks (a flattened or an
    expert mesh) moves by ``_core/spaces.py``'s rule; one that cannot move is an
    error (``strict``) or stays as it is.
    """
    types: TypeMap = t._spmd_types  # type: ignore[attr-defined]
    mesh = current_mesh()
    if mesh is None or types.space is None or types.space is mesh.space:
        return types, None
    found = move_types(types, mesh.space)
    if isinstance(found, str):
        if not strict:
            return types, None
        raise _cannot_move(who, types, mesh, found)
    return found


def rehome_here(t: torch.Tensor, who: str) -> TypeMap:
    """Store ``t``'s type (and partition spec) as presented on the current mesh, in place; return the type."""
    mesh = current_mesh()
    if mesh is not None:
        why = rehome(t, mesh.space)
        if why is not None:
            raise _cannot_move(who, t._spmd_types, mesh, why)  # type: ignore[attr-defined]
    return t._spmd_types  # type: ignore[attr-defined]


def _cannot_move(who: str, types: TypeMap, mesh: Any, why: str) -> SpmdTypeError:
    return SpmdTypeError(
        Rejection(
            f"{who}: the tensor is typed on another mesh, and its type cannot move onto the current one: {why}.",
            [("tensor", types.format()),
             ("current mesh", ", ".join(f"{n}={mesh.region(n).layout_str()}" for n in mesh.typed_axes))],
            ["spmd.reinterpret_mesh(x, mesh) onto a mesh over the same ranks, or type it under this mesh"],
        ),
        user_source_line(),
    )


def get_local_type(t: Any) -> dict[Any, SpmdType]:
    """The published API's view of a typed tensor's type: ``{MeshAxis: R | I | V | P}`` (``S(d)`` is V), ``{}`` if untyped.

    Keyed by regions of ranks (:class:`MeshAxis`), outermost first, as torch
    2.14's FSDP2 and ``local_map`` read it; the layout of V axes is the
    partition spec (:func:`get_partition_spec`). Axes of size 1 carry no type
    and do not appear.

    Example::

        spmd.get_local_type(x)   # {dp: V, tp: R}, keys MeshAxis objects
    """
    if routed() and isinstance(t, torch.Tensor):  # read while dynamo traces: known when the graph is checked
        return TypeRef(t, "local_type")  # type: ignore[return-value]
    if getattr(t, "_spmd_types", None) is None:
        return {}
    types, _ = present(t, "get_local_type", strict=False)
    return by_region(types)


def by_region(types: TypeMap) -> dict[Any, SpmdType]:
    """``types`` keyed by each axis's region (outermost first), S(d) read as V; by name where no region is known."""
    space = types.space
    pairs = [(space.region(a) if space is not None else None, a, ty) for a, ty in types.items]
    if any(r is None for r, _, _ in pairs):
        return {a: (V if ty.is_varying else ty) for _, a, ty in pairs}
    pairs.sort(key=lambda p: -p[0].outer_stride())
    return {r: (V if ty.is_varying else ty) for r, _, ty in pairs}


def maybe_get_axis_local_type(t: Any, axis: Axis) -> SpmdType | None:
    """``t``'s local type (R, I, V or P) on one axis, or None when it has none there (untyped, an axis of one rank).

    ``axis`` is a name, a ProcessGroup or a MeshAxis; a group over several axes
    (a flattened ``dp_cp``) has a type when its axes agree.

    Example::

        if spmd.maybe_get_axis_local_type(x, tp_group) is spmd.P:
            x = spmd.all_reduce(x, tp_group, src=spmd.P, dst=spmd.R)
    """
    if routed():
        raise unknown_in_trace("spmd.maybe_get_axis_local_type / get_axis_local_type")
    if getattr(t, "_spmd_types", None) is None:
        return None
    types, _ = present(t, "get_axis_local_type", strict=False)
    found = {types.get(n) for n in _axis_names(types, axis)}
    if len(found) != 1 or None in found:
        return None
    (one,) = found
    return V if one.is_varying else one


def get_axis_local_type(t: Any, axis: Axis) -> SpmdType:
    """Like :func:`maybe_get_axis_local_type`, but a ``ValueError`` when there is no type on that axis.

    Example::

        spmd.get_axis_local_type(x, "tp")   # V
    """
    found = maybe_get_axis_local_type(t, axis)
    if found is None:
        shown = getattr(t, "_spmd_types", None)
        raise ValueError(f"get_axis_local_type: the tensor has no type on axis {_shown_axis(axis)} "
                         f"(its type: {shown.format() if shown is not None else '{}'})")
    return found


def _axis_names(types: TypeMap, axis: Axis) -> tuple[str, ...]:
    """The names ``axis`` stands for: on the current mesh, else among the axes of the tensor's own mesh."""
    if current_mesh() is not None:
        return resolve_axes(axis)
    if isinstance(axis, str):
        return (str.__str__(axis),)
    region = axis if isinstance(axis, MeshAxis) else region_of_group(axis)
    space = types.space
    return tuple(n for n, r in (space.pairs if space is not None else ()) if r == region)


def _shown_axis(axis: Axis) -> str:
    return repr(str.__str__(axis)) if isinstance(axis, str) else repr(axis)


def has_local_type(t: Any) -> bool:
    """True when ``t`` carries an SPMD type."""
    if routed():
        raise unknown_in_trace("spmd.has_local_type")
    return getattr(t, "_spmd_types", None) is not None


def get_partition_spec(t: Any) -> PartitionSpec | None:
    """A typed tensor's partition spec, its axes as regions of ranks (:class:`MeshAxis`); None if it has none.

    A spec comes from ``S(d)`` and ``partition_spec=`` in local SPMD too, and from
    global SPMD's propagation. Its entries compare by region, so
    ``PartitionSpec('tp', None)`` equals it under a mesh that calls that region ``tp``.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            x = spmd.assert_type(torch.randn(2, 16), {"tp": spmd.S(0)})
            spmd.get_partition_spec(x)   # PartitionSpec(tp, None)
    """
    if routed() and isinstance(t, torch.Tensor):  # read while dynamo traces: known when the graph is checked
        return SpecRef(t, t.dim())  # type: ignore[return-value]
    spec = getattr(t, "_spmd_spec", None) if isinstance(t, torch.Tensor) else None
    if spec is None:
        return None
    types = getattr(t, "_spmd_types", None)
    space = types.space if types is not None else None
    if space is None:
        return to_partition_spec(spec)
    return to_partition_spec(tuple(tuple(space.region(a) or a for a in entry) for entry in spec))


def get_type(t: Any) -> dict[str, SpmdType] | None:
    """The tensor's ``{axis: type}``, or None if it is untyped.

    Example::

        spmd.get_type(x)   # {'dp': V, 'tp': R}
    """
    if routed() and isinstance(t, torch.Tensor):  # read while dynamo traces: known when the graph is checked
        return TypeRef(t, "type")  # type: ignore[return-value]
    types = getattr(t, "_spmd_types", None) if isinstance(t, torch.Tensor) else None
    return types.as_dict() if types is not None else None


RESOLVERS.update({"local_type": get_local_type, "type": get_type, "spec": get_partition_spec})
