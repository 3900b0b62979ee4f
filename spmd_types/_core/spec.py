"""Partition specs inside the package: per tensor dim, the mesh axes that shard it.

A spec is a tuple with one entry per tensor dim; each entry is a tuple of mesh
axis names, major to minor (``()`` for an unsharded dim). Only axes checked in
global SPMD appear, and only where the tensor is V on them.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import torch

from .types import PartitionSpec, SpmdType, TypeMap, _is_axis_object

__all__ = ["Spec", "normalize", "to_partition_spec", "spec_from_shards", "global_shape", "format_shape", "axes_of"]

Spec = tuple[tuple[str, ...], ...]

DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def short_dtype(dtype: torch.dtype) -> str:
    return DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def normalize(ps: Sequence[str | tuple[str, ...] | None], ndim: int, what: str = "partition spec") -> Spec:
    """A user PartitionSpec as a Spec of ``ndim`` entries (missing trailing dims are unsharded)."""
    if not isinstance(ps, (tuple, list)):
        raise TypeError(
            f"{what} must be a PartitionSpec or a tuple of entries (None, an axis name or a tuple of axis names), "
            f"one per tensor dim; got {ps!r}"
        )
    for entry in ps:
        ok = entry is None or isinstance(entry, str) or _is_axis_object(entry) or (
            isinstance(entry, (tuple, list)) and all(isinstance(a, str) or _is_axis_object(a) for a in entry)
        )
        if not ok:
            raise TypeError(f"{what} entries are None, an axis name or a tuple of axis names; got {entry!r}")
    if len(ps) > ndim:
        raise ValueError(f"{what} {tuple(ps)!r} has {len(ps)} entries for a {ndim}-d tensor")
    out: list[tuple[str, ...]] = []
    for entry in ps:
        if entry is None:
            out.append(())
        elif isinstance(entry, str) or _is_axis_object(entry):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    out.extend(() for _ in range(ndim - len(out)))
    return tuple(out)


def check_unique(spec: Spec, shown: Sequence[object]) -> None:
    """A mesh axis shards at most one dim, once."""
    seen: set[str] = set()
    for entry in spec:
        for axis in entry:
            if axis in seen:
                raise ValueError(f"mesh axis {axis!r} appears twice in partition spec {tuple(shown)!r}")
            seen.add(axis)


def to_partition_spec(spec: Spec) -> PartitionSpec:
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in spec))


def spec_from_shards(types: Mapping[str, SpmdType], ndim: int, order: Iterable[str]) -> Spec:
    """The spec that S(d) entries of a type dict describe (axes in mesh order within a dim)."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for axis in order:
        t = types.get(axis)
        dim = getattr(t, "dim", None)
        if dim is None:
            continue
        if not -ndim <= dim < ndim:
            raise ValueError(f"S({dim}) on axis {axis!r} is out of range for a {ndim}-d tensor")
        dims[dim % ndim].append(axis)
    return tuple(tuple(d) for d in dims)


def axes_of(spec: Spec) -> set[str]:
    return {a for entry in spec for a in entry}


def factor(entry: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in entry)


def global_shape(local: Sequence[int], spec: Spec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(n * factor(e, sizes) for n, e in zip(local, spec))


def format_shape(local: Sequence[int], spec: Spec | None, sizes: Mapping[str, int]) -> str:
    """``8,16@tp`` (global sizes, then the axes that shard each dim)."""
    if spec is None:
        return ",".join(str(n) for n in local)
    parts = []
    for n, e in zip(local, spec):
        size = n * factor(e, sizes)
        parts.append(f"{size}@{','.join(e)}" if e else str(size))
    return ",".join(parts)


def check_placement(types: TypeMap, spec: Spec, global_axes: Iterable[str]) -> str | None:
    """Why ``spec`` does not fit ``types`` on the global axes, or None if it does."""
    placed = axes_of(spec)
    for axis in placed:
        t = types.get(axis)
        if t is None or not t.is_varying:
            return f"axis '{axis}' shards a dim in the partition spec, but the tensor is {t} on it, not V"
    for axis in global_axes:
        t = types.get(axis)
        if t is not None and t.is_varying and axis not in placed:
            return (
                f"the tensor is V on axis '{axis}', which is checked in global SPMD, but no dim is sharded "
                "on it: say how it reassembles with S(d) or partition_spec="
            )
    return None
