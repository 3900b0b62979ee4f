"""local_map: run a function in local SPMD (partition specs forgotten) inside a global SPMD program.

Types are checked on entry (against ``in_types``) and on exit (against
``out_types``); the outputs then carry the declared global types, partition
specs included. Gradients follow by duality: an input declared R gets a P
gradient, and so on.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Mapping, Sequence

from .._checker.asserts import assert_type, type_declared_outputs
from .._checker.declarations import check_declarations, check_positional
from .._core.dtensor_hook import interop, is_dtensor
from .._core.mesh import Axis, require_mesh, resolve_axis
from .._core.state import STATE
from .._core.types import SpmdType

__all__ = ["local_map"]

TypeDict = Mapping[Axis, SpmdType]


def local_map(
    fn: Callable[..., Any] | None = None,
    *,
    in_types: Sequence[TypeDict | None],
    out_types: TypeDict | Sequence[TypeDict | None],
    axes: Iterable[Axis] | None = None,
) -> Any:
    """Run ``fn`` in local SPMD on ``axes`` (default: every axis), checking types at its edges.

    ``in_types`` has one type dict per positional argument (``None`` skips one;
    ``S(d)`` says how a V input reassembles); ``out_types`` is one dict, or one
    per output. Outside :func:`spmd_types.typecheck` it is just ``fn``.

    Example::

        @spmd.local_map(in_types=[{"tp": spmd.S(1)}, {"tp": spmd.S(1)}], out_types={"tp": spmd.P})
        def row_parallel(h, w):
            return spmd.reinterpret(F.linear(h, w), "tp", src=spmd.V, dst=spmd.P)
    """

    check_declarations("local_map", in_types, out_types)

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if any(is_dtensor(a) for a in args):
                check_positional(f"local_map({f.__qualname__})", args, in_types)
                return interop().local_map_dtensor(wrapper, f, args, kwargs, in_types, out_types)
            if not STATE.checking:
                return f(*args, **kwargs)
            mesh = require_mesh("local_map")
            offset = check_positional(f"local_map({f.__qualname__})", args, in_types)
            args = tuple(args[:offset]) + tuple(
                a if spec is None else assert_type(a, spec) for a, spec in zip(args[offset:], in_types)
            )
            inner = frozenset(mesh.axis_names) if axes is None else frozenset(resolve_axis(a) for a in axes)
            saved = (STATE.global_mode, STATE.local_axes)
            STATE.local_axes = saved[1] | inner
            STATE.global_mode = saved[0] and bool(set(mesh.axis_names) - STATE.local_axes)
            try:
                out = f(*args, **kwargs)
            finally:
                STATE.global_mode, STATE.local_axes = saved
            return _exit(f.__qualname__, out, out_types)

        return wrapper

    return decorate(fn) if fn is not None else decorate


def _exit(name: str, out: Any, out_types: TypeDict | Sequence[TypeDict | None]) -> Any:
    return type_declared_outputs("local_map", name, out, out_types)
