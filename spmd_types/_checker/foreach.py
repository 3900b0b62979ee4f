"""Multi-tensor and fused optimizer kernels, checked element by element.

``torch._foreach_X(lists...)`` is one op per element; element ``i`` is typed
by the single-tensor form's row of the rules table (``_rules_table.FOREACH_FORMS``
says which form) on element ``i`` of every list argument, so ``_foreach_norm``
of a P gradient is rejected like ``vector_norm`` of it, and ``_foreach_mul_``
by a number is linear like ``mul_``. The fused optimizer kernels
(``torch._fused_adam_`` and friends) get one non-linear rule per parameter
(``_rules_table.FUSED_OPTIMIZERS``) that may not change the parameter's type.

Cost: the per-element types are cached under one key per call (the element
types of every list), so a training step checks its types once, on its first
run; later steps pay one key build and lookup per kernel call. A P gradient
raises the error that names the parameter and the missing sync
(``_optim_checks``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from .._core.errors import Rejection, SpmdTypeError, op_error, user_source_line
from .._core.state import STATE
from .._core.types import P, TypeMap
from .._guards.optim_checks import unsynced_grad, unsynced_grad_rejection
from .._local.op_registry import OpEntry, _resolve, entry_for
from .._local.rules import infer
from .._local.rules_table import FOREACH_FORMS, FUSED_OPTIMIZERS
from .tensor import _CACHES, _MISSING, HANDLERS, _check_destination, _marker, _run, _wrap

__all__ = ["single_form"]

def single_form(name: str) -> OpEntry:
    """The rules-table entry that types one element of ``torch.<name>`` (a ``_foreach_`` kernel)."""
    base = name[len("_foreach_"):]
    inplace = base.endswith("_")
    func = None
    if name in FOREACH_FORMS:
        func = _resolve(FOREACH_FORMS[name])[0]
    elif inplace:
        func = getattr(torch.Tensor, base, None) or getattr(torch, base[:-1], None)
    else:
        func = getattr(torch, base, None) or getattr(torch.Tensor, base, None)
    entry = entry_for(func) if func is not None else entry_for(getattr(torch, name))
    return dataclasses.replace(entry, display=f"torch.{name}", inplace=inplace)


def _length(args: Sequence[Any]) -> int:
    return next((len(a) for a in args if type(a) in (list, tuple)), 0)


def _pick(value: Any, i: int) -> Any:
    return value[i] if type(value) in (list, tuple) else value


def _key(func: Any, args: Sequence[Any], kwargs: dict) -> tuple:
    key = [func]
    key.extend(_marker(a) for a in args)
    for k, v in kwargs.items():
        key.append(k)
        key.append(_marker(v))
    return tuple(key)


def _foreach_types(func: Any, args: Sequence[Any], kwargs: dict) -> tuple[TypeMap | None, ...] | None:
    name = func.__name__
    entry = _ENTRIES[name]
    n = _length(args)
    out: list[TypeMap | None] = []
    for i in range(n):
        a_i = [_pick(a, i) for a in args]
        kw_i = {k: _pick(v, i) for k, v in kwargs.items()}
        result = infer(entry, a_i, kw_i, STATE.strict)
        if isinstance(result, Rejection):
            grad, param = _p_grad(a_i, kw_i)
            if grad is not None:
                index = i if any(grad is t for t in a_i) else None  # found among this element's operands
                raise SpmdTypeError(unsynced_grad_rejection(entry.display, grad, param, index), user_source_line())
            note = f"element {i} of {n}, checked by the row of {_SINGLE_NAMES[name]}"
            raise op_error(dataclasses.replace(result, notes=tuple(result.notes) + (note,)), name, ())
        if entry.inplace and result is not None:
            _check_destination(entry, a_i[0], result)
        out.append(result)
    return tuple(out) if any(t is not None for t in out) else None


def _p_grad(args: Sequence[Any], kwargs: dict) -> tuple[Any, Any]:
    found = unsynced_grad(args, kwargs)
    return found if found is not None else (None, None)


def _foreach_call(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    key = _key(func, args, kwargs)
    cache = _CACHES[STATE.strict]
    types = cache.get(key, _MISSING)
    if types is _MISSING:
        STATE.uncacheable = False
        types = _foreach_types(func, args, kwargs)
        if not STATE.uncacheable:  # accepted only because no operand carries a gradient: not cached by types
            cache[key] = types
    out = _run(func, args, kwargs)
    if types is None or type(out) not in (list, tuple):
        return out
    return type(out)(o if t is None else _wrap(o, t) for o, t in zip(out, types))


# ---------------------------------------------------------------------------
# fused optimizer kernels: (params, grads, *state lists, **hyperparameters)

_FUSED_ENTRY = OpEntry(None, "", FUSED_OPTIMIZERS, True)


def _fused_types(func: Any, args: Sequence[Any]) -> None:
    entry = dataclasses.replace(_FUSED_ENTRY, func=func, display=f"torch.{func.__name__}")
    params, grads = args[0], args[1]
    states = [a for a in args[2:] if type(a) in (list, tuple) and len(a) == len(params)]
    for i, (p, g) in enumerate(zip(params, grads)):
        g_types = getattr(g, "_spmd_types", None)
        p_types = getattr(p, "_spmd_types", None)
        if g_types is not None and p_types is not None and any(t is P for _, t in g_types.items):
            raise SpmdTypeError(unsynced_grad_rejection(entry.display, g, p, i), user_source_line())
        operands = [p, g] + [s[i] for s in states]
        result = infer(entry, operands, {}, STATE.strict)
        if isinstance(result, Rejection):
            note = f"parameter {i} of {len(params)}"
            raise SpmdTypeError(dataclasses.replace(result, notes=tuple(result.notes) + (note,)), user_source_line())
        if result is not None:
            _check_destination(entry, p, result)


def _fused_call(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    key = _key(func, args, {})
    cache = _CACHES[STATE.strict]
    if cache.get(key, _MISSING) is _MISSING:
        STATE.uncacheable = False
        _fused_types(func, args)
        if not STATE.uncacheable:
            cache[key] = None
    return _run(func, args, kwargs)


_ENTRIES: dict[str, OpEntry] = {}
_SINGLE_NAMES: dict[str, str] = {}


def _register() -> None:
    for name in dir(torch):
        func = getattr(torch, name)
        if name.startswith("_foreach_"):
            entry = single_form(name)
            _ENTRIES[name] = entry
            known = entry_for(entry.func)
            _SINGLE_NAMES[name] = known.display if known.known else f"{known.display} (not in the table: non-linear)"
            HANDLERS[func] = _foreach_call
        elif name in {n.lstrip("?").removeprefix("torch.") for n in FUSED_OPTIMIZERS.names}:
            HANDLERS[func] = _fused_call


_register()
