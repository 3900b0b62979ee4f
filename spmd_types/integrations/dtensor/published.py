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

__all__ = ["spmd_type_to_dtensor_placement", "dtensor_placement_to_spmd_type"]


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
