"""DTensor values in ``check_equivalence``: their placements read as types, and FSDP2's strided shards as layouts.

A DTensor's mesh may name its dims otherwise than the check's mesh (torchtitan's ``fsdp`` or
``dp_shard`` mesh where the check names ``dp``): each mesh dim of more than one rank is matched
to the check's axis over the same ranks (:class:`~spmd_types._core.axes.MeshAxis`, a region), so
the placement on it is the value's type on that axis. ``Shard(d)`` is S(d), ``Replicate()`` I,
``Partial()`` P (:func:`~spmd_types.integrations.dtensor.placements.placement_to_type`).

FSDP2 shards a dim that tp shards too "right to left" (``_StridedShard(d, split_factor)``): the
dim is cut into tp chunks first and each into dp pieces, so the pieces do not nest in mesh order
and cannot be concatenated back as an S(d) value is. Such a value is S(d) on the axis, and its
layout (:func:`strided_layout`) cuts the reference value the same way; its gradients and updates
are compared rank by rank against their pieces of the reference's, as a ``layouts`` entry is.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .._core.types import S, SpmdType
from .._torch.private import strided_shard_class

__all__ = ["dtensor_placements", "dtensor_types", "strided_layouts"]

STRIDED = ("FSDP's strided shard (a dim tp shards too, cut tp first): its pieces do not nest in mesh order, so it "
           "is compared rank by rank against its piece of the reference")


def dtensor_placements(dt: Any, mesh: Any) -> list[tuple[str, Any, int]] | str:
    """``[(check axis, placement, size)]`` for each mesh dim of ``dt`` with more than one rank, in its mesh order;
    or why a dim has no axis of ``mesh`` over the same ranks."""
    from .._core.axes import MeshAxis

    names = tuple(mesh.mesh_dim_names)
    regions = {MeshAxis.of(mesh.get_group(a)): a for a, n in zip(names, mesh.mesh.shape) if n > 1}
    dt_mesh = dt.device_mesh
    dt_names = dt_mesh.mesh_dim_names or tuple(f"dim {i}" for i in range(dt_mesh.ndim))
    out = []
    for i, (name, placement) in enumerate(zip(dt_names, dt.placements)):
        size = dt_mesh.size(i)
        if size == 1:
            continue
        axis = regions.get(MeshAxis.of(dt_mesh.get_group(i)))
        if axis is None:
            return f"a DTensor on a mesh dim ('{name}', {size} ranks) over no one axis of the check's mesh"
        out.append((axis, placement, size))
    return out


def dtensor_types(dt: Any, mesh: Any) -> tuple[dict[str, SpmdType] | None, str | None]:
    """(types on the check's axes, why not comparable as a whole) of DTensor ``dt``; types None when it has none.

    A strided shard is S(d) on its axis, with :data:`STRIDED` as the why-not: its pieces are compared rank
    by rank (a layout), never concatenated as if they nested in mesh order.
    """
    from ..integrations.dtensor.placements import placement_to_type

    found = dtensor_placements(dt, mesh)
    if isinstance(found, str):
        return None, found
    strided = strided_shard_class()
    types: dict[str, SpmdType] = {}
    why = None
    for axis, placement, _ in found:
        if isinstance(placement, strided):
            types[axis], why = S(placement.dim), STRIDED
            continue
        try:
            types[axis] = placement_to_type(placement)
        except NotImplementedError:
            return None, f"a DTensor placement with no SPMD type ({placement!r})"
    return types, why


def strided_layouts(params: Mapping[str, torch.Tensor], mesh: Any) -> dict[str, Callable[..., torch.Tensor]]:
    """``{escaped name: fn(full, coords) -> local}`` for every DTensor parameter with a strided shard."""
    from .._core.dtensor_hook import is_dtensor

    strided = strided_shard_class()
    out = {}
    for name, p in params.items():
        if not is_dtensor(p):
            continue
        found = dtensor_placements(p, mesh)
        if isinstance(found, str) or not any(isinstance(pl, strided) for _, pl, _ in found):
            continue
        out[_escaped(name)] = _layout(found)
    return out


def _escaped(name: str) -> str:
    """``name`` as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _layout(steps: list[tuple[str, Any, int]]) -> Callable[[torch.Tensor, dict[str, int]], torch.Tensor]:
    """The piece of a whole value a rank at ``coords`` holds under ``steps``' placements, cut in mesh order."""
    strided = strided_shard_class()

    def piece(full: torch.Tensor, coords: dict[str, int]) -> torch.Tensor:
        x = full
        for axis, placement, n in steps:
            c = coords[axis]
            if isinstance(placement, strided):  # split_factor chunks first, each cut n ways: this rank's of each
                d = placement.dim
                x = torch.cat([_chunks(part, n, d)[c] for part in _chunks(x, int(placement.split_factor), d)], d)
            elif placement.is_shard():
                x = _chunks(x, n, placement.dim)[c]
        return x

    return piece


def _chunks(x: torch.Tensor, n: int, d: int) -> list[torch.Tensor]:
    """``torch.chunk`` padded with empty pieces to ``n`` (as DTensor and FSDP cut a dim)."""
    parts = list(torch.chunk(x, n, d))
    while len(parts) < n:
        parts.append(x.narrow(d, 0, 0))
    return parts

