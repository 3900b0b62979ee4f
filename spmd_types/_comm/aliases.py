"""The published API's shorthand names for three type changes, spelled as the ops they are.

``shard(x, axis, src=R|I, dst=S(d))`` is ``convert``; ``unshard(x, axis,
src=S(d), dst=R|I)`` is ``all_gather``; ``invariant_to_replicate(x, axis)`` is
``convert(x, axis, src=I, dst=R)`` (no communication forward; the backward
all-reduces the gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.types import I, R, Shard, SpmdType, check_type_value
from .collectives import all_gather
from .reinterpret_convert import convert

__all__ = ["shard", "unshard", "invariant_to_replicate"]


def shard(x: torch.Tensor, axis: Any, *, src: SpmdType, dst: SpmdType, **options: Any) -> torch.Tensor:
    """Keep this rank's shard of an R or I value: ``convert(x, axis, src=src, dst=S(d))``.

    Example::

        w_local = spmd.shard(w, "tp", src=spmd.I, dst=spmd.S(0))
    """
    if not isinstance(check_type_value(dst, "spmd.shard: dst"), Shard):
        raise ValueError(f"spmd.shard: dst must be S(d), got {dst}")
    return convert(x, axis, src=src, dst=dst, **options)


def unshard(x: torch.Tensor, axis: Any, *, src: SpmdType, dst: SpmdType, **options: Any) -> torch.Tensor:
    """Gather the shards of an S(d) value: ``all_gather(x, axis, src=S(d), dst=dst)``.

    Example::

        w = spmd.unshard(w_local, "dp", src=spmd.S(0), dst=spmd.R)
    """
    if not isinstance(check_type_value(src, "spmd.unshard: src"), Shard):
        raise ValueError(f"spmd.unshard: src must be S(d), got {src}")
    return all_gather(x, axis, src=src, dst=dst, **options)


def invariant_to_replicate(x: torch.Tensor, axis: Any, **options: Any) -> torch.Tensor:
    """``convert(x, axis, src=I, dst=R)``: the same value, whose gradient is now all-reduced.

    Example::

        w_used = spmd.invariant_to_replicate(w, "tp")   # Megatron's copy_to_tensor_model_parallel_region
    """
    return convert(x, axis, src=I, dst=R, **options)
