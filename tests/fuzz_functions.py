"""Custom autograd Functions for the soundness fuzzer, registered each way ``register_autograd_function`` allows.

Plain ``torch.autograd.Function`` classes with hand-written backwards, as
user code (Megatron's mapping Functions, fused kernels) writes them. Each is
registered once, at import, with one kind of claim:

* ``local=True``: :class:`FusedTanh` (no communication; the standard non-linear rule);
* ``transparent=True``: :class:`TransparentScale` and :class:`CheckpointedSilu` (their forwards checked
  op by op);
* ``rule=``: :class:`AddScaled` (``2 a + b``, linear in both jointly);
* ``op=``: the Megatron-style region Functions, which take their process group as an
  argument (``axis=`` a callable): :class:`CopyToRegion` (identity; backward all-reduce),
  :class:`ReduceFromRegion` (all-reduce; backward identity), :class:`GatherFromRegion`
  (all-gather dim 0; backward this rank's slice), :class:`ScatterToRegion` (this rank's
  slice of dim 0; backward all-gather). The slices are taken as ``reduce_scatter(x / n)``
  of a replicated ``x``: a different route from the package's to the same values.

:class:`UnregisteredTanh` is never registered (programs using it must be
rejected), and :class:`WrongReduceFrom` claims ``all_reduce(P -> I)`` but
all-reduces its gradient too (a wrong claim the fuzzer's oracle must catch;
only ``test_fuzz`` uses it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

import spmd_types as spmd

__all__ = ["FUNCTIONS", "TYPE_FUNCTIONS"]


def _group_axis(args: tuple, kwargs: dict) -> Any:
    return args[1]


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def _all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, group))


def _my_slice(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's chunk of dim 0 of a value every rank holds: reduce_scatter(x / n)."""
    n = dist.get_world_size(group)
    return funcol.wait_tensor(funcol.reduce_scatter_single((x / n).contiguous(), "sum", 0, group))


@spmd.register_autograd_function(local=True)
class FusedTanh(torch.autograd.Function):
    # No materialized zeros for an output no gradient reaches: as torch.tanh (the oracle's meaning), x then gets
    # no gradient at all, which an optimizer's weight decay tells apart from zeros (found at nightly size).
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> torch.Tensor | None:
        if g is None:
            return None
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


@spmd.register_autograd_function(transparent=True)
class TransparentScale(torch.autograd.Function):
    """3 x, its forward checked op by op; saves nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return x * 3.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> torch.Tensor | None:
        return None if g is None else g * 3.0


# Found by this fuzzer: a transparent Function that saved a typed tensor crashed in backward on LocalTensorMode
# ("Called aten.detach.default with input of type LocalLTensor ..."); test_fuzz.py keeps the reproducer.
@spmd.register_autograd_function(transparent=True)
class CheckpointedSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> torch.Tensor | None:
        if g is None:
            return None
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


def _add_rule(ta: Any, tb: Any) -> dict:
    """2 a + b is linear in a and b jointly: P only with P, I only with I, R with V gives V."""
    out = {}
    for axis in ta.as_dict():
        x, y = (spmd.V if t.is_varying else t for t in (ta[axis], tb[axis]))
        if x == y:
            out[axis] = x
        elif {x, y} == {spmd.R, spmd.V}:
            out[axis] = spmd.V
        else:
            raise spmd.SpmdTypeError(f"AddScaled: {ta[axis]} and {tb[axis]} on axis {axis!r} do not add")
    return out


@spmd.register_autograd_function(rule=_add_rule)
class AddScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return 2 * a + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None, None) if g is None else (2 * g, g)


@spmd.register_autograd_function(op="reinterpret", axis=_group_axis, src=spmd.I, dst=spmd.R)
class CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return (None, None) if g is None else (_all_reduce(g, ctx.group), None)


@spmd.register_autograd_function(op="all_reduce", axis=_group_axis, src=spmd.P, dst=spmd.I)
class ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


@spmd.register_autograd_function(op="all_gather", axis=_group_axis, src=spmd.S(0), dst=spmd.I)
class GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return (None, None) if g is None else (_my_slice(g, ctx.group), None)


@spmd.register_autograd_function(op="convert", axis=_group_axis, src=spmd.I, dst=spmd.S(0))
class ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.group = group
        return _my_slice(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return (None, None) if g is None else (_all_gather(g, ctx.group), None)


@spmd.register_autograd_function(op="all_reduce", axis=_group_axis, src=spmd.P, dst=spmd.I)
class WrongReduceFrom(torch.autograd.Function):
    """Claims all_reduce(P -> I), whose backward is the identity, but all-reduces the gradient too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return (None, None) if g is None else (_all_reduce(g, ctx.group), None)


class UnregisteredTanh(FusedTanh.__base__):  # type: ignore[misc,name-defined]
    """FusedTanh's code, never registered."""

    forward = FusedTanh.forward
    backward = FusedTanh.backward


# A Function whose output no gradient reaches (beside a reached output of a multi-output op, a foreach) still
# gets its backward called, with zeros, unless it turns materialized gradients off; torch's own ops give no
# gradient at all, which an optimizer's weight decay tells apart from zeros (found at nightly size). Every
# Function above turns them off, as the oracle's plain ops behave.

# name -> the Function (the oracle knows each one's meaning under the same name)
FUNCTIONS: dict[str, type[torch.autograd.Function]] = {
    "fn:tanh": FusedTanh, "fn:silu": CheckpointedSilu, "fn:scale3": TransparentScale, "fn:add_scaled": AddScaled,
    "fn:unregistered": UnregisteredTanh,
}
# name -> (Function, the claim: op, src, dst)
TYPE_FUNCTIONS: dict[str, tuple[type[torch.autograd.Function], str, str, str]] = {
    "fn:copy_to": (CopyToRegion, "reinterpret", "I", "R"),
    "fn:reduce_from": (ReduceFromRegion, "all_reduce", "P", "I"),
    "fn:gather_from": (GatherFromRegion, "all_gather", "S0", "I"),
    "fn:scatter_to": (ScatterToRegion, "convert", "I", "S0"),
    "fn:wrong_reduce": (WrongReduceFrom, "all_reduce", "P", "I"),
}
