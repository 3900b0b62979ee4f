"""Typing by process groups with no mesh current: the axes a type names are its mesh (the published API's way).

A type covers every axis of its mesh (choice 1). With no ``set_current_mesh``,
a type keyed by process groups or ``MeshAxis`` objects makes its own mesh of
exactly those axes (``assert_type(x, {tp_group: spmd.R})`` types ``x`` on the
mesh ``{tp}``), and a collective on a typed tensor runs on the mesh its input
was typed on. Names still need a current mesh (only a mesh says what ``"tp"``
is). Axes are named as their regions are (a mesh's name for them, or the
group's ``group_desc``), so a message shows ``{mesh_tp: R}``.
"""

from __future__ import annotations

from typing import Any, Iterable

from .axes import MeshAxis, region_of_group
from .mesh import Mesh, current_mesh

__all__ = ["mesh_of_keys", "mesh_of_space", "mesh_of_values"]


def _is_region_key(key: Any) -> bool:
    import torch.distributed as dist

    return isinstance(key, (MeshAxis, dist.ProcessGroup)) or hasattr(key, "__mesh_axis__")


def _spec_axes(spec: Any) -> Iterable[Any]:
    if spec is None or isinstance(spec, str):
        return ()
    try:
        entries = list(spec)
    except TypeError:
        return ()
    return [a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))]


def mesh_of_keys(types: Any, spec: Any = None) -> Mesh | None:
    """The mesh a type dict keyed by groups (or MeshAxis objects) makes, when no mesh is current; else None.

    None also when a key is a name (or not an axis at all): the usual errors
    then say what is missing. Axes of one rank carry no type and are left out;
    two keys over one region give one axis.
    """
    if current_mesh() is not None or not hasattr(types, "items"):
        return None
    keys = list(types.keys()) + list(_spec_axes(spec))
    if not keys or not all(_is_region_key(k) for k in keys):
        return None
    chosen: dict[MeshAxis, Any] = {}
    for key in keys:
        region = key if isinstance(key, MeshAxis) else region_of_group(key)
        if region.size() > 1 and (region not in chosen or isinstance(chosen[region], MeshAxis)):
            chosen[region] = key  # a group where one is given: a collective over the axis can use it
    if not chosen:
        return None
    return _cached(tuple(chosen.values()))


def mesh_of_space(space: Any) -> Mesh | None:
    """The mesh a type was given on (its space's names and regions), for a collective with no mesh current."""
    if space is None or current_mesh() is not None:
        return None
    found = _BY_SPACE.get(space)
    if found is None:
        pairs = {name: region for name, region in space.pairs}
        if not pairs or not all(isinstance(r, MeshAxis) for r in pairs.values()):
            return None
        found = _BY_SPACE[space] = Mesh.from_user(pairs)
    return found


_BY_SPACE: dict[Any, Mesh] = {}
_BY_KEYS: dict[tuple, Mesh] = {}


def _cached(keys: tuple) -> Mesh:
    try:
        found = _BY_KEYS.get(keys)
    except TypeError:
        found = None
    if found is None:
        found = Mesh.from_user(list(keys))
        if len(_BY_KEYS) >= 256:
            _BY_KEYS.clear()
        try:
            _BY_KEYS[keys] = found
        except TypeError:
            pass
    return found


def mesh_of_values(values: Iterable[Any], declarations: Any = ()) -> Mesh | None:
    """With no mesh current: the mesh the first typed value was typed on, else the one the type dicts in
    ``declarations`` (nested lists, ``(types, spec)`` pairs) make together; None when neither gives one."""
    for v in values:
        found = mesh_of_space(getattr(getattr(v, "_spmd_types", None), "space", None))
        if found is not None:
            return found
    keys: dict = {}
    _collect_keys(declarations, keys)
    return mesh_of_keys(keys) if keys else None


def _collect_keys(decl: Any, into: dict) -> None:
    if isinstance(decl, dict):
        into.update(dict.fromkeys(decl))
    elif hasattr(decl, "local_type"):  # a whole spmd.SpmdType
        _collect_keys(dict(decl.local_type), into)
    elif isinstance(decl, (list, tuple)):
        for d in decl:
            _collect_keys(d, into)
