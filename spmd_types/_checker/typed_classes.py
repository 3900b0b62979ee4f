"""The class a tensor takes when it is typed: LTensor, TypedParameter, or a typed subclass of another tensor class.

A plain tensor becomes an ``LTensor`` and a parameter a ``TypedParameter``. Two tensor classes with their
own ``__torch_dispatch__`` are typed through a subclass made on first use: the rank simulator's
``LocalTensor`` (``LocalLTensor``) and ``FakeTensor`` (``FakeLTensor``, what the compiled-graph checker
runs on). The subclass hands the base class its own objects while the base dispatches (autograd saves the
typed objects themselves, so backward formulas reach the base class with them).
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch.private import FakeTensor, simulator_or_none
from .run_ops import _SWAP_BACK, _TYPED_CLASSES, _swap_to_base

__all__ = ["register_bases", "typed_class_for"]

_BASES: list = []  # [LTensor, TypedParameter], registered by the tensor layer
_WRAPPERS: dict[type, type] = {}  # a tensor class with its own dispatch -> its typed subclass


def register_bases(ltensor: type, typed_parameter: type) -> None:
    _BASES[:] = [ltensor, typed_parameter]


def typed_class_for(t: torch.Tensor) -> type:
    tp = type(t)
    if tp is torch.Tensor:
        return _BASES[0]
    if tp is torch.nn.Parameter:
        return _BASES[1]
    if tp in _TYPED_CLASSES or tp in _SWAP_BACK:
        return tp
    found = _WRAPPERS.get(tp) or _wrapper_for(tp)
    if found is not None:
        return found
    raise TypeError(
        f"spmd_types cannot type a tensor of class {tp.__name__}; pass a plain torch.Tensor, "
        "an nn.Parameter or a LocalTensor"
    )


def _wrapper_for(tp: type) -> type | None:
    """The typed subclass of ``LocalTensor`` or ``FakeTensor``, made on first use."""
    extra: dict[str, Any] = {}
    sim = simulator_or_none()
    LocalTensor = None if sim is None else sim.LocalTensor  # noqa: N806

    if tp is LocalTensor:
        # LocalTensor.contiguous is a custom autograd Function whose result is a plain LocalTensor; the typed
        # class runs Tensor.contiguous through the rules like any op, so the result keeps its type.
        extra["contiguous"] = torch.Tensor.contiguous
    elif tp is not FakeTensor:
        return None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        swapped = _swap_to_base(args, kwargs or {})
        try:
            types = tuple(tp if t is cls else t for t in types)
            return tp.__torch_dispatch__(func, types, args, kwargs)
        finally:
            for x, old in swapped:
                x.__class__ = old

    typed = type(tp.__name__.replace("Tensor", "LTensor"), (_BASES[0], tp),
                 {"__module__": __name__, "__torch_dispatch__": __torch_dispatch__, **extra})
    _WRAPPERS[tp] = typed
    _SWAP_BACK[typed] = tp
    _TYPED_CLASSES.add(typed)
    return typed
