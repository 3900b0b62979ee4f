"""Gradients still waiting for their sync: the error that names the parameter.

A parameter that is R on an axis gets a gradient that is P there (a pending
sum: each rank holds its share). An optimizer step, ``clip_grad_norm_`` or a
``torch._foreach_*`` kernel that uses such a gradient as if it were the whole
gradient is the classic forgotten data-parallel gradient sync. The rules
table already rejects every such use (an update ``p - lr * g`` adds P to R;
Adam's moments and every norm are non-linear in ``g``); this module turns
that rejection into one that names the parameter and the missing
all-reduce.

How the parameter is known, at no cost on the typed fast path: the hook that
types a leaf's gradient after ``backward()`` (``_tensor._type_grad``) leaves
a weak reference to the parameter on the gradient (:func:`mark_grad`), and a
module typed with ``assert_type(module, ...)`` leaves each parameter its name
(:func:`name_parameters`). Both are read only when an op is being rejected.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Iterator

import torch

from .._core.errors import Rejection
from .._core.spec import short_dtype
from .._core.types import P, TypeMap
from .._torch.private import DisableTorchFunctionSubclass

__all__ = ["mark_grad", "name_parameters", "unsynced_grad", "unsynced_grad_rejection"]

_DisableTF = DisableTorchFunctionSubclass


def mark_grad(grad: torch.Tensor, param: torch.Tensor) -> None:
    """Remember that ``grad`` is ``param``'s gradient (a weak reference: no cycle, no leak)."""
    grad.__dict__["_spmd_grad_of"] = weakref.ref(param)


def name_parameters(module: torch.nn.Module) -> None:
    """Give each parameter of ``module`` its qualified name (kept if it already has one)."""
    for name, p in module.named_parameters():
        p.__dict__.setdefault("_spmd_name", name)


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif type(v) in (list, tuple):
            yield from _tensors(v)


def unsynced_grad(args: Any, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(grad, param)`` for the first operand that is a parameter's gradient and P on some axis.

    An operand computed from the gradient (``-grad`` when an optimizer maximizes) carries no
    mark; then, inside an optimizer's ``step`` (found on the stack: this runs only when an op is
    being rejected), the first parameter of that optimizer whose gradient is P is named.
    """
    for t in _tensors(list(args) + list(kwargs.values())):
        ref = t.__dict__.get("_spmd_grad_of")
        types = t.__dict__.get("_spmd_types")
        if ref is None or not _partial(types):
            continue
        param = ref()
        if param is not None and param.__dict__.get("_spmd_types") is not None:
            return t, param
    return _in_optimizer_step()


def _partial(types: TypeMap | None) -> bool:
    return types is not None and any(x is P for _, x in types.items)


def _in_optimizer_step() -> tuple[torch.Tensor, torch.Tensor] | None:
    frame = sys._getframe(2)
    while frame is not None:
        opt = frame.f_locals.get("self")
        if isinstance(opt, torch.optim.Optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    grad = _grad_of(p)
                    if grad is not None and _partial(grad.__dict__.get("_spmd_types")) and \
                            p.__dict__.get("_spmd_types") is not None:
                        return grad, p
            return None
        frame = frame.f_back
    return None


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    with _DisableTF():
        return p.grad


def describe_parameter(param: torch.Tensor, index: int | None = None) -> str:
    """``'fc.weight' f32[4,4]`` when the name is known, else ``f32[4,4]`` (and its list index)."""
    with _DisableTF():
        shape = ",".join(str(n) for n in param.shape)
    shown = f"{short_dtype(param.dtype)}[{shape}]"
    name = param.__dict__.get("_spmd_name")
    if name is not None:
        return f"'{name}' {shown}"
    return shown if index is None else f"{shown} (number {index} in the kernel's parameter list)"


def unsynced_grad_rejection(op: str, grad: torch.Tensor, param: torch.Tensor, index: int | None = None) -> Rejection:
    """The rejection for ``op`` using ``param``'s gradient while it is still P."""
    grad_types: TypeMap = grad.__dict__["_spmd_types"]
    param_types: TypeMap = param.__dict__["_spmd_types"]
    axes = [a for a, t in grad_types.items if t is P]
    shown_axes = ", ".join(f"'{a}'" for a in axes)
    fix = "; ".join(f"p.grad = spmd.all_reduce(p.grad, '{a}', src=spmd.P, dst=spmd.R)" for a in axes)
    return Rejection(
        f"The gradient of parameter {describe_parameter(param, index)} is a pending sum (P) on {shown_axes}: "
        f"each rank holds only its share, and {op} would use that share as the whole gradient. "
        "The gradient sync (an all-reduce) is missing between backward() and this use.",
        [("op", op), ("parameter", param_types.format()), ("gradient", grad_types.format()),
         ("axis", "\n".join(f"'{a}': the gradient is P" for a in axes))],
        [fix],
        notes=["for every parameter p whose gradient is P, after backward() and before the optimizer step "
               "or gradient clipping"],
    )
