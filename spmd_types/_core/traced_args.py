"""The arguments of an spmd call's graph node: graph constants, and the types they stand for.

A graph node's arguments must be graph constants (str, int, float, bool, dtypes, tensors, and tuples,
lists and dicts of them). :func:`encode` spells the rest as tagged tuples: a type ``(TYPE_TAG, "S(0)")``,
None, a partition spec, a process group (by name), a device mesh (axis names and group names), a
``MeshAxis`` (its ranks). :func:`decode` reads them back.

A type read while dynamo traces (``spmd.get_local_type(x)``, ``get_partition_spec(x)``) is not known
yet: the graph is checked after it is traced. It is a :class:`TypeRef` or :class:`SpecRef` to ``x``,
which an spmd call may take as an argument (``assert_type(out, get_local_type(q), get_partition_spec(q))``,
torchtitan's way of typing a kernel's output like its input); the checker resolves it to ``x``'s types.
A partition spec's entries can be picked (``q_ps[1]``, ``q_ps[:-1]``) and built into a new spec.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._torch.private import resolve_process_group
from .axes import MeshAxis
from .types import PartitionSpec, Shard, SpmdType, _by_short_name

__all__ = ["encode", "decode", "TypeRef", "SpecRef", "SpecItem", "RESOLVERS", "unknown_in_trace"]

TYPE_TAG = "spmd_types.type"
SPEC_TAG = "spmd_types.partition_spec"
GROUP_TAG = "spmd_types.group"
MESH_TAG = "spmd_types.device_mesh"
AXIS_TAG = "spmd_types.mesh_axis"
SET_TAG = "spmd_types.frozenset"
REF_TAG = "spmd_types.ref"
ITEM_TAG = "spmd_types.spec_item"
NONE = ("spmd_types.none",)  # None is no graph constant

# "local_type" / "type" / "spec" -> reading a typed value (the checker layer registers them)
RESOLVERS: dict[str, Callable[[Any], Any]] = {}
_NO_SPEC = object()  # a spec entry of a value that has no partition spec: the spec built from it is None


_UNKNOWN = (
    "a type read inside torch.compile is known only when the graph is checked, after dynamo traced it: hand it "
    "to an spmd call (spmd.assert_type(y, spmd.get_local_type(x))), or read it outside the compiled function"
)


def unknown_in_trace(what: str) -> NotImplementedError:
    """The error for Python code that would branch on a type inside a compiled function."""
    return NotImplementedError(f"{what}: {_UNKNOWN}")


class TypeRef:
    """A type read while dynamo traces: ``kind`` ("local_type" or "type") of ``tensor``, resolved when checked."""

    def __init__(self, tensor: torch.Tensor, kind: str) -> None:
        self.tensor = tensor
        self.kind = kind

    def _refuse(self, *args: Any) -> Any:
        raise unknown_in_trace(f"spmd.get_{self.kind}(x)[...]")

    __getitem__ = __iter__ = __len__ = __contains__ = keys = items = values = get = _refuse


class SpecRef:
    """``get_partition_spec(tensor)`` while dynamo traces: its entries can be picked before it is known."""

    def __init__(self, tensor: torch.Tensor, ndim: int) -> None:
        self.tensor = tensor
        self.ndim = ndim

    def __len__(self) -> int:
        return self.ndim

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(SpecItem(self.tensor, j) for j in range(self.ndim)[i])
        return SpecItem(self.tensor, range(self.ndim)[i])

    def __iter__(self) -> Any:
        return iter([SpecItem(self.tensor, j) for j in range(self.ndim)])


class SpecItem:
    """Entry ``index`` of ``tensor``'s partition spec, while dynamo traces."""

    _spmd_deferred = True  # a PartitionSpec may hold it until the graph is checked

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self.tensor = tensor
        self.index = index


def encode(value: Any) -> Any:
    """``value`` as graph constants (see the module docstring)."""
    if isinstance(value, (torch.Tensor, str, int, float, bool, torch.dtype)):
        return value
    if value is None:
        return NONE
    if isinstance(value, SpmdType):
        return (TYPE_TAG, value._short)
    if isinstance(value, PartitionSpec):
        return (SPEC_TAG, tuple(encode(e) for e in value))
    if isinstance(value, (tuple, list)):
        return type(value)(encode(v) for v in value)
    if isinstance(value, dict):
        return {encode(k): encode(v) for k, v in value.items()}
    if isinstance(value, frozenset):
        return (SET_TAG, tuple(encode(v) for v in value))
    if isinstance(value, TypeRef):
        return (REF_TAG, value.kind, value.tensor)
    if isinstance(value, SpecRef):
        return (REF_TAG, "spec", value.tensor)
    if isinstance(value, SpecItem):
        return (ITEM_TAG, value.tensor, value.index)
    if isinstance(value, MeshAxis):
        return (AXIS_TAG, value.atoms, tuple(sorted(value._ranks)) if value._ranks is not None else NONE)
    if isinstance(value, torch.distributed.ProcessGroup):
        return (GROUP_TAG, value.group_name)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(value, DeviceMesh):
        names = value.mesh_dim_names
        return (MESH_TAG, tuple((n, value.get_group(n).group_name) for n in names))
    raise NotImplementedError(
        f"an spmd call inside torch.compile takes arguments that can be graph constants (str, int, types, "
        f"partition specs, process groups, meshes, tuples and dicts of them); got {type(value).__name__}"
    )


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if type(value) is tuple and value and type(value[0]) is str:
        tag = value[0]
        if tag == NONE[0] and len(value) == 1:
            return None
        if tag == TYPE_TAG:
            short = value[1]
            return Shard(int(short[2:-1])) if short.startswith("S(") else _by_short_name(short)
        if tag == SPEC_TAG:
            entries = [decode(e) for e in value[1]]
            return None if any(e is _NO_SPEC for e in entries) else PartitionSpec(*entries)
        if tag == GROUP_TAG:
            return resolve_process_group(value[1])
        if tag == MESH_TAG:
            return {n: resolve_process_group(g) for n, g in value[1]}
        if tag == AXIS_TAG:
            ranks = decode(value[2])
            return MeshAxis(value[1], None if ranks is None else frozenset(ranks))
        if tag == SET_TAG:
            return frozenset(decode(v) for v in value[1])
        if tag == REF_TAG:
            return RESOLVERS[value[1]](value[2])
        if tag == ITEM_TAG:
            spec = RESOLVERS["spec"](value[1])
            return _NO_SPEC if spec is None else spec[value[2]]
    if isinstance(value, (tuple, list)):
        return type(value)(decode(v) for v in value)
    if isinstance(value, dict):
        return {decode(k): decode(v) for k, v in value.items()}
    return value
