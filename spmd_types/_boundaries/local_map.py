"""local_map and local(): run code in local SPMD (partition specs forgotten) inside a global SPMD program.

``local_map`` checks types on entry (against ``in_types``, unless they are
``Infer``) and on exit (against ``out_types``); the outputs then carry the
declared global types, partition specs included. Gradients follow by duality:
an input declared R gets a P gradient, and so on. ``local()`` is the same
switch for a block of code, with no boundary checks.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .._checker.asserts import assert_type
from .._checker.boundaries import declared_leaf, type_declared_outputs
from .._checker.declarations import check_positional
from .._core.dtensor_hook import interop, is_dtensor
from .._core.implicit_mesh import mesh_of_values
from .._core.mesh import Axis, current_mesh, require_mesh, resolve_axes, set_current_mesh
from .._core.state import STATE
from .._core.traced import pop_region, push_region, register_call, routed, traced_call, zero
from .._core.types import PartitionSpec, SpmdType

__all__ = ["local_map", "local", "Infer"]

TypeDict = Mapping[Axis, SpmdType]


class _InferType:
    """``in_types=Infer`` (the default): inputs enter as typed by the caller, unchecked at the boundary."""

    _instance: _InferType | None = None

    def __new__(cls) -> _InferType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "Infer"


Infer = _InferType()


def local_map(
    fn: Callable[..., Any] | None = None,
    *,
    in_types: Sequence[Any] | _InferType = Infer,
    out_types: Any,
    axes: Iterable[Axis] | None = None,
) -> Any:
    """Run ``fn`` in local SPMD on ``axes`` (default: every axis), checking types at its edges.

    ``in_types`` has one declaration per positional argument (``None`` skips one),
    or is ``Infer`` (the default: inputs keep the types they came with, unchecked);
    ``out_types`` is one declaration, or one per output. A declaration is a type
    dict (``S(d)`` says how a V value reassembles), a ``PartitionSpec``, or a
    ``(types, PartitionSpec)`` pair; a list of tensors takes a list of them.
    Outside :func:`spmd_types.typecheck` it is just ``fn``.

    Example::

        @spmd.local_map(in_types=[{"tp": spmd.S(1)}, {"tp": spmd.S(1)}], out_types={"tp": spmd.P})
        def row_parallel(h, w):
            return spmd.reinterpret(F.linear(h, w), "tp", src=spmd.V, dst=spmd.P)
    """

    _check_declarations(in_types, out_types)

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        name = f.__qualname__  # read here: dynamo cannot read a function's __qualname__ in a trace

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not STATE.checking:  # erased: fn as it is (DTensors included, as torchtitan's DTensor backends run it)
                return f(*args, **kwargs)
            if any(is_dtensor(a) for a in args):
                if in_types is Infer:
                    raise NotImplementedError("local_map on DTensor arguments needs in_types (Infer is not built "
                                              "for DTensors): declare one per positional argument")
                check_positional(f"local_map({name})", args, in_types)
                return interop().local_map_dtensor(wrapper, f, args, kwargs, in_types, out_types)
            inner = None if axes is None else [a for ax in axes for a in resolve_axes(ax)]
            if routed():  # torch.compile traces: the region's edges become graph nodes
                return _traced_region(f, name, args, kwargs, in_types, out_types, inner)
            if current_mesh() is None:  # typed by groups alone: the arguments' (or the declarations') mesh
                own = mesh_of_values(args, (in_types, out_types))
                if own is not None:
                    with set_current_mesh(own):
                        return wrapper(*args, **kwargs)
            mesh = require_mesh("local_map")
            if in_types is not Infer:
                args = _enter(f.__qualname__, args, in_types)
            with _local_on(mesh, inner):
                out = f(*args, **kwargs)
            return type_declared_outputs("local_map", f.__qualname__, out, out_types)

        return wrapper

    return decorate(fn) if fn is not None else decorate


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Check the block in local SPMD on every axis (partition specs forgotten); a no-op when not checking.

    For code that global SPMD cannot follow (data-dependent shapes, manual
    sharding, a custom kernel) inside a ``typecheck(local=False)`` program.
    Unlike :func:`local_map`, nothing is checked or retyped at the edges.

    Example::

        with spmd.local():
            scores = attention_kernel(q, k, v)
    """
    if not STATE.checking:
        yield
        return
    if routed():  # torch.compile traces: the block's edges become graph nodes
        traced_call("spmd.local.enter")
        try:
            yield
        finally:
            traced_call("spmd.local.exit")
        return
    if current_mesh() is None:  # types on their own meshes: every axis local for the block
        saved = STATE.global_mode
        STATE.global_mode = False
        try:
            yield
        finally:
            STATE.global_mode = saved
        return
    with _local_on(require_mesh("spmd.local"), None):
        yield


@contextlib.contextmanager
def _local_on(mesh: Any, names: list[str] | None) -> Iterator[None]:
    inner = frozenset(mesh.typed_axes) if names is None else frozenset(names)
    saved = (STATE.global_mode, STATE.local_axes)
    STATE.local_axes = saved[1] | inner
    STATE.global_mode = saved[0] and bool(set(mesh.typed_axes) - STATE.local_axes)
    try:
        yield
    finally:
        STATE.global_mode, STATE.local_axes = saved


# ---------------------------------------------------------------------------
# under torch.compile: an enter node and an exit node; the checker keeps the region open between them


def _traced_region(f: Callable[..., Any], name: str, args: tuple, kwargs: dict, in_types: Any, out_types: Any,
                   inner: list[str] | None) -> Any:
    if in_types is Infer:
        traced_call("local_map.enter", [], "Infer", inner, name)
    else:
        offset = check_positional(f"local_map({name})", args, in_types)
        traced_call("local_map.enter", list(args[offset:]), in_types, inner, name)
    out = f(*args, **kwargs)
    traced_call("local_map.exit", out, out_types, name)
    return out


def _enter_checked(args: list, in_types: Any, inner: list[str] | None, name: str) -> int:
    mesh = require_mesh("local_map")
    if in_types != "Infer":
        _enter(name, tuple(args), in_types)
    push_region(_local_on(mesh, inner))
    return 0


def _exit_checked(out: Any, out_types: Any, name: str) -> Any:
    pop_region()
    return type_declared_outputs("local_map", name, out, out_types)


def _local_enter_checked() -> int:
    push_region(_local_on(require_mesh("spmd.local"), None))
    return 0


def _local_exit_checked() -> int:
    pop_region()
    return 0


register_call("local_map.enter", _enter_checked, zero)
register_call("local_map.exit", _exit_checked, zero, rebinds=True)
register_call("spmd.local.enter", _local_enter_checked, zero)
register_call("spmd.local.exit", _local_exit_checked, zero)


def _enter(name: str, args: tuple, in_types: Sequence[Any]) -> tuple:
    offset = check_positional(f"local_map({name})", args, in_types)  # a leading tensor left out is an error
    return tuple(args[:offset]) + tuple(_assert_declared(a, spec) for a, spec in zip(args[offset:], in_types))


def _assert_declared(a: Any, spec: Any) -> Any:
    if spec is None:
        return a
    leaf = declared_leaf(spec)
    if leaf is not None and isinstance(a, torch.Tensor):
        return assert_type(a, leaf[0], partition_spec=leaf[1])
    if isinstance(a, (list, tuple)) and isinstance(spec, (list, tuple)) and len(a) == len(spec):
        return type(a)(_assert_declared(x, s) for x, s in zip(a, spec))
    if leaf is not None:
        raise TypeError(f"local_map: an argument declared {spec!r} is a {type(a).__name__}, not a tensor")
    raise TypeError(f"local_map: the declaration {spec!r} does not match the argument's structure "
                    f"({type(a).__name__})")


def _check_declarations(in_types: Any, out_types: Any) -> None:
    """``in_types``: Infer, or a sequence of declarations (or None); ``out_types``: one, or a sequence of them."""
    if in_types is not Infer and (isinstance(in_types, (Mapping, str, PartitionSpec))
                                  or not isinstance(in_types, Sequence)):
        raise TypeError(
            "local_map: in_types takes one type dict (or None) per positional argument, e.g. "
            f"[{{'tp': spmd.R}}]; got {in_types!r}"
        )
    entries = [] if in_types is Infer else [("in_types", i, d) for i, d in enumerate(in_types)]
    if declared_leaf(out_types) is None:
        if isinstance(out_types, str) or not isinstance(out_types, Sequence):
            raise TypeError(f"local_map: out_types takes a type dict, or one (or None) per output; got {out_types!r}")
        entries += [("out_types", i, d) for i, d in enumerate(out_types)]
    for what, i, d in entries:
        if d is Infer:
            raise TypeError(f"local_map: {what}[{i}] is Infer; only in_types as a whole may be Infer")
        if d is not None and declared_leaf(d) is None and not isinstance(d, (list, tuple)):
            raise TypeError(f"local_map: {what}[{i}] must be a type dict {{axis: type}} or None, got {d!r}")
