"""Running a Function's ``spmd_typecheck`` hook: the published API's way for a Function to type itself.

The real ``apply`` runs first, on plain aliases of the typed arguments. The
hook then names the forward arguments it needs as keyword-only parameters
(bound by name from ``forward``'s signature, ``ctx`` left out) and either
returns the output type(s) (usually composed with ``spmd_types.rules``), which
are given to the outputs, or takes the outputs as a leading positional
parameter and types them itself. Every tensor output must end up typed; in a
hook that uses ``rules`` (the published 0.3 form) every tensor argument must
also reach a rule, an ``assert_type``, a read of its type or ``rules.ignore``
(a 0.2.5-style hook of asserts alone is not held to that); otherwise
``SpmdTypeError`` names what was missed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from .._core.errors import SpmdTypeError
from .._core.phantom import COVERAGE, RULES_USED, NdimWithSpmdType
from .._torch.private import tree_flatten
from .hook_rules import output

__all__ = ["run_spmd_typecheck", "bind_forward_args", "hook_shape", "hook_kwargs", "tensors_in"]


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def bind_forward_args(cls: type, args: tuple) -> dict[str, Any]:
    """``cls.apply(*args)``'s positionals by ``cls.forward``'s parameter names (``ctx`` left out)."""
    signature = _signature(cls.forward)
    has_ctx = cls.setup_context is torch.autograd.Function.setup_context
    bound = signature.bind(*((None, *args) if has_ctx else args))
    bound.apply_defaults()
    named = dict(bound.arguments)
    if has_ctx:
        named.pop(next(iter(signature.parameters)))
    return named


def hook_shape(cls: type) -> tuple[bool, tuple[str, ...]]:
    """``(returns types, the forward arguments it names)`` for ``cls.spmd_typecheck``."""
    params = list(_signature(cls.spmd_typecheck).parameters.values())
    returns = not params or params[0].kind is inspect.Parameter.KEYWORD_ONLY
    return returns, tuple(p.name for p in (params if returns else params[1:]))


def hook_kwargs(cls: type, forward_args: dict[str, Any], names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The hook's keyword arguments; a name ``forward`` lacks needs a default in the hook."""
    if names is None:
        names = hook_shape(cls)[1]
    params = _signature(cls.spmd_typecheck).parameters
    for name in names:
        if name not in forward_args and params[name].default is inspect.Parameter.empty:
            raise TypeError(f"{cls.__name__}.spmd_typecheck: {name!r} is not a parameter of {cls.__name__}.forward "
                            f"(it has {sorted(forward_args)})")
    return {name: forward_args[name] for name in names if name in forward_args}


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (int, float, bool, complex, str, NdimWithSpmdType)):
        return []
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def run_spmd_typecheck(cls: type, real_apply: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    """``real_apply()`` (the Function on plain aliases), then ``cls.spmd_typecheck`` types its outputs."""
    who = f"{cls.__name__}.spmd_typecheck"
    if kwargs:
        raise TypeError(f"{cls.__name__}.apply() takes positional arguments only (its spmd_typecheck hook binds them "
                        "by forward's parameter names)")
    forward_args = bind_forward_args(cls, args)
    returns, names = hook_shape(cls)
    hook_args = hook_kwargs(cls, forward_args, names)
    outputs = real_apply()
    COVERAGE.stack.append(set())
    try:
        if returns:
            result = cls.spmd_typecheck(**hook_args)
            if result is None and tensors_in(outputs):
                raise SpmdTypeError(f"{who}: returned None; a keyword-only spmd_typecheck returns the output type(s) "
                                    "(an NdimWithSpmdType, a typed tensor, or a tuple of them)")
            output(outputs, result)
        else:
            cls.spmd_typecheck(outputs, **hook_args)
    finally:
        touched = COVERAGE.stack.pop()
    _check_coverage(who, forward_args, touched, outputs)
    return outputs


def _check_coverage(who: str, forward_args: dict[str, Any], touched: set, outputs: Any) -> None:
    """Outputs typed; and, in a hook that uses ``rules`` (the published 0.3 form), every tensor argument used."""
    for name, value in forward_args.items() if RULES_USED in touched else ():
        if any(id(t) not in touched for t in tensors_in(value)):
            raise SpmdTypeError(f"{who}: tensor argument {name!r} was not accounted for: pass it to the rules "
                                f"operation that consumes it, assert_type it, or declare rules.ignore({name}) if the "
                                "forward value does not depend on it")
    for i, t in enumerate(tensors_in(outputs)):
        if getattr(t, "_spmd_types", None) is None:
            raise SpmdTypeError(f"{who}: output {i} was left untyped: return its type from the hook, or finish with "
                                "rules.output(out, <NdimWithSpmdType>) or assert_type(out, ...)")
