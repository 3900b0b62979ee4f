"""The current mesh: axis names, their process groups and rank regions, a per-thread stack.

A mesh is a named ``DeviceMesh``, a ``{name: ProcessGroup}`` dict, a
``{name: MeshAxis}`` dict, a frozenset of ``MeshAxis`` or a sequence of
process groups. Every axis has a region of ranks (``_core/axes.py``): that is
its identity, so a process group or a ``MeshAxis`` names the axis of the
current mesh with the same region, and a group over several axes (a
flattened ``dp_cp``) names those axes together. Axes of size 1 stay nameable
but carry no type: a tensor's type covers the mesh's *typed axes* (size > 1).
The stack is thread-local, so two threads may typecheck against different
meshes at once.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterable, Iterator, Mapping, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._torch.private import resolve_process_group
from . import axes as _axes
from . import types as _types
from .axes import MeshAxis, flatten, name_region, orthogonal, region_of_group
from .types import Space

__all__ = ["Mesh", "set_current_mesh", "current_mesh", "resolve_axis", "resolve_axes", "Axis"]

Axis = Union[str, dist.ProcessGroup, DeviceMesh, MeshAxis]


def axis_key_name(axis: str) -> str:
    """The plain name of a str key (a ``StrEnum`` member becomes its value)."""
    return axis if type(axis) is str else str.__str__(axis)


class Mesh:
    """Axis names in order, with the process group (where known) and the region of ranks of each axis."""

    __slots__ = ("axis_names", "groups", "device_mesh", "local_axes", "_regions", "_sizes", "_global_axes",
                 "_typed", "_space", "_by_region", "_token")

    def __init__(
        self,
        axis_names: tuple[str, ...],
        groups: dict[str, dist.ProcessGroup | None],
        device_mesh: DeviceMesh | None,
        regions: dict[str, MeshAxis] | None = None,
        local_axes: frozenset[str] = frozenset(),
    ) -> None:
        self.axis_names = axis_names
        self.groups = groups
        self.device_mesh = device_mesh
        self.local_axes = local_axes
        self._regions: dict[str, MeshAxis] = dict(regions or {})
        self._sizes: dict[str, int] | None = None
        self._global_axes: dict[frozenset, frozenset] = {}
        self._typed: tuple[str, ...] | None = None
        self._space: Space | None = None
        self._by_region: dict[MeshAxis, tuple[str, ...] | None] = {}
        self._token: object | None = None

    @classmethod
    def from_user(cls, mesh: Any) -> Mesh:
        if isinstance(mesh, Mesh):  # one the package made: a copy, so set_current_mesh can set its local axes
            return cls(mesh.axis_names, mesh.groups, mesh.device_mesh, mesh._regions, mesh.local_axes)
        if isinstance(mesh, DeviceMesh):
            names = mesh.mesh_dim_names
            if not names:
                raise ValueError(
                    "set_current_mesh needs a DeviceMesh with mesh_dim_names, e.g. "
                    "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp'))"
                )
            groups = {n: mesh.get_group(n) for n in names}
            return cls._checked(tuple(names), groups, mesh, {})
        if isinstance(mesh, Mapping):
            if not mesh:
                raise ValueError("set_current_mesh: the mesh has no axes")
            groups: dict[str, Any] = {}
            regions: dict[str, MeshAxis] = {}
            for key, value in mesh.items():
                if not isinstance(key, str):
                    raise TypeError(f"mesh axis names must be str, got {key!r}")
                name = axis_key_name(key)
                if not name:
                    raise ValueError("set_current_mesh: mesh axis names must be non-empty")
                if isinstance(value, MeshAxis):
                    groups[name], regions[name] = None, value
                elif isinstance(value, dist.ProcessGroup):
                    groups[name] = value
                else:
                    raise TypeError(
                        f"mesh axis {name!r} must map to a ProcessGroup or a MeshAxis, got {type(value).__name__}"
                    )
            return cls._checked(tuple(groups), groups, None, regions)
        if isinstance(mesh, (frozenset, set, list, tuple)):
            items = list(mesh)
            if not items:
                raise ValueError("set_current_mesh: the mesh has no axes")
            groups, regions = {}, {}
            for item in items:
                if isinstance(item, MeshAxis):
                    region, group = item, None
                elif isinstance(item, dist.ProcessGroup) or hasattr(item, "__mesh_axis__"):
                    region, group = region_of_group(item), item
                else:
                    raise TypeError(f"set_current_mesh: a mesh given as a collection holds MeshAxis objects or "
                                    f"ProcessGroups, got {type(item).__name__}")
                name = repr(region)
                groups[name], regions[name] = group, region
            order = sorted(groups, key=lambda n: -regions[n].outer_stride())
            return cls._checked(tuple(order), {n: groups[n] for n in order}, None, regions)
        raise TypeError(
            "set_current_mesh takes a DeviceMesh with mesh_dim_names, a {name: ProcessGroup} or {name: MeshAxis} "
            f"dict, or a collection of MeshAxis / ProcessGroup objects; got {type(mesh).__name__}"
        )

    @classmethod
    def _checked(cls, names: tuple[str, ...], groups: dict, device_mesh: Any, regions: dict) -> Mesh:
        mesh = cls(names, groups, device_mesh, regions)
        seen: dict[MeshAxis, str] = {}
        for name in mesh.typed_axes:
            region = mesh.region(name)
            if region in seen:
                raise ValueError(
                    f"set_current_mesh: axes '{seen[region]}' and '{name}' run over the same ranks; "
                    "a mesh axis is one region of ranks, named once"
                )
            seen[region] = name
        regions_typed = [mesh.region(n) for n in mesh.typed_axes]
        if not orthogonal(regions_typed):
            raise ValueError(
                f"set_current_mesh: the axes ({', '.join(mesh.typed_axes)}) are not independent dims of one mesh "
                f"(regions {', '.join(r.layout_str() for r in regions_typed)}); a type per axis needs axes that "
                "do not overlap"
            )
        for name in names:
            name_region(mesh.region(name), name)
        return mesh

    def region(self, axis: str) -> MeshAxis:
        """The region of ranks of axis ``axis``."""
        found = self._regions.get(axis)
        if found is None:
            found = self._regions[axis] = region_of_group(self.groups[axis])
        return found

    def size(self, axis: str) -> int:
        return self.sizes()[axis]

    def sizes(self) -> dict[str, int]:
        """``{axis: number of ranks}``, computed once."""
        if self._sizes is None or len(self._sizes) != len(self.groups):
            self._sizes = {
                name: (dist.get_world_size(g) if g is not None else self.region(name).size())
                for name, g in self.groups.items()
            }
        return self._sizes

    @property
    def typed_axes(self) -> tuple[str, ...]:
        """The axes a type covers: every axis of more than one rank, in mesh order."""
        if self._typed is None or self._sizes is None or len(self._sizes) != len(self.groups):
            sizes = self.sizes()
            self._typed = tuple(n for n in self.axis_names if sizes[n] > 1)
        return self._typed

    @property
    def space(self) -> Space:
        """What this mesh's typed axis names stand for (the regions), interned."""
        if self._space is None:
            self._space = Space.of((n, self.region(n)) for n in self.typed_axes)
        return self._space

    def global_axes(self, local_axes: frozenset) -> frozenset:
        """The axes checked in global SPMD when ``local_axes`` (and the mesh's own local axes) stay local."""
        found = self._global_axes.get(local_axes)
        if found is None:
            found = self._global_axes[local_axes] = frozenset(
                a for a in self.typed_axes if a not in local_axes and a not in self.local_axes
            )
        return found

    def axes_for_region(self, region: MeshAxis) -> tuple[str, ...] | None:
        """The typed axes a group over ``region`` runs over: one axis, several (flattened), () for one rank."""
        if region.size() == 1:
            return ()
        if region in self._by_region:
            return self._by_region[region]
        found = None
        typed = self.typed_axes
        for k in range(1, len(typed) + 1):
            for chosen in itertools.combinations(typed, k):
                regions = [self.region(n) for n in chosen]
                if orthogonal(regions) and flatten(regions) == region:
                    found = tuple(chosen)
                    break
            if found is not None:
                break
        self._by_region[region] = found
        return found

    def group_for(self, names: tuple[str, ...]) -> dist.ProcessGroup | None:
        """The process group over ``names`` (one axis, or several flattened through the DeviceMesh)."""
        if len(names) == 1:
            return self.groups.get(names[0])
        if self.device_mesh is None:
            return None
        return self.device_mesh[names]._flatten().get_group()

    @property
    def token(self) -> object:
        """One object per distinct mesh: meshes made again from the same axes, groups, regions, DeviceMesh and
        local axes (a mesh set every step) share it, so a cache keyed by it keeps its entries across them."""
        if self._token is None:
            groups = tuple(self.groups.get(n) for n in self.axis_names)
            regions = tuple(self._regions.get(n) if g is None else None for n, g in zip(self.axis_names, groups))
            key = (self.axis_names, groups, regions, self.device_mesh, self.local_axes)
            try:
                found = _TOKENS.get(key)
            except TypeError:  # an unhashable part: this mesh is its own
                found = key = None
            if found is None:
                found = object()
                if key is not None:
                    if len(_TOKENS) >= 1024:
                        _TOKENS.clear()
                    _TOKENS[key] = found
            self._token = found
        return self._token

    def __repr__(self) -> str:
        return f"Mesh({', '.join(self.axis_names)})"


_TOKENS: dict[tuple, object] = {}


class _MeshStack(threading.local):
    stack: list[Mesh]
    top: Mesh | None  # stack[-1], or None: the erased assert_type reads it on every call (one attribute read)

    def __init__(self) -> None:
        self.stack = []
        self.top = None


_MESHES = _MeshStack()


@contextlib.contextmanager
def set_current_mesh(axes: Any = None, *, local_axes: Iterable[Any] = ()) -> Iterator[Mesh]:
    """Make ``axes`` (a mesh) the current mesh for this thread inside the ``with`` block.

    ``axes`` is a ``DeviceMesh`` with ``mesh_dim_names``, a ``{name: ProcessGroup}``
    or ``{name: MeshAxis}`` dict, or a collection of ``MeshAxis`` / process groups;
    ``None`` keeps the current mesh (to change ``local_axes``). ``local_axes``
    names the outermost axes that stay in local SPMD when checking is global
    (``typecheck(local=False)``). Axes of size 1 carry no type.

    Example::

        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            x = spmd.assert_type(x, {"dp": spmd.V, "tp": spmd.R})
    """
    mesh = axes  # the published parameter name: the mesh's axes, in any form above
    if mesh is None:
        outer = current_mesh()
        if outer is None:
            raise RuntimeError("set_current_mesh() with no mesh keeps the current one, but no mesh is current")
        m = Mesh(outer.axis_names, outer.groups, outer.device_mesh, outer._regions)
    else:
        m = Mesh.from_user(mesh)
    m.local_axes = _local_axes_of(m, local_axes)
    m.token  # noqa: B018 - made now, while the mesh is complete: the erased path reads m._token
    stack = _MESHES.stack
    stack.append(m)
    _MESHES.top = m
    try:
        yield m
    finally:
        stack.pop()
        _MESHES.top = stack[-1] if stack else None


def _local_axes_of(mesh: Mesh, axes: Iterable[Any]) -> frozenset[str]:
    """``local_axes`` as names: axes of this mesh, an outer prefix of its typed axes (outermost first)."""
    if isinstance(axes, (str, MeshAxis, dist.ProcessGroup)):
        axes = (axes,)
    names: list[str] = []
    for a in axes:
        found = _resolve_in(mesh, a, "set_current_mesh(local_axes=...)")
        if len(found) > 1:
            raise ValueError(f"set_current_mesh(local_axes=...): {a!r} is several axes {found}; name each")
        if found and found[0] in names:
            raise ValueError(f"set_current_mesh(local_axes=...): axis '{found[0]}' is given twice")
        names.extend(found)
    if names:
        order = sorted(mesh.typed_axes, key=lambda n: -mesh.region(n).outer_stride())
        if set(order[: len(names)]) != set(names):
            raise ValueError(
                f"set_current_mesh(local_axes=...): local axes come before every global axis, outermost first "
                f"({', '.join(order)}); got ({', '.join(names)})"
            )
    return frozenset(names)


def current_mesh() -> Mesh | None:
    """The innermost mesh set on this thread, or None."""
    return _MESHES.top


def current_mesh_axes() -> frozenset[MeshAxis] | None:
    """The published API's ``spmd.current_mesh()``: the current mesh's axes of more than one rank, or None.

    Example::

        tokens = spmd.reinterpret_mesh(tokens, spmd.current_mesh())
    """
    mesh = current_mesh()
    return None if mesh is None else frozenset(mesh.region(n) for n in mesh.typed_axes)


def current_mesh_names() -> dict[str, MeshAxis] | None:
    """``{name: MeshAxis}`` for the current mesh's axes of more than one rank, or None."""
    mesh = current_mesh()
    return None if mesh is None else {n: mesh.region(n) for n in mesh.typed_axes}


def current_mesh_all_names() -> dict[str, MeshAxis] | None:
    """``{name: MeshAxis}`` for every axis of the current mesh (size 1 included), or None."""
    mesh = current_mesh()
    return None if mesh is None else {n: mesh.region(n) for n in mesh.axis_names}


def _current_name(region: MeshAxis) -> str | None:
    """The innermost current mesh's name for ``region`` (how ``repr(MeshAxis)`` prefers to show it)."""
    mesh = current_mesh()
    if mesh is None or region.size() <= 1:
        return None
    found = mesh.axes_for_region(region)
    return found[0] if found is not None and len(found) == 1 else None


_axes.CURRENT_NAME[0] = _current_name


def _entries_equal(a: object, b: object) -> bool:
    """Two partition-spec entries stand for the same regions in the same order (axes of one rank left out): a
    dim sharded over several axes is split major to minor in the order given, so ``("tp", "dp")`` is not
    ``("dp", "tp")``. A name is read on the current mesh; one it does not have matches a region that a mesh
    gave that name."""
    ra, rb = _entry_regions(a), _entry_regions(b)
    if ra is None or rb is None or len(ra) != len(rb):
        return False
    return all(_same_axis(x, y) for x, y in zip(ra, rb))


def _same_axis(x: object, y: object) -> bool:
    if x == y:
        return True
    if isinstance(x, str) and not isinstance(y, str):
        return x in y.names  # type: ignore[attr-defined]
    if isinstance(y, str) and not isinstance(x, str):
        return y in x.names  # type: ignore[attr-defined]
    return False


def _entry_regions(entry: object) -> list | None:
    """The regions (of more than one rank) an entry stands for, in its order; a name not on the current mesh
    stays a name."""
    axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    out: list = []
    mesh = current_mesh()
    for a in axes:
        if isinstance(a, str):
            if mesh is None or a not in mesh.groups:  # matched against the other side's regions' names
                if a not in out:
                    out.append(a)
                continue
            region = mesh.region(a)
        elif isinstance(a, MeshAxis):
            region = a
        else:
            try:
                region = region_of_group(a)
            except TypeError:
                return None
        if region.size() > 1 and region not in out:
            out.append(region)
    return out


_types.ENTRY_EQUAL[0] = _entries_equal


def mesh_stack() -> tuple[Mesh, ...]:
    """Every mesh set on this thread, outermost first."""
    return tuple(_MESHES.stack)


def require_mesh(what: str) -> Mesh:
    mesh = current_mesh()
    if mesh is None:
        raise RuntimeError(
            f"{what} needs a current mesh: wrap the code in `with spmd.set_current_mesh(mesh):`"
        )
    return mesh


def resolve_axis(axis: Axis) -> str:
    """The mesh axis name for ``axis`` (a name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh).

    An unknown name is an error that lists the names the current mesh has; a
    group over several axes is an error here (see :func:`resolve_axes`).
    """
    mesh = current_mesh()
    if isinstance(axis, str):
        if mesh is None:
            raise RuntimeError(
                f"axis {axis!r} is a name, but no mesh is current: wrap the code in "
                "`with spmd.set_current_mesh(mesh):`"
            )
        name = axis_key_name(axis)
        if name not in mesh.groups:
            group = group_named(name)  # a process group's registered name (torchtitan passes group_name)
            if group is not None:
                return resolve_axis(group)
            known = ", ".join(repr(a) for a in mesh.axis_names)
            raise ValueError(f"unknown mesh axis {name!r}; the current mesh has axes {known}")
        return name
    if isinstance(axis, DeviceMesh):
        if axis.ndim != 1 or not axis.mesh_dim_names:
            raise ValueError("an axis given as a DeviceMesh must be 1-D with a mesh_dim_name")
        name = axis.mesh_dim_names[0]
        if mesh is not None and name not in mesh.groups:
            _register_extra_axis(mesh, name, axis.get_group())
        return name
    if mesh is not None and isinstance(axis, dist.ProcessGroup):
        for name, group in mesh.groups.items():
            if group is axis:
                return name
    is_object = isinstance(axis, (dist.ProcessGroup, MeshAxis)) or hasattr(axis, "__mesh_axis__")
    found = _resolve_in(mesh, axis, "axis") if (mesh is not None and is_object) else None
    if found is not None and len(found) == 1:
        return found[0]
    if is_object:
        if found and len(found) > 1:
            raise ValueError(f"this {type(axis).__name__} runs over several axes of the current mesh "
                             f"{found}; here one axis is needed")
        raise ValueError(
            f"this {type(axis).__name__} is not an axis of the current mesh; name it in "
            "spmd.set_current_mesh({'name': group, ...}) first"
        )
    raise TypeError(
        f"axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got {type(axis).__name__}"
    )


def resolve_axes(axis: Axis) -> tuple[str, ...]:
    """The typed axes ``axis`` stands for: one, several (a group over a flattened region), or none (size 1)."""
    mesh = current_mesh()
    if mesh is None:
        resolve_axis(axis)  # raises the no-mesh error
    if isinstance(axis, (dist.ProcessGroup, MeshAxis)) or hasattr(axis, "__mesh_axis__"):
        return _resolve_in(mesh, axis, "axis")  # type: ignore[arg-type]
    name = resolve_axis(axis)
    return (name,) if mesh.sizes()[name] > 1 else ()  # type: ignore[union-attr]


def _resolve_in(mesh: Mesh, axis: Any, what: str) -> tuple[str, ...]:
    """Names of ``mesh``'s typed axes that ``axis`` covers (raising when it covers none)."""
    if isinstance(axis, str):
        name = axis_key_name(axis)
        if name not in mesh.groups:
            group = group_named(name)
            if group is not None:
                return _resolve_in(mesh, group, what)
            known = ", ".join(repr(a) for a in mesh.axis_names)
            raise ValueError(f"unknown mesh axis {name!r}; the current mesh has axes {known}")
        return (name,) if mesh.sizes()[name] > 1 else ()
    if isinstance(axis, dist.ProcessGroup):
        for name, group in mesh.groups.items():
            if group is axis:
                return (name,) if mesh.sizes()[name] > 1 else ()
    if isinstance(axis, MeshAxis):
        region = axis
    elif isinstance(axis, dist.ProcessGroup) or hasattr(axis, "__mesh_axis__"):
        region = region_of_group(axis)
    else:
        raise TypeError(f"{what} must be a mesh axis name, a ProcessGroup or a MeshAxis, got {type(axis).__name__}")
    found = mesh.axes_for_region(region)
    if found is None:
        raise ValueError(
            f"this {type(axis).__name__} (ranks {region.layout_str()}) is not an axis, nor a flattening of axes, of the "
            f"current mesh ({', '.join(f'{n}={mesh.region(n).layout_str()}' for n in mesh.typed_axes)})"
        )
    return found


def group_named(name: str) -> dist.ProcessGroup | None:
    """The process group registered under ``name`` (``group.group_name``), or None."""
    if not dist.is_available() or not dist.is_initialized() or not name:
        return None
    try:
        return resolve_process_group(name)
    except Exception:  # no group by that name
        return None


def _register_extra_axis(mesh: Mesh, name: str, group: dist.ProcessGroup) -> None:
    mesh.groups[name] = group
    mesh.axis_names = mesh.axis_names + (name,)
    mesh._global_axes.clear()
    mesh._typed = mesh._space = None
    mesh._by_region.clear()


def axis_group(name: str) -> dist.ProcessGroup:
    """The process group of axis ``name`` in the current mesh."""
    return require_mesh("a collective").groups[name]


def axis_size(name: str) -> int:
    return require_mesh("a collective").size(name)
