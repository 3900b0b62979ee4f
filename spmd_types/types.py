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

from typing import Any, Dict, Iterable, Protocol, Sequence, Tuple, Union

import torch.distributed as dist

from ._core.axes import MeshAxis
from ._core.errors import DTensorPropagationError, RedistributeError, SpmdTypeError
from ._core.regions import normalize_axis
from ._core.types import (
    AxisType,
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
from ._core.whole_type import TensorSpmdType, merge_types

__all__ = [
    "R", "I", "V", "P", "S", "Shard", "Replicate", "Invariant", "Varying", "Partial",
    "SpmdType", "PerMeshAxisSpmdType", "PerMeshAxisLocalSpmdType", "PerMeshAxisSpmdTypes", "LocalSpmdType",
    "DeviceMeshAxis", "PartitionSpec", "PartitionSpecEntry", "DimSharding", "TensorSharding", "MeshAxis",
    "SpmdTypeError", "backward_type", "normalize_axis", "normalize_mesh", "normalize_partition_spec", "format_axis",
    "partition_spec_to_shard_types", "shard_types_to_partition_spec", "partition_spec_get_shard",
    "AxisType", "TensorSpmdType", "merge_types", "PerMeshAxisSpmdTypesArg", "to_local_type", "normalize_local_type",
    "normalize_dim_sharding", "RedistributeError", "DTensorPropagationError",
]

PerMeshAxisSpmdType = AxisType
"""One axis's type: R, I, V, P or S(d) (the published name of :class:`AxisType`)."""

DeviceMeshAxis = Union[str, dist.ProcessGroup, MeshAxis]
"""An axis as a type dict's key: a name (str or StrEnum), a ProcessGroup or a MeshAxis."""

PerMeshAxisSpmdTypes = Dict[Any, SpmdType]
"""A type dict ``{axis: R | I | V | P | S(d)}`` as ``assert_type`` takes it."""

LocalSpmdType = Dict[Any, PerMeshAxisLocalSpmdType]
"""A type dict of local types only ``{axis: R | I | V | P}`` as ``get_local_type`` returns it."""

class PerMeshAxisSpmdTypesArg(Protocol):
    """What ``assert_type`` takes as a type dict: anything with ``items()`` of (axis, type) pairs.

    Example::

        def annotate(x: torch.Tensor, types: PerMeshAxisSpmdTypesArg) -> torch.Tensor:
            return spmd.assert_type(x, types)
    """

    def items(self) -> Iterable[Tuple[Any, AxisType]]: ...


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


def normalize_mesh(axes: Any) -> frozenset[MeshAxis]:
    """The axes of more than one rank among ``axes``, as MeshAxis objects (checked to be independent dims)."""
    from ._core.axes import orthogonal

    out = frozenset(a for a in (normalize_axis(x) for x in axes) if a.size() > 1)
    if not orthogonal(list(out)):
        raise SpmdTypeError(f"the axes {sorted(map(repr, out))} are not independent dims of one mesh")
    return out


def normalize_partition_spec(spec: Any) -> PartitionSpec:
    """``spec`` with every axis as its :class:`MeshAxis` (names read on the current mesh), axes of one rank dropped.

    Example::

        spmd.normalize_partition_spec(spmd.PartitionSpec("tp", None))   # PartitionSpec(tp, None), tp a MeshAxis
    """
    entries: list[Any] = []
    for d, entry in enumerate(spec):
        if isinstance(entry, tuple) and not entry:
            raise ValueError(f"normalize_partition_spec: entry {d} is an empty tuple; a dim nothing shards is None")
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        regions = tuple(r for r in (normalize_axis(a) for a in axes) if r.size() > 1)
        entries.append(None if not regions else regions[0] if len(regions) == 1 else regions)
    return PartitionSpec(*entries)


def partition_spec_to_shard_types(spec: Any) -> dict[MeshAxis, Shard]:
    """``{axis: S(d)}`` for every axis that shards dim ``d`` in ``spec`` (keys :class:`MeshAxis`).

    torch 2.14's FSDP2 calls it on a parameter's partition spec. An axis placed
    on two dims is an ``SpmdTypeError``.

    Example::

        partition_spec_to_shard_types(spmd.PartitionSpec(None, "tp"))   # {tp: S(1)}
    """
    out: dict[MeshAxis, Shard] = {}
    for dim, entry in enumerate(normalize_partition_spec(spec)):
        for axis in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
            if axis in out:
                raise SpmdTypeError(f"axis {axis!r} is placed on both dim {out[axis].dim} and dim {dim} of the "
                                    "partition spec")
            out[axis] = S(dim)
    return out


def shard_types_to_partition_spec(types: Any, ndim: int, axis_order: Any = None) -> PartitionSpec:
    """The partition spec that a type dict's ``S(d)`` entries make, ``ndim`` entries long (R, I, V, P say nothing).

    Two axes sharding one dim need ``axis_order`` (outer first) to say their
    order; without it that is an ``SpmdTypeError``. Keys are kept as given.

    Example::

        shard_types_to_partition_spec({"dp": spmd.S(0), "tp": spmd.R}, 2)   # PartitionSpec('dp', None)
    """
    dims: dict[int, list[Any]] = {}
    ordered = [a for a in (axis_order or ()) if isinstance(types.get(a), Shard)]
    for axis in ordered + [a for a, t in types.items() if isinstance(t, Shard) and a not in ordered]:
        dim = types[axis].dim % ndim
        dims.setdefault(dim, []).append(axis)
        unordered = [a for a in dims[dim] if a not in ordered]
        if len(dims[dim]) > 1 and unordered:
            shown = ", ".join(format_axis(a) for a in dims[dim])
            raise SpmdTypeError(f"tensor dim {dim} is sharded on several axes ({shown}); give their order, outer "
                                "first, as axis_order=")
    return PartitionSpec(*(None if d not in dims else dims[d][0] if len(dims[d]) == 1 else tuple(dims[d])
                           for d in range(ndim)))


def partition_spec_get_shard(spec: Any, axis: Any) -> Shard | None:
    """``S(d)`` when ``axis`` shards dim ``d`` in ``spec``, else None (also for ``spec=None``).

    Example::

        partition_spec_get_shard(spmd.get_partition_spec(x), "tp")   # S(0)
    """
    if spec is None:
        return None
    return partition_spec_to_shard_types(spec).get(normalize_axis(axis))


def to_local_type(typ: AxisType) -> PerMeshAxisLocalSpmdType:
    """The local type a tensor stores for ``t``: V for ``S(d)``, ``t`` itself for R, I, V, P.

    Example::

        to_local_type(spmd.S(1))   # V
    """
    from ._core.types import check_type_value

    t = check_type_value(typ, "to_local_type")
    return V if isinstance(t, Shard) else t  # type: ignore[return-value]


def normalize_local_type(spmd_type: Any) -> dict[MeshAxis, PerMeshAxisLocalSpmdType]:
    """``types`` keyed by :class:`MeshAxis` (names read on the current mesh), axes of one rank dropped.

    Values are R, I, V or P (a ``TypeError`` otherwise); the axes must be
    independent dims of one mesh (an ``SpmdTypeError`` otherwise).

    Example::

        normalize_local_type({"tp": spmd.R, dp_group: spmd.V})   # {MeshAxis(dp): V, MeshAxis(tp): R}
    """
    out: dict[MeshAxis, PerMeshAxisLocalSpmdType] = {}
    for axis, t in spmd_type.items():
        if not isinstance(t, PerMeshAxisLocalSpmdType):
            raise TypeError(f"normalize_local_type: the type on axis {format_axis(axis)} is R, I, V or P, got {t!r}")
        region = normalize_axis(axis)
        if region.size() > 1:
            out[region] = t
    normalize_mesh(out)
    return out


def normalize_dim_sharding(dim_sharding: DimSharding) -> Sequence[str]:
    """One :data:`DimSharding` as a sequence of axis names: ``()`` for None, ``("tp",)`` for ``"tp"``."""
    if dim_sharding is None:
        return ()
    if isinstance(dim_sharding, str):
        return (dim_sharding,)
    return tuple(dim_sharding)


def format_axis(axis: Any) -> str:
    """How messages show an axis: ``'tp'`` for a name, the region's name for a group or MeshAxis."""
    if isinstance(axis, str):
        return repr(str.__str__(axis))
    return repr(normalize_axis(axis))
