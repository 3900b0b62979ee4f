"""Contractions that make a pending sum on purpose: ``spmd.sum/linear/matmul/einsum(..., out_partial_axes=)``.

Seed 003: partial is never produced implicitly. In local SPMD these run the
local op and then reinterpret the result as P on the named axes (V -> P, or
R -> P); in global SPMD they also allow the contraction over a dim sharded on
those axes, which ordinary ops reject. At runtime the reinterpret moves no
data, so erased, they are exactly the torch op.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from .._core.errors import Rejection, op_error
from .._core.mesh import Axis, resolve_axis
from .._core.state import STATE
from .._core.traced import register_call, routed, traced_call
from .._core.types import I, P, TypeMap

__all__ = ["sum", "linear", "matmul", "einsum"]

PartialAxes = Axis | Iterable[Axis] | None

_builtin_sum = sum


def _axes(out_partial_axes: PartialAxes) -> frozenset[str]:
    if out_partial_axes is None:
        return frozenset()
    if isinstance(out_partial_axes, (str, torch.distributed.ProcessGroup)) or not isinstance(out_partial_axes, Iterable):
        out_partial_axes = [out_partial_axes]
    return frozenset(resolve_axis(a) for a in out_partial_axes)


def _with_partial(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict, out_partial_axes: PartialAxes) -> Any:
    if not STATE.checking:
        return fn(*args, **kwargs)
    if routed():  # torch.compile traces: one graph node (see _core/traced.py)
        return traced_call(f"spmd.{name}", *args, **kwargs, out_partial_axes=out_partial_axes)
    axes = _axes(out_partial_axes)
    saved = STATE.out_partial
    STATE.out_partial = saved | axes
    try:
        out = fn(*args, **kwargs)
    finally:
        STATE.out_partial = saved
    types: TypeMap | None = getattr(out, "_spmd_types", None)
    if types is None or not axes:
        return out
    for axis in axes:
        t = types.get(axis)
        if t is P or t is I:
            raise op_error(
                Rejection(
                    f"out_partial_axes reinterprets the result as a pending sum (P) on '{axis}', but the local "
                    f"result is already {t} there.",
                    [("op", f"spmd.{name}"), ("result", types.format())],
                    [f"spmd.convert(result, '{axis}', src=spmd.I, dst=spmd.P)" if t is I else "drop out_partial_axes"],
                ),
                name,
                ("input",),
            )
    out._spmd_types = TypeMap.of({**types.as_dict(), **{a: P for a in axes}})
    return out


def sum(x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None,
        out_partial_axes: PartialAxes = None) -> torch.Tensor:
    """``torch.sum`` that may sum over a sharded dim, giving a pending sum on ``out_partial_axes``.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck(local=False):
            x = spmd.assert_type(torch.randn(4, 8), {"tp": spmd.S(1)})
            total = spmd.sum(x, 1, out_partial_axes="tp")   # {tp: P}
    """
    args = (x,) if dim is None else (x, dim, keepdim)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return _with_partial("sum", torch.sum, args, kwargs, out_partial_axes)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_partial_axes: PartialAxes = None) -> torch.Tensor:
    """``F.linear`` whose result is a pending sum on ``out_partial_axes`` (row-parallel linear).

    Example::

        y = spmd.linear(h, w2, out_partial_axes="tp")   # h: S(1) on tp, w2: S(1) on tp -> y: P on tp
    """
    return _with_partial("linear", F.linear, (x, weight) if bias is None else (x, weight, bias), {}, out_partial_axes)


def matmul(a: torch.Tensor, b: torch.Tensor, *, out_partial_axes: PartialAxes = None) -> torch.Tensor:
    """``torch.matmul`` whose result is a pending sum on ``out_partial_axes``.

    Example::

        y = spmd.matmul(h, w, out_partial_axes="tp")
    """
    return _with_partial("matmul", torch.matmul, (a, b), {}, out_partial_axes)


def einsum(equation: str, *operands: torch.Tensor, out_partial_axes: PartialAxes = None) -> torch.Tensor:
    """``torch.einsum`` whose result is a pending sum on ``out_partial_axes``.

    Example::

        y = spmd.einsum("bk,nk->bn", h, w, out_partial_axes="tp")
    """
    return _with_partial("einsum", torch.einsum, (equation, *operands), {}, out_partial_axes)


register_call("spmd.sum", sum)
register_call("spmd.linear", linear)
register_call("spmd.matmul", matmul)
register_call("spmd.einsum", einsum)
