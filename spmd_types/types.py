"""The type names of the published ``spmd_types`` API (``spmd_types.types``), on this package's values.

``R``, ``I``, ``V``, ``P`` and ``S(d)``/``Shard(d)`` are this package's type
values (one object each; ``Shard`` is a class, ``isinstance(t, Shard)``
works). The aliases below are the published names used in type hints.

Example::

    from spmd_types.types import PerMeshAxisSpmdType, Shard
    def placement(t: PerMeshAxisSpmdType) -> str:
        return f"shard {t.dim}" if isinstance(t, Shard) else str(t)
"""

from __future__ import annotations

from typing import Any, Dict, Tuple, Union

import torch.distributed as dist

from ._core.axes import MeshAxis
from ._core.errors import SpmdTypeError
from ._core.types import (
    I,
    Invariant,
    P,
    Partial,
    PartitionSpec,
    PerMeshAxisLocalSpmdType,
    R,
    Replicate,
    S,
    Shard,
    SpmdType,
    V,
    Varying,
    backward_type,
)

__all__ = [
    "R", "I", "V", "P", "S", "Shard", "Replicate", "Invariant", "Varying", "Partial",
    "SpmdType", "PerMeshAxisSpmdType", "PerMeshAxisLocalSpmdType", "PerMeshAxisSpmdTypes", "LocalSpmdType",
    "DeviceMeshAxis", "PartitionSpec", "PartitionSpecEntry", "DimSharding", "TensorSharding", "MeshAxis",
    "SpmdTypeError", "backward_type", "normalize_axis", "normalize_mesh", "normalize_partition_spec", "format_axis",
]

PerMeshAxisSpmdType = SpmdType
"""One axis's type: R, I, V, P or S(d) (the published name of :class:`SpmdType`)."""

DeviceMeshAxis = Union[str, dist.ProcessGroup, MeshAxis]
"""An axis as a type dict's key: a name (str or StrEnum), a ProcessGroup or a MeshAxis."""

PerMeshAxisSpmdTypes = Dict[Any, SpmdType]
"""A type dict ``{axis: R | I | V | P | S(d)}`` as ``assert_type`` takes it."""

LocalSpmdType = Dict[Any, PerMeshAxisLocalSpmdType]
"""A type dict of local types only ``{axis: R | I | V | P}`` as ``get_local_type`` returns it."""

PartitionSpecEntry = Union[Any, Tuple[Any, ...], None]
"""One PartitionSpec entry: None, an axis, or a tuple of axes."""

DimSharding = Union[None, str, Tuple[str, ...]]
"""The published API's per-dim sharding by axis names: None, a name, or names."""


class TensorSharding(tuple):
    """A tuple of :data:`DimSharding`, one per tensor dim (the published API's name).

    Example::

        >>> TensorSharding(None, "tp")
        TensorSharding(None, 'tp')
    """

    def __new__(cls, *dims: DimSharding) -> TensorSharding:
        return super().__new__(cls, dims)

    def __repr__(self) -> str:
        return "TensorSharding(" + ", ".join(repr(d) for d in self) + ")"


def normalize_axis(axis: Any) -> MeshAxis:
    """The :class:`MeshAxis` (region of ranks) an axis stands for: a name of the current mesh, a group, a MeshAxis.

    Example::

        spmd.normalize_axis("tp") == spmd.MeshAxis.of(tp_group)   # True
    """
    from ._core.axes import region_of_group
    from ._core.mesh import current_mesh, resolve_axis

    if isinstance(axis, MeshAxis):
        return axis
    if isinstance(axis, str):
        mesh = current_mesh()
        return mesh.region(resolve_axis(axis))  # type: ignore[union-attr]
    return region_of_group(axis)


def normalize_mesh(axes: Any) -> frozenset[MeshAxis]:
    """The axes of more than one rank among ``axes``, as MeshAxis objects (checked to be independent dims)."""
    from ._core.axes import orthogonal

    out = frozenset(a for a in (normalize_axis(x) for x in axes) if a.size() > 1)
    if not orthogonal(list(out)):
        raise SpmdTypeError(f"the axes {sorted(map(repr, out))} are not independent dims of one mesh")
    return out


def normalize_partition_spec(spec: Any) -> PartitionSpec:
    """``spec`` with every axis resolved to the current mesh's names, axes of one rank dropped."""
    from ._core.mesh import resolve_axes

    entries = []
    for entry in spec:
        if entry is None:
            entries.append(None)
            continue
        names = tuple(n for a in (entry if isinstance(entry, tuple) else (entry,)) for n in resolve_axes(a))
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*entries)


def format_axis(axis: Any) -> str:
    """How messages show an axis: ``'tp'`` for a name, the region's name for a group or MeshAxis."""
    if isinstance(axis, str):
        return repr(str.__str__(axis))
    return repr(normalize_axis(axis))
