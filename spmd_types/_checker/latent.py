"""Types given outside ``typecheck()``: remembered on the plain tensor, applied when checking turns on.

The published API types a tensor whenever ``assert_type`` is called, and
torchtitan calls it at parallelize time (every parameter and buffer) and when
it annotates a batch, both outside ``typecheck()``. Typing there would make
those tensors LTensors, which costs every later op a Python call even with
checking off. So outside checking ``assert_type`` only writes down what it was
told (the types, the partition spec, the current mesh) on the tensor, which
stays a plain ``torch.Tensor``; ``typecheck()`` applies every such record when
it starts. ``has_local_type`` and ``get_local_type`` read a record too.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._core.dtensor_hook import is_dtensor
from .._core.mesh import current_mesh, set_current_mesh

__all__ = ["remember", "apply_remembered", "remembered", "LATENT_ATTR"]

LATENT_ATTR = "_spmd_latent"
_PENDING: dict[int, weakref.ref] = {}  # id -> the tensors with a record, not yet typed


def remember(t: Any, types: Any, partition_spec: Any) -> Any:
    """Record ``types`` on ``t`` (a tensor, a list/tuple of them, or a module's parameters and buffers)."""
    if isinstance(t, (list, tuple)):
        for x in t:
            remember(x, types, partition_spec)
        return t
    if isinstance(t, torch.nn.Module):
        for member in list(t.parameters()) + list(t.buffers()):
            remember(member, types, None)
        return t
    if not isinstance(t, torch.Tensor) or getattr(t, "_spmd_types", None) is not None or is_dtensor(t):
        return t  # a DTensor carries its layout in its placements: asserted only under checking
    t.__dict__[LATENT_ATTR] = (types, partition_spec, current_mesh(), _world())
    key = id(t)
    _PENDING[key] = weakref.ref(t, lambda _: _PENDING.pop(key, None))
    return t


def _world() -> Any:
    """The current default process group (records belong to the world they were made in), or None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_group()


def remembered(t: Any) -> tuple | None:
    """The record on ``t``, or None."""
    return getattr(t, LATENT_ATTR, None) if isinstance(t, torch.Tensor) else None


def apply_remembered(assert_type: Any) -> None:
    """Type every tensor that has a record (called as checking turns on), under the mesh it was given with."""
    while _PENDING:
        _, ref = _PENDING.popitem()
        t = ref()
        if t is None:
            continue
        record = t.__dict__.pop(LATENT_ATTR, None)
        if record is None or getattr(t, "_spmd_types", None) is not None:
            continue
        types, spec, mesh, world = record
        if world is not _world():
            continue  # given under another process group world (torn down since): it means nothing here
        if mesh is None or mesh is current_mesh():
            assert_type(t, types, spec)
        else:
            with set_current_mesh(mesh, local_axes=mesh.local_axes):
                assert_type(t, types, spec)
