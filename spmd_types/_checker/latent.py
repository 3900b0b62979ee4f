"""Types given outside ``typecheck()``: remembered for the plain tensor, applied when checking turns on.

The published API types a tensor whenever ``assert_type`` is called, and
torchtitan calls it at parallelize time (every parameter and buffer) and when
it annotates a batch, both outside ``typecheck()``. Typing there would make
those tensors LTensors, which costs every later op a Python call even with
checking off. So outside checking ``assert_type`` only writes down what it was
told: the raw types and partition spec, with the current mesh and process-group
world they were given under. Nothing is resolved, checked or looked up then,
and the tensor stays a plain ``torch.Tensor`` and is not touched (a fresh
tensor would otherwise grow a ``__dict__``): under a microsecond a call for a
tensor asserted again, about 1 µs for a fresh one (``benchmarks/erased_assert.py``).
``typecheck()`` resolves and applies every record when it starts;
``has_local_type`` and ``get_local_type`` resolve one on demand (:func:`remembered`).

The records live in one table keyed by the tensor's id, each with a weak
reference to its tensor (no callback): an entry whose tensor died, or whose id
now belongs to another tensor, is never read as that tensor's record, and is
dropped when the table is next pruned, which happens when it has doubled since
the last pruning. The cost per record stays constant, and a process that never
checks holds about twice its live recorded tensors at most.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._core.dtensor_hook import is_dtensor
from .._core.mesh import _MESHES, current_mesh, set_current_mesh
from .._torch.private import c10d_world

__all__ = ["remember", "apply_remembered", "remembered", "RECORDS", "PLAIN", "C10D_WORLD", "prune"]

# id(tensor) -> (weak reference to it, types, partition spec, mesh, world): what assert_type was told outside
# typecheck(), not yet applied. An entry counts only while its reference still points at the tensor asked about.
RECORDS: dict[int, tuple] = {}
_PRUNE_FLOOR = 1024
prune_at = _PRUNE_FLOOR
# torch's process-group world; its ``_default_pg`` (what ``default_pg`` returns, read without the property's
# call: the erased assert_type reads it on every call) is the current world. tests/test_latent.py checks it.
C10D_WORLD = c10d_world
_ref = weakref.ref
PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these classes: no DTensor, no LTensor, no container


def remember(t: Any, types: Any, partition_spec: Any) -> Any:
    """Record ``types`` for ``t`` (a tensor, a list/tuple of them, or a module's parameters and buffers).

    A typed tensor keeps its type: every reader looks at ``_spmd_types`` first, so a record made for one (a
    typed tensor caught with its class swapped to ``torch.Tensor``) is never read.
    """
    if type(t) in PLAIN:  # the common case (asserts.assert_type has it inline: keep the two alike)
        RECORDS[id(t)] = (_ref(t), types, partition_spec, _MESHES.top, C10D_WORLD._default_pg)
        if len(RECORDS) >= prune_at:
            prune()
        return t
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
    RECORDS[id(t)] = (_ref(t), types, partition_spec, current_mesh(), _world())
    if len(RECORDS) >= prune_at:
        prune()
    return t


def prune() -> None:
    """Drop the entries of dead tensors; prune again when the table has doubled."""
    global prune_at
    for key in [k for k, entry in RECORDS.items() if entry[0]() is None]:
        del RECORDS[key]
    prune_at = max(_PRUNE_FLOOR, 2 * len(RECORDS))


def _world() -> Any:
    """The current default process group (records belong to the world they were made in), or None."""
    return C10D_WORLD._default_pg


def remembered(t: Any) -> tuple | None:
    """The record for ``t``: ``(types, partition_spec, mesh, world)`` as given outside typecheck(), or None."""
    entry = RECORDS.get(id(t))
    if entry is None or entry[0]() is not t:
        return None  # none, or the entry of a dead tensor that had this id
    return entry[1:]


def apply_remembered(assert_type: Any) -> None:
    """Type every tensor that has a record (called as checking turns on), under the mesh it was given with."""
    global prune_at
    while RECORDS:
        _, (ref, types, spec, mesh, world) = RECORDS.popitem()
        t = ref()
        if t is None or getattr(t, "_spmd_types", None) is not None:
            continue  # dead, or typed since
        if world is not _world():
            continue  # given under another process group world (torn down since): it means nothing here
        if mesh is None or mesh is current_mesh():
            assert_type(t, types, spec)
        else:
            with set_current_mesh(mesh, local_axes=mesh.local_axes):
                assert_type(t, types, spec)
    prune_at = _PRUNE_FLOOR
