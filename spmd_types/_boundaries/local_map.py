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

    _check_declarations(in_types, out_types)

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if any(is_dtensor(a) for a in args):
                return interop().local_map_dtensor(wrapper, f, args, kwargs, in_types, out_types)
            if not STATE.checking:
                return f(*args, **kwargs)
            mesh = require_mesh("local_map")
            offset = len(args) - len(in_types)
            if offset < 0:
                raise TypeError(f"local_map({f.__qualname__}): {len(in_types)} in_types for {len(args)} arguments")
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


def _check_declarations(in_types: Any, out_types: Any) -> None:
    """``in_types``: a sequence of type dicts (or None); ``out_types``: a type dict, or a sequence of them."""
    if isinstance(in_types, (Mapping, str)) or not isinstance(in_types, Sequence):
        raise TypeError(
            "local_map: in_types takes one type dict (or None) per positional argument, e.g. "
            f"[{{'tp': spmd.R}}]; got {in_types!r}"
        )
    entries = [("in_types", i, d) for i, d in enumerate(in_types)]
    if not isinstance(out_types, Mapping):
        if isinstance(out_types, str) or not isinstance(out_types, Sequence):
            raise TypeError(f"local_map: out_types takes a type dict, or one (or None) per output; got {out_types!r}")
        entries += [("out_types", i, d) for i, d in enumerate(out_types)]
    for what, i, d in entries:
        if d is not None and not isinstance(d, Mapping):
            raise TypeError(f"local_map: {what}[{i}] must be a type dict {{axis: type}} or None, got {d!r}")


def _exit(name: str, out: Any, out_types: TypeDict | Sequence[TypeDict | None]) -> Any:
    return type_declared_outputs("local_map", name, out, out_types)
