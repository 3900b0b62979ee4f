"""The published API's smaller calls: ``reinterpret_no_grad``, ``register_no_typecheck`` and ``set_dist``.

Example::

    mask = spmd.reinterpret_no_grad(mask, "tp", dst=spmd.I)   # R -> I on a tensor no gradient reaches

    @spmd.register_no_typecheck
    def debug_stats(x):            # every op run while it is on the stack is unchecked
        return x.float().norm()
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, TypeVar

import torch

from .._checker.mutate import mutate_type
from .._checker.published import get_local_type
from .._core.errors import SpmdTypeError
from .._core.types import I, R, Shard, V, check_type_value
from .._guards.unchecked_code import UNCHECKED_CODES

__all__ = ["reinterpret_no_grad", "register_no_typecheck", "set_dist"]

F = TypeVar("F", bound=Callable[..., Any])


def reinterpret_no_grad(tensor: torch.Tensor, axis: Any, *, dst: Any) -> torch.Tensor:
    """Retype ``tensor`` between R and I on ``axis`` in place, when no gradient can reach it.

    R and I hold the same value on every rank and differ only in their
    gradient, so for a tensor that does not require grad the change is free.

    Example::

        positions = spmd.reinterpret_no_grad(positions, "tp", dst=spmd.I)
    """
    from .._core.regions import normalize_axis

    if tensor.requires_grad:
        raise ValueError("reinterpret_no_grad needs a tensor that does not require grad (R and I differ only in "
                         "their gradient); use spmd.convert(x, axis, src=..., dst=...) for one that does")
    dst = check_type_value(dst, "reinterpret_no_grad: dst")
    local = V if isinstance(dst, Shard) else dst
    if local is not R and local is not I:
        raise ValueError(f"reinterpret_no_grad changes R to I or I to R; got dst={dst}")
    region = normalize_axis(axis)
    if region.size() == 1:
        return tensor
    have = get_local_type(tensor).get(region)
    if have is None:
        raise SpmdTypeError(f"reinterpret_no_grad: the tensor has no type on axis {region!r}")
    if have is not R and have is not I:
        raise SpmdTypeError(f"reinterpret_no_grad changes R to I or I to R, and the tensor is {have} on axis "
                            f"{region!r}")
    return mutate_type(tensor, region, src=have, dst=local)


def register_no_typecheck(fn: F) -> F:
    """Leave every op unchecked while ``fn`` runs, however it is reached; returns ``fn`` itself (no wrapper).

    ``@spmd.no_typecheck`` wraps a function, so only calls through the wrapper
    are unchecked; this registers ``fn``'s code (through ``functools.wraps``
    layers to the innermost function), so aliases, bound methods and stored
    callbacks are covered too.

    Example::

        spmd.register_no_typecheck(third_party.fused_norm)
    """
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        raise TypeError(f"register_no_typecheck takes a Python function, got {fn!r}")
    UNCHECKED_CODES.add(code)
    return fn


def set_dist(module: Any) -> None:
    """The published API's switch for the ``torch.distributed`` its collectives call (e.g. a comms wrapper).

    Here every collective is a functional collective (``torch.ops._c10d_functional``,
    traceable), not a ``torch.distributed`` call, so there is nothing to switch:
    ``None`` or ``torch.distributed`` itself is accepted; another module is
    ``NotImplementedError``.

    Example::

        spmd.set_dist(None)   # the default
    """
    import torch.distributed as dist

    if module is None or module is dist:
        return
    raise NotImplementedError(
        "spmd_types.set_dist(module) is not built: this package's collectives are functional collectives "
        "(torch.ops._c10d_functional), not torch.distributed calls that another module could replace"
    )
