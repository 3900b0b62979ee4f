"""The published API's placement helpers, with its meaning: R and I are plain ``Replicate()``.

Ours, :func:`type_to_placement`, gives ``Reduced()`` for R (seed 001: a
replicated value whose gradient is a pending sum). The published helpers
give what DTensor itself understands everywhere (``DTensor.from_local``,
FSDP), and read a ``Replicate()`` back as I unless its gradient placement
is ``Partial`` (then R). Our ``Reduced()`` reads back as R.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from ..._core.types import I, P, R, S, SpmdType, V, check_type_value
from .placements import Reduced

__all__ = ["spmd_type_to_dtensor_placement", "dtensor_placement_to_spmd_type", "spmd_redistribute"]


def spmd_type_to_dtensor_placement(spmd_type: SpmdType) -> Any:
    """``R``/``I`` -> ``Replicate()``, ``S(d)`` -> ``Shard(d)``, ``P`` -> ``Partial()``; V has no placement.

    Example::

        spmd.spmd_type_to_dtensor_placement(spmd.S(1))   # Shard(dim=1)
    """
    t = check_type_value(spmd_type, "spmd_type_to_dtensor_placement")
    if t is R or t is I:
        return Replicate()
    if t is P:
        return Partial()
    if t is V:
        raise ValueError("spmd_type_to_dtensor_placement: V has no DTensor placement (it says nothing of the "
                         "layout); use S(d) for a value sharded on tensor dim d")
    return Shard(t.dim)  # type: ignore[attr-defined]


def dtensor_placement_to_spmd_type(placement: Any, grad_placement: Any = None) -> SpmdType:
    """The inverse: ``Replicate()`` is I (R when ``grad_placement`` is ``Partial``), ``Reduced()`` R,
    ``Shard(d)`` ``S(d)``, ``Partial()`` P.

    Example::

        spmd.dtensor_placement_to_spmd_type(Replicate(), grad_placement=Partial())   # R
    """
    if isinstance(placement, Reduced):
        return R
    if isinstance(placement, Replicate):
        return R if isinstance(grad_placement, Partial) else I
    if type(placement) is Shard:
        return S(placement.dim)
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum":
            raise ValueError(f"dtensor_placement_to_spmd_type: only a sum is a P value, got Partial({placement.reduce_op})")
        return P
    raise ValueError(f"dtensor_placement_to_spmd_type: no SPMD type for placement {placement!r}")


def spmd_redistribute(x: Any, src: Any, dst: Any) -> Any:
    """Move DTensor ``x`` from one ``TensorSharding`` to another with this package's typed collectives.

    ``src`` and ``dst`` name, per tensor dim, the mesh axes that shard it (None:
    replicated; the published API's ``TensorSharding``); an axis they leave out
    is replicated. Each mesh axis whose type changes runs one
    ``spmd.redistribute`` (an all-gather, a local slice or an all-to-all), in
    mesh order; the backward runs the reverse. A dim sharded on several axes
    must stay as it is (``NotImplementedError`` otherwise, as in the published API).

    Example::

        full = spmd.spmd_redistribute(x, spmd.types.TensorSharding("tp"), spmd.types.TensorSharding())
    """
    from itertools import zip_longest

    from torch.distributed.tensor import DTensor

    from ..._comm.collectives import redistribute

    mesh = x.device_mesh
    names = list(mesh.mesh_dim_names or ())
    before = {n: R for n in names}
    after = {n: R for n in names}
    for dim, (s, d) in enumerate(zip_longest(src, dst)):
        s_axes, d_axes = _dim_axes(s), _dim_axes(d)
        if s_axes != d_axes and (len(s_axes) > 1 or len(d_axes) > 1):
            raise NotImplementedError(
                f"spmd_redistribute: tensor dim {dim} is sharded on several mesh axes and that changes "
                f"({s_axes!r} to {d_axes!r}); redistribute one axis at a time with spmd.redistribute")
        for name in s_axes:
            before[name] = S(dim)
        for name in d_axes:
            after[name] = S(dim)
    changed = [n for n in names if before[n] != after[n]]
    if not changed:
        return x
    local = x.to_local()
    placements = list(x.placements)
    for name in changed:  # on the local tensor, over each axis's group; the placements as the published API gives
        local = redistribute(local, mesh.get_group(name), src=before[name], dst=after[name])
        placements[names.index(name)] = spmd_type_to_dtensor_placement(after[name])
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False)


def _dim_axes(dim: Any) -> tuple:
    """One ``TensorSharding`` entry's axis names: None, a name, or names."""
    return () if dim is None else (dim,) if isinstance(dim, str) else tuple(dim)
