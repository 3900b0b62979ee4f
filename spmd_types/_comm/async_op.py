"""What every typed op does first: ``async_op=`` (the published API's deferred wait), and, with no mesh current,
the mesh its typed input was typed on (``_core/implicit_mesh.py``).

A functional collective's result is a tensor whose wait can be deferred
(torch's ``AsyncCollectiveTensor``): the first op that reads it waits, so the
communication overlaps with whatever runs in between. With ``async_op=True``
outside ``typecheck()`` a collective returns such a tensor (views of it stay
deferred). Inside ``typecheck()`` its result is typed like the synchronous
call's (a typed tensor is never a wrapper), so it waits there. Ops that do not
communicate (``reinterpret``, ``convert``) have nothing to wait for.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

from .._core.implicit_mesh import mesh_of_space
from .._core.mesh import current_mesh, set_current_mesh
from .._core.state import STATE
from . import impl

__all__ = ["takes_async_op"]

F = TypeVar("F", bound=Callable[..., Any])


def takes_async_op(fn: F) -> F:
    """``fn`` with an ``async_op=False`` keyword: True defers the wait on its forward collective (outside checking)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if STATE.checking and args and current_mesh() is None:  # typed by groups alone: its own mesh
            own = mesh_of_space(getattr(getattr(args[0], "_spmd_types", None), "space", None))
            if own is not None:
                with set_current_mesh(own):
                    return wrapper(*args, async_op=async_op, **kwargs)
        if async_op is False:
            return fn(*args, **kwargs)
        if not isinstance(async_op, bool):
            raise TypeError(f"spmd.{fn.__name__}: async_op= takes True or False, got {async_op!r}")
        if STATE.checking or impl.DEFER[0]:  # typed like the synchronous call; or already deferring
            return fn(*args, **kwargs)
        impl.DEFER[0] = True
        try:
            return fn(*args, **kwargs)
        finally:
            impl.DEFER[0] = False

    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    extra = inspect.Parameter("async_op", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool")
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    wrapper.__signature__ = sig.replace(parameters=params[:at] + [extra] + params[at:])  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
