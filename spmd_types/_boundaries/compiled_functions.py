"""Registered autograd Functions under ``torch.compile`` with checking on: they run eagerly, between graphs.

Dynamo traces a custom Function into a graph node that no longer says which Function it was, so the
compiled graph's checker could not apply its registration. A registered class's ``apply`` is therefore
made dynamo-disabled once a compile starts, and its forward breaks dynamo's trace while checking is on:
the Function runs eagerly, checked by its registration, on the typed values the graph before it returns
(``fullgraph=True`` refuses the break; docs/compile.md).

Example::

    cls.apply = classmethod(dynamo_disabled(typed_apply))
    cls.forward = staticmethod(breaks_a_checked_trace(cls.forward))
"""

from __future__ import annotations

from typing import Any, Callable

from .._core.state import STATE
from .._core.traced import dynamo_tracing
from .._torch.private import graph_break, loaded_dynamo

__all__ = ["dynamo_disabled", "breaks_a_checked_trace"]

_DISABLED: dict[Callable, Callable] = {}  # fn -> torch._dynamo.disable(fn), made once


def dynamo_disabled(fn: Callable) -> Callable:
    """``fn``, or (once torch._dynamo is imported) its dynamo-disabled form: torch.compile never traces it.

    On torch 2.14 importing ``torch._dynamo`` imports FSDP, which imports this package: dynamo is then in
    ``sys.modules`` half made, without ``disable``; the plain form serves until a compile starts.
    """
    done = _DISABLED.get(fn)
    if done is not None:
        return done
    disable = getattr(loaded_dynamo(), "disable", None)
    if disable is None:
        return fn
    _DISABLED[fn] = disable(fn)
    return _DISABLED[fn]


def breaks_a_checked_trace(forward: Any) -> Any:
    """The class's forward; while dynamo traces it with checking on, a graph break: the Function runs eagerly."""
    fn = forward.__func__ if isinstance(forward, staticmethod) else forward

    def forward_(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if dynamo_tracing() and STATE.checking:
            graph_break()
        return fn(ctx, *args, **kwargs)

    forward_.__wrapped__ = fn  # type: ignore[attr-defined]
    return forward_
