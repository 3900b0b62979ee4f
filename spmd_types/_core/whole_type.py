"""The published API's whole-tensor type ``SpmdType(local_type, partition_spec)`` and ``merge_types``.

``spmd.SpmdType`` is the class of every SPMD type; called with a type dict it
builds a :class:`TensorSpmdType`: a tensor's per-axis types (``S(d)`` kept as
written until a tensor's rank resolves it) and, optionally, its partition spec.
``merge_types`` joins partial types (dicts, whole types, a partition spec, one
bare type that fills the current mesh's other axes) into one; ``assert_type``
takes the same parts.

Example::

    t = spmd.SpmdType({"dp": spmd.S(0), "tp": spmd.R})
    spmd.assert_type(x, t)
    spmd.merge_types(spmd.R, {"cp": spmd.V})   # R on every axis of the current mesh but cp
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import SpmdTypeError
from .types import WHOLE_TYPE, AxisType, PartitionSpec, PerMeshAxisLocalSpmdType, Shard, SpmdType, V, check_type_value

__all__ = ["TensorSpmdType", "merge_types", "type_args"]


def _shown(axis: Any) -> str:
    """An axis as a message shows it: a name quoted, a group or MeshAxis by its region's name."""
    if isinstance(axis, str):
        return repr(str.__str__(axis))
    from .axes import MeshAxis, region_of_group

    try:
        return repr(axis if isinstance(axis, MeshAxis) else region_of_group(axis))
    except TypeError:
        return repr(axis)


def _entry_axes(entry: Any) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


class TensorSpmdType(SpmdType):
    """A tensor's whole SPMD type: ``local_type`` (``{axis: R | I | V | P | S(d)}``) and a ``partition_spec``.

    Built by ``spmd.SpmdType(local_type, partition_spec=None)``, the published
    API's call. ``S(d)`` entries and a partition spec are two spellings of a
    layout, so a type holds one or the other; an axis the spec places is V.

    Example::

        t = spmd.SpmdType({"dp": spmd.V, "tp": spmd.R}, partition_spec=spmd.PartitionSpec("dp", None))
        spmd.assert_type(x, t)
    """

    __slots__ = ("local_type", "partition_spec")

    def __init__(self, local_type: Mapping[Any, Any], partition_spec: Any = None) -> None:
        if not isinstance(local_type, Mapping):
            raise TypeError(f"SpmdType(local_type, partition_spec=None): local_type is a dict {{axis: type}}, got "
                            f"{local_type!r}")
        local = {axis: check_type_value(t, f"SpmdType: the type on axis {_shown(axis)}")
                 for axis, t in local_type.items()}
        if partition_spec is not None:
            partition_spec = _checked_spec(local, partition_spec)
        self.local_type = local
        self.partition_spec = partition_spec

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorSpmdType):
            return NotImplemented
        return self.local_type == other.local_type and self.partition_spec == other.partition_spec

    __hash__ = None  # type: ignore[assignment]  # a dict inside, as the published dataclass

    def __repr__(self) -> str:
        return f"SpmdType(local_type={self.local_type!r}, partition_spec={self.partition_spec!r})"


WHOLE_TYPE[0] = TensorSpmdType


def _checked_spec(local: dict, spec: Any) -> PartitionSpec:
    if not isinstance(spec, PartitionSpec):
        spec = PartitionSpec(*spec)
    shards = [a for a, t in local.items() if isinstance(t, Shard)]
    if shards:
        raise SpmdTypeError(f"SpmdType: S(d) on {', '.join(_shown(a) for a in shards)} and a partition_spec both "
                            "say where shards lie; give one of them")
    for d, entry in enumerate(spec):
        if isinstance(entry, tuple) and not entry:
            raise ValueError(f"SpmdType: partition_spec entry {d} is an empty tuple; a dim nothing shards is None")
        for axis in _entry_axes(entry):
            t = local.get(axis)
            if t is not None and t is not V:
                raise SpmdTypeError(f"SpmdType: the partition spec places axis {_shown(axis)} on dim {d}, which "
                                    f"makes it V, but local_type says {t}")
    return spec


def _is_type_dict(arg: Any) -> bool:
    return isinstance(arg, Mapping) or (hasattr(arg, "items") and not isinstance(arg, (AxisType, PartitionSpec)))


def merge_types(*types: Any) -> TensorSpmdType:
    """Join partial types into one :class:`TensorSpmdType` (``spmd.SpmdType``).

    Each argument is a type dict, a whole ``SpmdType``, a ``PartitionSpec``, one
    bare R, I, V or P, or None (skipped). Dicts agree on an axis they share (keys
    compared as written), partition specs are equal, and the bare type fills
    every axis of the current mesh that nothing else names (a spec's axes count
    as named).

    Example::

        spmd.merge_types(spmd.R, {"cp": spmd.V})   # {dp: R, cp: V, tp: R} on a (dp, cp, tp) mesh
    """
    local, spec = _merged(types, "merge_types")
    return TensorSpmdType(local, spec)


def _merged(types: tuple, what: str) -> tuple[dict, Any]:
    local: dict = {}
    specs: list = []
    default = None
    for arg in types:
        if arg is None:
            continue
        if isinstance(arg, PerMeshAxisLocalSpmdType):
            if default is not None:
                raise TypeError(f"{what} takes at most one bare type (it fills the axes nothing else names); "
                                f"got {default} and {arg}")
            default = arg
            continue
        if isinstance(arg, Shard):
            raise TypeError(f"a bare {arg} names no axis: give it in a dict, {{axis: {arg}}}")
        if isinstance(arg, PartitionSpec):
            specs.append(arg)
            continue
        if isinstance(arg, TensorSpmdType):
            if arg.partition_spec is not None:
                specs.append(arg.partition_spec)
            arg = arg.local_type
        if not _is_type_dict(arg):
            raise TypeError(f"{what} takes types as a dict {{axis: type}}, e.g. {{'tp': spmd.R}}, an spmd.SpmdType, a "
                            f"PartitionSpec, or one of R, I, V, P; got {arg!r}")
        for axis, t in arg.items():
            if axis in local and local[axis] is not t:
                raise SpmdTypeError(f"axis {_shown(axis)} is given two types, {local[axis]} and {t}; an axis has "
                                    "one type")
            local[axis] = check_type_value(t, f"the type on axis {_shown(axis)}")
    spec = _one_spec(specs)
    if default is not None:
        local.update(_fill(default, local, spec))
    return local, spec


def _one_spec(specs: list) -> Any:
    if not specs:
        return None
    first = specs[0]
    for other in specs[1:]:
        if other != first:
            raise SpmdTypeError(f"two partition specs disagree: {first!r} and {other!r}")
    return first


def _fill(default: AxisType, local: dict, spec: Any) -> dict:
    """``{name: default}`` for the current mesh's typed axes that ``local`` and ``spec`` do not name."""
    from .mesh import current_mesh, resolve_axes

    mesh = current_mesh()
    if mesh is None:
        raise SpmdTypeError(f"a bare {default} stands for every axis of the current mesh, and no mesh is current: "
                            "give a dict {axis: type}, or set one with spmd.set_current_mesh(mesh)")
    named = {n for axis in local for n in resolve_axes(axis)}
    if spec is not None:
        named |= {n for entry in spec for axis in _entry_axes(entry) for n in resolve_axes(axis)}
    return {n: default for n in mesh.typed_axes if n not in named}


def type_args(first: Any, more: tuple, partition_spec: Any) -> tuple[Any, Any]:
    """``assert_type(t, *types, partition_spec=)``'s parts as one type (a dict or a bare type) and one spec.

    A last part that is no type (a tuple, a list) is a partition spec given by
    position (``assert_type(t, types, spec)``, this package's older form).
    """
    parts = tuple(p for p in (first,) + more if p is not None)
    if len(parts) >= 2 and not _is_type_part(parts[-1]):  # assert_type(t, types, spec): the spec by position
        if partition_spec is not None:
            raise TypeError("assert_type: the partition spec is given twice, by position and as partition_spec=")
        parts, partition_spec = parts[:-1], parts[-1]
    if len(parts) == 1 and (type(parts[0]) is dict or (isinstance(parts[0], AxisType) and partition_spec is None)):
        return parts[0], partition_spec
    if partition_spec is not None:
        parts += (partition_spec if isinstance(partition_spec, PartitionSpec) else PartitionSpec(*partition_spec),)
    if all(isinstance(p, PartitionSpec) for p in parts):
        raise TypeError("assert_type needs a type: a dict {axis: type}, an spmd.SpmdType, or one of R, I, V, P")
    if len(parts) == 1 and isinstance(parts[0], PerMeshAxisLocalSpmdType):
        return parts[0], None
    return _merged(parts, "assert_type")


def _is_type_part(p: Any) -> bool:
    return isinstance(p, (AxisType, PartitionSpec, TensorSpmdType)) or _is_type_dict(p)
