"""The published package's ``spmd_types._mesh_axis`` path, which torch 2.14's FSDP2 imports.

``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` does
``from spmd_types._mesh_axis import flatten_axes`` whenever ``spmd_types`` is
installed; the names here are this package's (``_core/axes.py``).

Example::

    from spmd_types._mesh_axis import MeshAxis, flatten_axes
    flatten_axes((MeshAxis.of(2, 4), MeshAxis.of(4, 1))) == MeshAxis.of(8, 1)   # True
"""

from __future__ import annotations

from ._core.axes import MeshAxis, flatten

__all__ = ["MeshAxis", "flatten_axes"]


def flatten_axes(axes: tuple[MeshAxis, ...]) -> MeshAxis:
    """The one region that several independent axes span together (a ``ValueError`` for none, or for axes that overlap).

    Example::

        flatten_axes((MeshAxis.of(2, 4), MeshAxis.of(4, 1)))   # MeshAxis(8:1)
    """
    if not axes:
        raise ValueError("flatten_axes needs at least one axis")
    return flatten(tuple(axes))
