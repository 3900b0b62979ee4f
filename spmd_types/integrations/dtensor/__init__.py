"""Interop with torch's DTensor (seeds 000, 001): the ``Reduced`` placement, placements <-> types, conversions.

Importing this package imports DTensor; ``import spmd_types`` does not (its
DTensor names load this package on first use). See docs/dtensor.md.

Example::

    import spmd_types as spmd
    w = spmd.all_gather(w_shard_dt, "dp", src=spmd.S(0), dst=spmd.R)   # placements (Reduced(),)
"""

from .bridge import dtensor_types, from_dtensor, to_dtensor
from .placements import (
    Reduced,
    is_reduced,
    placement_to_cotangent,
    placement_to_type,
    spec_to_cotangent,
    type_to_placement,
)
from .propagation import ReducedDTensor
from .torch_functions import from_local_rule  # noqa: F401  (registers DTensor.from_local on typed tensors)

__all__ = [
    "Reduced", "is_reduced", "placement_to_type", "type_to_placement", "placement_to_cotangent",
    "spec_to_cotangent", "from_dtensor", "to_dtensor", "dtensor_types", "ReducedDTensor",
]
