"""``spmd.Scalar(value, types)``: a Python number that differs per rank, typed like a 0-d tensor.

Seed 003's weak-scalar rule types a plain Python number as the other
operand's type, which is sound only when every rank holds the same number.
A number computed from the rank (a per-rank loss scale, a local token count)
is V (or P); ``spmd.Scalar`` says so by making it a 0-d tensor of that type,
which then takes part in the rules like any typed tensor. A 0-d tensor does
not promote a dimensioned operand's dtype within its category (``bf16 * 0-d
f32`` stays bf16), so arithmetic keeps the dtypes a Python number would.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .._checker.asserts import assert_type
from .._comm import impl as impl

__all__ = ["Scalar"]

_NUMBERS = (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)


def Scalar(  # noqa: N802 - named like a type, as spmd.S is
    value: Any, types: Mapping[Any, Any], *, dtype: torch.dtype | None = None, device: Any = None
) -> torch.Tensor:
    """A per-rank number as a typed 0-d tensor (outside ``typecheck()``: the plain 0-d tensor).

    ``value`` is this rank's Python number (``bool``, ``int``, ``float``; a
    ``SymInt`` such as a per-rank index under the simulator), or a 0-d tensor.
    ``types`` is a type dict as for ``assert_type``. ``dtype`` defaults to
    what ``torch.tensor(value)`` picks; ``device`` to the CPU (a 0-d CPU
    tensor mixes with tensors on any device). A copy keeps the type when it is
    an op on the scalar (``s.detach().clone()``, ``s.to(torch.float64)``);
    ``torch.tensor(s)`` is plain, as torch's factories read no types (choice 28).

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            n_local = spmd.Scalar(len(my_tokens), {"dp": spmd.V})
            loss = loss_sum / n_local          # typed V on dp, not R by accident
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"spmd.Scalar takes a 0-d tensor, got shape {list(value.shape)}")
        if getattr(value, "_spmd_types", None) is not None:
            raise TypeError("spmd.Scalar takes a plain number or a plain 0-d tensor; this tensor is typed already")
        t = value if dtype is None and device is None else value.to(dtype=dtype, device=device)
    elif isinstance(value, _NUMBERS):
        t = impl._per_rank(_as_tensor)(value, dtype, torch.device(device if device is not None else "cpu"))
    else:
        raise TypeError(f"spmd.Scalar takes a Python number (or a 0-d tensor), got {type(value).__name__}")
    return assert_type(t, types)


def _as_tensor(value: Any, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)
