"""The published API's reads of a tensor's type, and its ``assert_type_like`` family.

``get_local_type`` and ``get_partition_spec`` read a type keyed by regions
(:class:`spmd.MeshAxis`), as torch 2.14 and torchtitan read it, including a
type given by ``assert_type`` outside ``typecheck()`` (remembered on the
plain tensor, ``latent.py``). Parameter names are the published package's
(``tensor``, ``value``, ``type``), so its keyword calls work.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

import torch

from .._core.implicit_mesh import mesh_of_keys
from .._core.mesh import current_mesh
from .._core.phantom import NdimWithSpmdType, touch
from .._core.spec import Spec, axes_of, to_partition_spec
from .._core.state import STATE
from .._core.traced import routed
from .._core.traced_args import unknown_in_trace
from .._core.types import AxisType, Shard, SpmdType, TypeMap, V
from .asserts import TypeSpec, _placed_and_given, assert_type
from .latent import remember, remembered
from .reading import by_region, present
from .reading import get_axis_local_type as _typed_axis
from .reading import get_local_type as _typed_local_type
from .reading import get_partition_spec as _typed_partition_spec
from .reading import maybe_get_axis_local_type as _typed_maybe_axis

__all__ = ["get_local_type", "get_partition_spec", "has_local_type", "assert_type_like", "assert_local_type",
           "assert_local_type_like", "get_axis_local_type", "maybe_get_axis_local_type", "mutate_remembered"]

T = TypeVar("T")


def get_local_type(value: Any) -> dict[Any, SpmdType]:
    """The published API's view of a tensor's type: ``{MeshAxis: R | I | V | P}`` (``S(d)`` is V), ``{}`` if untyped.

    Keyed by regions of ranks (:class:`spmd.MeshAxis`), outermost first, as
    torch 2.14's FSDP2 and ``local_map`` read it; axes of size 1 do not appear.
    The layout of V axes is the partition spec (:func:`get_partition_spec`). A
    type given outside ``typecheck()`` reads the same (resolved under the mesh
    it was given with); given with no mesh and keyed by names, its keys stay names.

    Example::

        out_types = {**spmd.get_local_type(x), spmd.MeshAxis.of(tp_group): spmd.S(1)}  # x's types, tp changed
    """
    t = value
    if routed() and isinstance(t, torch.Tensor):  # read while dynamo traces: known when the graph is checked
        return _typed_local_type(t)  # a reference (reading.get_local_type)
    touch(t)  # inside a Function's hook, reading a type accounts for the tensor
    if getattr(t, "_spmd_types", None) is not None:
        return _typed_local_type(t)  # presented on the current mesh
    if isinstance(t, NdimWithSpmdType):
        return dict(t.local_type or {})
    found = _remembered_types(t)
    if found is None:
        return {}
    if isinstance(found, tuple):  # the axes the assertion named (a spec's included), as regions
        types, spec, given = found
        named = set(given) | (axes_of(spec) if spec is not None else set())
        return by_region(TypeMap.of({a: ty for a, ty in types.items if a in named}, types.space))
    out: dict[Any, SpmdType] = {}
    for a, ty in found.items():
        key = _region_or_name(a)
        if key is not None:
            out[key] = V if ty.is_varying else ty
    return out


def get_partition_spec(tensor: Any) -> Any:
    """A typed tensor's partition spec, its axes as regions of ranks (:class:`spmd.MeshAxis`); None if it has none.

    Local SPMD keeps one too when ``S(d)`` or ``partition_spec=`` places an axis
    (torch 2.14's FSDP2 reads it to shard a parameter); a type given outside
    ``typecheck()`` has its spec read the same way. Entries compare by region:
    ``PartitionSpec('tp', None)`` equals it under a mesh that calls that region ``tp``.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            x = spmd.assert_type(torch.randn(2, 16), {"tp": spmd.S(0)})
            spmd.get_partition_spec(x)   # PartitionSpec(tp, None)
    """
    t = tensor
    touch(t)
    if getattr(t, "_spmd_types", None) is not None:
        return _typed_partition_spec(t)
    if isinstance(t, NdimWithSpmdType):
        return t.partition_spec
    found = _remembered_types(t)
    if found is None:
        return None
    if isinstance(found, tuple):
        types, spec, _ = found
        if spec is None:
            return None
        space = types.space
        return to_partition_spec(tuple(tuple(space.region(a) if space is not None else a for a in e) for e in spec))
    shards = {_region_or_name(a): ty for a, ty in found.items() if isinstance(ty, Shard)}
    shards.pop(None, None)
    if not shards:
        return None
    ndim = t.dim()
    entries: list[tuple] = [() for _ in range(ndim)]
    for a, ty in shards.items():
        entries[ty.dim % ndim] += (a,)
    return to_partition_spec(tuple(entries))


def _region_or_name(axis: Any) -> Any:
    """A type dict's key as a region of ranks (None for one of size 1); a name stays a name (no mesh to read it)."""
    from .._core.axes import MeshAxis, region_of_group

    if isinstance(axis, str):
        return str.__str__(axis)
    region = axis if isinstance(axis, MeshAxis) else region_of_group(axis)
    return region if region.size() > 1 else None


def _remembered_types(t: Any) -> tuple[TypeMap, Spec | None, dict] | Mapping | None:
    """What a record made outside typecheck() stands for: (types, spec, the axes it named) resolved under its mesh
    (or the current one), else the type dict as given."""
    record = remembered(t)
    if record is None:
        return None
    types, spec, mesh, _ = record
    if mesh is None:
        mesh = current_mesh() or mesh_of_keys(types, spec)  # typed by groups alone: the mesh they make
        if mesh is None:
            return types if isinstance(types, Mapping) else None
    from .._core.mesh import set_current_mesh

    with set_current_mesh(mesh):
        if isinstance(types, AxisType):  # a bare type: every axis of the mesh it was given under
            types = {a: types for a in mesh.typed_axes}
        return _placed_and_given(t, types, spec)


def has_local_type(tensor: Any) -> bool:
    """True when ``tensor`` carries an SPMD type (or was given one by ``assert_type`` outside ``typecheck()``)."""
    if routed():
        raise unknown_in_trace("spmd.has_local_type")
    if isinstance(tensor, NdimWithSpmdType):
        return tensor.local_type is not None
    return getattr(tensor, "_spmd_types", None) is not None or remembered(tensor) is not None


def maybe_get_axis_local_type(tensor: Any, axis: Any) -> SpmdType | None:
    """``tensor``'s local type on ``axis`` (R, I, V or P; S(d) reads V), or None when it has none there.

    Reads a type given outside ``typecheck()`` too.

    Example::

        if spmd.maybe_get_axis_local_type(x, "tp") is spmd.P:
            x = spmd.all_reduce(x, "tp", src=spmd.P, dst=spmd.R)
    """
    if getattr(tensor, "_spmd_types", None) is not None or remembered(tensor) is None:
        return _typed_maybe_axis(tensor, axis)
    from .._core.regions import normalize_axis

    return get_local_type(tensor).get(normalize_axis(axis))


def get_axis_local_type(tensor: Any, axis: Any) -> SpmdType:
    """``tensor``'s local type on ``axis``; a ``ValueError`` when it has none there (reads a type given outside
    ``typecheck()`` too).

    Example::

        assert spmd.get_axis_local_type(w, "tp") is spmd.V
    """
    if getattr(tensor, "_spmd_types", None) is not None or remembered(tensor) is None:
        return _typed_axis(tensor, axis)
    found = maybe_get_axis_local_type(tensor, axis)
    if found is None:
        raise ValueError(f"get_axis_local_type: the tensor has no type on axis {axis!r} (its type: "
                         f"{get_local_type(tensor)})")
    return found


def assert_type_like(tensor: T, source: torch.Tensor, overrides: TypeSpec | None = None) -> T:
    """``assert_type(t, source's types with overrides, source's partition spec)``, in place.

    Example::

        out = all_gather_into(buf, x)
        spmd.assert_type_like(out, x, {"tp": spmd.R})
    """
    return assert_type(tensor, _overridden(_local_or_shards(source), overrides),
                       partition_spec=get_partition_spec(source))


def assert_local_type(tensor: T, type: TypeSpec) -> T:  # noqa: A002 - the published API's parameter name
    """The published API's older name for :func:`assert_type` without a partition spec."""
    return assert_type(tensor, type)


def assert_local_type_like(tensor: T, source: torch.Tensor, overrides: TypeSpec | None = None) -> T:
    """Like :func:`assert_type_like`, without the source's partition spec."""
    return assert_type(tensor, _overridden(_local_or_shards(source), overrides))


def _overridden(types: dict, overrides: Any) -> dict:
    """``types`` (keyed by names) with the axes ``overrides`` names replaced, whatever key spells them."""
    if not overrides:
        return types
    from .._core.mesh import resolve_axes

    replaced = {n for key in overrides for n in (resolve_axes(key) if current_mesh() is not None else ())}
    return {**{a: t for a, t in types.items() if a not in replaced}, **overrides}


def _local_or_shards(source: torch.Tensor) -> dict[str, SpmdType]:
    if isinstance(source, NdimWithSpmdType):  # a rules value: its regions' types
        return dict(source.local_type or {})
    if getattr(source, "_spmd_types", None) is None:
        if STATE.checking:
            raise TypeError("assert_type_like: the source tensor is untyped; type it first")
        return {}
    return dict(present(source, "assert_type_like")[0].items)


def mutate_remembered(tensor: torch.Tensor, axis: Any, src: Any, dst: Any) -> torch.Tensor:
    """``mutate_type`` on a type given outside ``typecheck()``: the record changes (src checked), as the published
    package changes the type it stores."""
    record = remembered(tensor)
    if record is None:
        return tensor
    from .._core.errors import SpmdTypeError
    from .._core.mesh import set_current_mesh
    from .._core.regions import normalize_axis
    from .._core.types import compatible

    mesh = record[2] if record[2] is not None else current_mesh()
    with set_current_mesh(mesh) if mesh is not None else _no_mesh():
        have = get_local_type(tensor)
        pairs = _mutations(have, axis, src, dst, normalize_axis)
        for region, s, _ in pairs:
            if not compatible(have.get(region), s, tensor.dim()):
                raise SpmdTypeError(f"spmd.mutate_type's src= must be the tensor's type: src={s}, but the tensor is "
                                    f"{have.get(region)} on axis {region!r}.")
        new = {**have, **{region: (V if d.is_varying else d) for region, _, d in pairs}}
        remember(tensor, *_with_layout(new, get_partition_spec(tensor)))  # checking is off: the record replaced
    return tensor


def _with_layout(types: dict, spec: Any) -> tuple[dict, Any]:
    """``types`` with its V axes that ``spec`` places on a dim of their own as S(d) (as given), and the rest of
    the spec (None when nothing is left)."""
    if spec is None:
        return types, None
    if all(e is None or not isinstance(e, tuple) for e in spec):
        shards = {e: d for d, e in enumerate(spec) if e is not None}
        return {a: (Shard(shards[a]) if t is V and a in shards else t) for a, t in types.items()}, None
    return types, spec


def _mutations(have: dict, axis: Any, src: Any, dst: Any, normalize_axis: Any) -> list[tuple[Any, Any, Any]]:
    """``(region, src, dst)`` per axis a ``mutate_type`` call names (dicts, one axis, or every axis)."""
    if isinstance(src, Mapping) or isinstance(dst, Mapping):
        keys = list(src) if isinstance(src, Mapping) else list(dst)
        return [(normalize_axis(k), src[k] if isinstance(src, Mapping) else src,
                 dst[k] if isinstance(dst, Mapping) else dst) for k in keys]
    if axis is None:
        return [(region, src, dst) for region in have]
    region = normalize_axis(axis)
    return [] if region.size() <= 1 else [(region, src, dst)]


def _no_mesh() -> Any:
    import contextlib

    return contextlib.nullcontext()
