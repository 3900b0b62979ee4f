"""The current mesh: axis names, their process groups, a per-thread stack.

A mesh is a named ``DeviceMesh`` or a ``{name: ProcessGroup}`` dict. The stack
is thread-local, so two threads may typecheck against different meshes at once.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Mapping, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Mesh", "set_current_mesh", "current_mesh", "resolve_axis", "Axis"]

Axis = Union[str, dist.ProcessGroup, DeviceMesh]


class Mesh:
    """Axis names in order, with the process group of each axis."""

    __slots__ = ("axis_names", "groups", "device_mesh", "_sizes", "_global_axes")

    def __init__(
        self,
        axis_names: tuple[str, ...],
        groups: dict[str, dist.ProcessGroup],
        device_mesh: DeviceMesh | None,
    ) -> None:
        self.axis_names = axis_names
        self.groups = groups
        self.device_mesh = device_mesh
        self._sizes: dict[str, int] | None = None
        self._global_axes: dict[frozenset, frozenset] = {}

    @classmethod
    def from_user(cls, mesh: DeviceMesh | Mapping[str, dist.ProcessGroup]) -> Mesh:
        if isinstance(mesh, DeviceMesh):
            names = mesh.mesh_dim_names
            if not names:
                raise ValueError(
                    "set_current_mesh needs a DeviceMesh with mesh_dim_names, e.g. "
                    "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp'))"
                )
            groups = {n: mesh.get_group(n) for n in names}
            return cls(tuple(names), groups, mesh)
        if isinstance(mesh, Mapping):
            if not mesh:
                raise ValueError("set_current_mesh: the mesh has no axes")
            seen: dict[int, str] = {}
            for name, group in mesh.items():
                if not isinstance(name, str):
                    raise TypeError(f"mesh axis names must be str, got {name!r}")
                if not name:
                    raise ValueError("set_current_mesh: mesh axis names must be non-empty")
                if not isinstance(group, dist.ProcessGroup):
                    raise TypeError(
                        f"mesh axis {name!r} must map to a ProcessGroup, got {type(group).__name__}"
                    )
                if id(group) in seen:
                    raise ValueError(
                        f"set_current_mesh: axes '{seen[id(group)]}' and '{name}' are the same process group; "
                        "a mesh axis is one group, named once"
                    )
                seen[id(group)] = name
            return cls(tuple(mesh), dict(mesh), None)
        raise TypeError(
            "set_current_mesh takes a DeviceMesh with mesh_dim_names or a "
            f"{{name: ProcessGroup}} dict, got {type(mesh).__name__}"
        )

    def size(self, axis: str) -> int:
        return self.sizes()[axis]

    def sizes(self) -> dict[str, int]:
        """``{axis: number of ranks}``, computed once."""
        if self._sizes is None or len(self._sizes) != len(self.groups):
            self._sizes = {name: dist.get_world_size(g) for name, g in self.groups.items()}
        return self._sizes

    def global_axes(self, local_axes: frozenset) -> frozenset:
        """The axes checked in global SPMD when ``local_axes`` stay local."""
        found = self._global_axes.get(local_axes)
        if found is None:
            found = self._global_axes[local_axes] = frozenset(a for a in self.axis_names if a not in local_axes)
        return found

    def __repr__(self) -> str:
        return f"Mesh({', '.join(self.axis_names)})"


class _MeshStack(threading.local):
    stack: list[Mesh]

    def __init__(self) -> None:
        self.stack = []


_MESHES = _MeshStack()


@contextlib.contextmanager
def set_current_mesh(mesh: DeviceMesh | Mapping[str, dist.ProcessGroup]) -> Iterator[Mesh]:
    """Make ``mesh`` the current mesh for this thread inside the ``with`` block.

    Example::

        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            x = spmd.assert_type(x, {"dp": spmd.V, "tp": spmd.R})
    """
    m = Mesh.from_user(mesh)
    _MESHES.stack.append(m)
    try:
        yield m
    finally:
        _MESHES.stack.pop()


def current_mesh() -> Mesh | None:
    """The innermost mesh set on this thread, or None."""
    stack = _MESHES.stack
    return stack[-1] if stack else None


def require_mesh(what: str) -> Mesh:
    mesh = current_mesh()
    if mesh is None:
        raise RuntimeError(
            f"{what} needs a current mesh: wrap the code in `with spmd.set_current_mesh(mesh):`"
        )
    return mesh


def resolve_axis(axis: Axis) -> str:
    """The mesh axis name for ``axis`` (a name, a ProcessGroup or a 1-D DeviceMesh).

    An unknown name is an error that lists the names the current mesh has.
    """
    mesh = current_mesh()
    if isinstance(axis, str):
        if mesh is None:
            raise RuntimeError(
                f"axis {axis!r} is a name, but no mesh is current: wrap the code in "
                "`with spmd.set_current_mesh(mesh):`"
            )
        if axis not in mesh.groups:
            known = ", ".join(repr(a) for a in mesh.axis_names)
            raise ValueError(f"unknown mesh axis {axis!r}; the current mesh has axes {known}")
        return axis
    if isinstance(axis, DeviceMesh):
        if axis.ndim != 1 or not axis.mesh_dim_names:
            raise ValueError("an axis given as a DeviceMesh must be 1-D with a mesh_dim_name")
        name = axis.mesh_dim_names[0]
        if mesh is not None and name not in mesh.groups:
            _register_extra_axis(mesh, name, axis.get_group())
        return name
    if isinstance(axis, dist.ProcessGroup):
        if mesh is not None:
            for name, group in mesh.groups.items():
                if group is axis:
                    return name
        raise ValueError(
            "this ProcessGroup is not an axis of the current mesh; name it in "
            "spmd.set_current_mesh({'name': group, ...}) first"
        )
    raise TypeError(
        f"axis must be a mesh axis name, a ProcessGroup or a 1-D DeviceMesh, got {type(axis).__name__}"
    )


def _register_extra_axis(mesh: Mesh, name: str, group: dist.ProcessGroup) -> None:
    mesh.groups[name] = group
    mesh.axis_names = mesh.axis_names + (name,)
    mesh._global_axes.clear()


def axis_group(name: str) -> dist.ProcessGroup:
    """The process group of axis ``name`` in the current mesh."""
    return require_mesh("a collective").groups[name]


def axis_size(name: str) -> int:
    return require_mesh("a collective").size(name)
