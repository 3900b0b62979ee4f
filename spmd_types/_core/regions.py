"""An axis given in any spelling, as its region of ranks: ``normalize_axis`` (the published API's name).

Example::

    spmd.normalize_axis("tp") == spmd.MeshAxis.of(tp_group)   # True
"""

from __future__ import annotations

from typing import Any

from .axes import MeshAxis

__all__ = ["normalize_axis"]


def normalize_axis(axis: Any) -> MeshAxis:
    """The :class:`MeshAxis` (region of ranks) an axis stands for: a name of the current mesh, a group, a MeshAxis.

    Example::

        spmd.normalize_axis("tp") == spmd.MeshAxis.of(tp_group)   # True
    """
    from .axes import region_of_group
    from .mesh import current_mesh, resolve_axis

    if isinstance(axis, MeshAxis):
        return axis
    if isinstance(axis, str):
        mesh = current_mesh()
        if mesh is None or axis not in mesh.groups:  # a process group's registered name, if it is one
            from .mesh import group_named

            group = group_named(axis)
            if group is not None:
                return region_of_group(group)
        name = resolve_axis(axis)  # no current mesh: an error saying so, before the mesh is read
        return mesh.region(name)  # type: ignore[union-attr]
    return region_of_group(axis)
