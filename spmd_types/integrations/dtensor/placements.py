"""DTensor placements <-> SPMD types, and the primal -> cotangent map of placements (seeds 000, 001).

=====================  ==========  =====================
placement              type        cotangent placement
=====================  ==========  =====================
``Shard(d)``           ``S(d)``    ``Shard(d)``
``Replicate()``        ``I``       ``Replicate()``
``spmd.Reduced()``     ``R``       ``Partial()``
``Partial()`` (sum)    ``P``       ``spmd.Reduced()``
=====================  ==========  =====================

``Reduced`` subclasses ``Replicate`` (the same data on every rank), so every
check here tests ``Reduced`` before ``Replicate``.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..._core.types import I, P, R, S, SpmdType, V, check_type_value
from ..._torch.private import dtensor_spec_class

DTensorSpec = dtensor_spec_class()  # torch.distributed.tensor._dtensor_spec.DTensorSpec

__all__ = [
    "Reduced", "placement_to_type", "type_to_placement", "placement_to_cotangent", "spec_to_cotangent",
    "is_reduced", "strip_reduced",
]


class Reduced(Replicate):
    """A replicated placement whose gradient is ``Partial`` (seed 001; JAX's Reduced, our R).

    The data layout is ``Replicate``'s; only the gradient differs: the
    gradient of a ``Replicate()`` DTensor is ``Replicate()`` (already summed,
    type I), the gradient of a ``Reduced()`` one is ``Partial()`` (a pending
    sum, type P), so an FSDP weight gathered to ``Reduced`` gets its gradient
    back with one reduce-scatter. ``Reduced() != Replicate()``.

    Example::

        w = spmd.all_gather(w_shard, "dp", src=spmd.S(0), dst=spmd.R)
        w.placements   # (Reduced(),)
    """

    def __repr__(self) -> str:
        return "Reduced()"

    def __str__(self) -> str:
        return "Rd"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reduced)

    def __ne__(self, other: object) -> bool:
        return not isinstance(other, Reduced)

    def __hash__(self) -> int:
        return hash("Reduced")

    def is_reduced(self) -> bool:
        """Always True (a plain ``Replicate`` has no such method)."""
        return True


def is_reduced(placement: Any) -> bool:
    """True for ``Reduced()`` (and only for it: not for ``Replicate()``).

    Example::

        spmd.is_reduced(spmd.Reduced()), spmd.is_reduced(Replicate())   # (True, False)
    """
    return isinstance(placement, Reduced)


def placement_to_type(placement: Placement) -> SpmdType:
    """The SPMD type of a DTensor placement on one mesh dim.

    ``Shard(d) -> S(d)``, ``Reduced() -> R``, ``Replicate() -> I``,
    ``Partial() -> P`` (sum only).

    Example::

        spmd.placement_to_type(Shard(1))        # S(1)
        spmd.placement_to_type(spmd.Reduced())  # R
    """
    if isinstance(placement, Reduced):  # before Replicate: Reduced is a Replicate
        return R
    if isinstance(placement, Replicate):
        return I
    if type(placement) is Shard:
        return S(placement.dim)
    if type(placement) is Partial:
        if placement.reduce_op != "sum":
            raise NotImplementedError(
                f"placement_to_type: Partial({placement.reduce_op!r}) has no SPMD type (P is a pending sum); "
                "redistribute it to Replicate() or Shard(d) first"
            )
        return P
    raise NotImplementedError(
        f"placement_to_type: the placement {placement!r} ({type(placement).__name__}) has no SPMD type; "
        "supported are Shard(d), Replicate(), spmd.Reduced() and Partial('sum')"
    )


def type_to_placement(t: SpmdType) -> Placement:
    """The DTensor placement of an SPMD type: ``S(d) -> Shard(d)``, ``R -> Reduced()``, ``I -> Replicate()``,
    ``P -> Partial()``.

    ``V`` has no placement (it does not say how the shards reassemble): use ``S(d)``.

    Example::

        spmd.type_to_placement(spmd.R)     # Reduced()
        spmd.type_to_placement(spmd.S(0))  # Shard(dim=0)
    """
    t = check_type_value(t, "type_to_placement")
    if t is R:
        return Reduced()
    if t is I:
        return Replicate()
    if t is P:
        return Partial()
    if t is V:
        raise ValueError(
            "type_to_placement: V has no DTensor placement (it does not say how the shards reassemble); "
            "use S(d), which maps to Shard(d)"
        )
    return Shard(t.dim)  # type: ignore[attr-defined]


def placement_to_cotangent(placement: Placement) -> Placement:
    """The placement of the gradient of a DTensor with ``placement`` (seed 001's duality).

    ``Shard(d) -> Shard(d)``, ``Replicate() -> Replicate()``,
    ``Reduced() -> Partial()``, ``Partial() -> Reduced()``.

    Example::

        spmd.placement_to_cotangent(spmd.Reduced())   # Partial(sum)
    """
    if isinstance(placement, Reduced):
        return Partial()
    if isinstance(placement, Replicate):
        return Replicate()
    if type(placement) is Shard:
        return Shard(placement.dim)
    if type(placement) is Partial:
        placement_to_type(placement)  # only a sum has a Reduced gradient
        return Reduced()
    placement_to_type(placement)  # raises, naming the placement
    raise AssertionError("unreachable")  # pragma: no cover


def spec_to_cotangent(spec: DTensorSpec | Sequence[Placement]) -> Any:
    """The cotangent of a ``DTensorSpec`` (same mesh and metadata) or of a sequence of placements.

    Example::

        spmd.spec_to_cotangent((Shard(0), spmd.Reduced()))   # (Shard(dim=0), Partial(sum))
    """
    if isinstance(spec, DTensorSpec):
        return DTensorSpec(spec.mesh, tuple(placement_to_cotangent(p) for p in spec.placements),
                           tensor_meta=spec.tensor_meta)
    return tuple(placement_to_cotangent(p) for p in spec)


def strip_reduced(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with every ``Reduced()`` read as ``Replicate()`` (the data layout DTensor computes on)."""
    return tuple(Replicate() if isinstance(p, Reduced) else p for p in placements)
