"""torch's ``AsyncCollectiveTensor`` (a collective's result not yet waited on) as a plain tensor.

DTensor's ``redistribute(..., async_op=True)`` leaves one as the local tensor;
torch's ``RowwiseParallel`` redistributes its output that way, so torchtitan's
plan hands the next module one (its ``to_local()``, or the DTensor's local
tensor). It is a wrapper subclass and cannot carry types, so where a tensor
is given its type the result is waited on first. The core never imports
torch.distributed for this: an AsyncCollectiveTensor only exists once that
module is loaded, so the check reads ``sys.modules``.
"""

from __future__ import annotations

import torch

from .._torch.private import c10d_functional, loaded_functional_collectives

__all__ = ["settled"]

_PLAIN = torch.Tensor


def settled(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for an ``AsyncCollectiveTensor`` its waited, plain value (still differentiable).

    Example::

        local = settled(dt.to_local())   # RowwiseParallel's output: a plain tensor that can be typed
    """
    if type(t) is _PLAIN:
        return t
    mod = loaded_functional_collectives()
    if mod is None or not isinstance(t, mod.AsyncCollectiveTensor):
        return t
    return c10d_functional.wait_tensor(t)
