"""How a registered autograd Function runs: as written, its typed inputs seen as the plain tensors they are.

Its forward and its hand-written backward run with subclass dispatch off: their ops are torch's own,
unchecked (the registration said what the Function does), and what the forward saved of its typed inputs
comes back to the backward typed but is used as plain tensors. Under a dispatch mode (the rank simulator)
a typed tensor is also the mode's subclass: the Function then gets plain aliases of its typed inputs
(``_plain``, ``unwrap``), as the published hooks and the decompositions always do.

Example::

    out = run_plain(cls, reg.original_apply, args, kwargs)   # the Function's own apply, unchecked inside
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .._checker.run_ops import _TYPED_CLASSES
from .._comm.call import unwrap
from .._torch.private import FUNCTION_APPLY, DisableTorchFunctionSubclass, len_torch_dispatch_stack

__all__ = ["original_apply", "run_plain", "plain_gradients", "plain", "plain_kw", "UNTYPED_LEAVES"]

_DisableTF = DisableTorchFunctionSubclass
_dispatch_depth = len_torch_dispatch_stack
_dynamo_tracing = torch.compiler.is_dynamo_compiling
# Function's own apply, unbound: a Python classmethod on torch 2.13, a C one on torch 2.14
_FUNCTION_BASE_APPLY = FUNCTION_APPLY


def original_apply(cls: type, own_apply: Callable[..., Any] | None, args: tuple, kwargs: dict) -> Any:
    """The class's own ``apply`` (the one registration replaced), else ``torch.autograd.Function``'s."""
    if own_apply is not None:
        return own_apply(cls, *args, **kwargs)
    return _FUNCTION_BASE_APPLY.__get__(None, cls)(*args, **kwargs)


def run_plain(cls: type, own_apply: Callable[..., Any] | None, args: tuple, kwargs: dict) -> Any:
    """The original ``apply`` on the typed inputs seen as plain tensors: subclass dispatch off.

    Under a dispatch mode (the rank simulator) a typed tensor is also a tensor subclass that the mode
    dispatches on, so the Function gets plain aliases of its inputs instead.
    """
    if _dispatch_depth():
        return original_apply(cls, own_apply, plain(args), plain_kw(kwargs))
    with _DisableTF():
        return original_apply(cls, own_apply, args, kwargs)


def plain_gradients(backward: Any) -> Any:
    """The class's hand-written backward, given plain gradients, as its forward was given plain inputs.

    A gradient can reach it typed (a transparent Function's backward computes it from saved typed values,
    typed by the forward rules, which say nothing about gradients); its own code, raw collectives
    included, then runs as it was written.
    """
    fn = backward.__func__ if isinstance(backward, staticmethod) else backward

    def plain_backward(ctx: Any, *grads: Any) -> Any:
        if _dynamo_tracing():  # torch.compile traces an untyped graph's Function: as written
            return fn(ctx, *grads)
        # typed values it saved in forward come back typed: subclass dispatch off, its ops run as written
        grads = tuple(unwrap(g) if type(g) in _TYPED_CLASSES else g for g in grads)
        if _dispatch_depth():  # under the rank simulator its forward was given aliases (run_plain)
            return fn(ctx, *grads)
        with _DisableTF():
            return fn(ctx, *grads)

    plain_backward.__wrapped__ = fn  # type: ignore[attr-defined]
    return plain_backward


def plain(a: Any) -> Any:
    """A plain alias of a typed tensor (autograd still reaches the original); lists and tuples element-wise."""
    tp = type(a)
    if tp in UNTYPED_LEAVES:
        return a
    if tp in _TYPED_CLASSES:
        return unwrap(a)
    if isinstance(a, torch.Tensor):
        return unwrap(a) if getattr(a, "_spmd_types", None) is not None else a
    if tp is list or tp is tuple:
        return tp([plain(x) for x in a])
    return a


def plain_kw(kwargs: Mapping[str, Any]) -> dict:
    return {k: plain(v) for k, v in kwargs.items()}


# Argument classes that are never typed and hold nothing typed (plain tensors, flags, groups, sizes).
UNTYPED_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, torch.dtype,
                            torch.device})
