"""Turning checking on, giving tensors types, and asserting types at boundaries.

Outside :func:`typecheck` every function here returns its input untouched, so
typed code runs as plain PyTorch (erasure).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar, Union

import torch

from ._errors import Rejection, op_error
from ._mesh import Axis, current_mesh, resolve_axis
from ._state import STATE
from ._tensor import make_typed, type_in_place
from ._transitions import route_call
from ._types import SpmdType, TypeMap, V, check_type_value

__all__ = ["typecheck", "assert_type", "get_type", "typed_boundary", "attach_boundary", "is_checking"]

T = TypeVar("T")
TypeSpec = Mapping[Axis, SpmdType]


@contextlib.contextmanager
def typecheck(*, strict: bool = False, local: bool | Mapping[str, bool] = True) -> Iterator[None]:
    """Check every op on typed tensors inside the block (local SPMD).

    ``strict=True`` also rejects a plain (untyped) tensor meeting a typed one;
    by default such a tensor is a constant that takes the other operand's type.
    Checking is per thread.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            y = spmd.assert_type(x, {"tp": spmd.R}) * 2
    """
    if local is not True:
        raise NotImplementedError(
            "global SPMD (typecheck(local=False) and per-axis local/global) is not built yet: "
            "only local SPMD typechecking is available"
        )
    saved = (STATE.checking, STATE.strict)
    STATE.checking, STATE.strict = True, strict
    try:
        yield
    finally:
        STATE.checking, STATE.strict = saved


def is_checking() -> bool:
    """True inside :func:`typecheck` on this thread."""
    return STATE.checking


def _normalize(types: TypeSpec, what: str) -> TypeMap:
    if not isinstance(types, Mapping):
        raise TypeError(f"{what} takes types as a dict {{axis: type}}, e.g. {{'tp': spmd.R}}; got {types!r}")
    mesh = current_mesh()
    if mesh is None:
        raise RuntimeError(f"{what} needs a current mesh: wrap the code in `with spmd.set_current_mesh(mesh):`")
    given = {resolve_axis(a): check_type_value(t, f"the type for axis {a!r}") for a, t in types.items()}
    full = {a: given.get(a, V) for a in mesh.axis_names}
    full.update(given)
    return TypeMap.of(full)


def assert_type(t: T, types: TypeSpec, partition_spec: Any = None) -> T:
    """Give ``t`` its SPMD types, or check the types it has.

    Inside :func:`typecheck`: a plain tensor comes back as an LTensor with
    ``types`` (axes of the current mesh that ``types`` leaves out are V); a
    typed tensor is checked and comes back unchanged; an ``nn.Parameter`` (or a
    leaf that requires grad) is typed in place and stays the same object; an
    ``nn.Module`` has every parameter and buffer typed. Outside
    :func:`typecheck` it returns ``t`` untouched.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            w = spmd.assert_type(torch.randn(16, 16), {"dp": spmd.I, "tp": spmd.I})
            spmd.assert_type(w, {"tp": spmd.I})  # passes
    """
    if not STATE.checking:
        return t
    if partition_spec is not None:
        raise NotImplementedError(
            "assert_type(..., partition_spec=...) needs global SPMD, which is not built yet"
        )
    want = _normalize(types, "assert_type")
    if isinstance(t, torch.nn.Module):
        for member in list(t.parameters()) + list(t.buffers()):
            _type_or_check(member, want, in_place=True)
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"assert_type takes a tensor or an nn.Module, got {type(t).__name__}")
    return _type_or_check(t, want)  # type: ignore[return-value]


def _type_or_check(t: torch.Tensor, want: TypeMap, in_place: bool = False) -> torch.Tensor:
    have = getattr(t, "_spmd_types", None)
    if have is None:
        if in_place or isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return type_in_place(t, want)
        return make_typed(t, want)
    _check(have, want)
    return t


def _compatible(have: SpmdType | None, want: SpmdType) -> bool:
    if have is want:
        return True
    # S(d) refines V; in local SPMD a V value may be any S(d), so both directions pass.
    return have is not None and have.is_varying and want.is_varying and (have is V or want is V)


def _check(have: TypeMap, want: TypeMap) -> None:
    for axis, w in want.items:
        h = have.get(axis)
        if _compatible(h, w):
            continue
        fix = route_call("x", axis, h, w) if h is not None else None
        raise op_error(
            Rejection(
                f"Type assertion failed: the tensor is {h} on axis '{axis}', and the assertion says {w}.",
                [("have", have.format()), ("want", want.format()), ("axis", f"'{axis}': {h} is not {w}")],
                [fix] if fix else [],
            ),
            "assert_type",
            ("x", "types"),
        )


def get_type(t: Any) -> dict[str, SpmdType] | None:
    """The tensor's ``{axis: type}``, or None if it is untyped.

    Example::

        spmd.get_type(x)   # {'dp': V, 'tp': R}
    """
    types = getattr(t, "_spmd_types", None) if isinstance(t, torch.Tensor) else None
    return types.as_dict() if types is not None else None


# ---------------------------------------------------------------------------
# module boundaries

OptTypes = Union[TypeSpec, None]


def _assert_all(values: Any, specs: Any, where: str) -> Any:
    if specs is None:
        return values
    if isinstance(specs, Mapping):
        return assert_type(values, specs)
    if not isinstance(values, (tuple, list)) or len(values) != len(specs):
        raise TypeError(f"{where}: {len(specs)} type specs for {type(values).__name__} {values!r:.60}")
    return type(values)(v if s is None else assert_type(v, s) for v, s in zip(values, specs))


def typed_boundary(
    in_types: Sequence[OptTypes] | None = None, out_types: OptTypes | Sequence[OptTypes] = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator asserting types on a function's positional tensor inputs and on its outputs.

    ``in_types`` has one entry per positional argument (``None`` skips one);
    ``out_types`` is one spec, or one per output. Gradients follow by duality:
    an input asserted R gets a P gradient, and so on. Does nothing outside
    :func:`typecheck`.

    Example::

        class Mlp(nn.Module):
            @spmd.typed_boundary(in_types=[{"tp": spmd.R}], out_types={"tp": spmd.P})
            def forward(self, x): ...
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not STATE.checking:
                return fn(*args, **kwargs)
            if in_types is not None:
                offset = len(args) - len(in_types)
                head, tail = args[:offset], args[offset:]
                args = tuple(head) + tuple(_assert_all(tuple(tail), list(in_types), fn.__qualname__))
            return _assert_all(fn(*args, **kwargs), out_types, fn.__qualname__)

        return wrapper

    return decorate


def attach_boundary(
    module: torch.nn.Module, in_types: Sequence[OptTypes] | None = None, out_types: OptTypes | Sequence[OptTypes] = None
) -> torch.nn.Module:
    """Assert types on ``module``'s forward inputs and outputs with forward hooks.

    Example::

        spmd.attach_boundary(block, in_types=[{"tp": spmd.R}], out_types={"tp": spmd.R})
    """

    def pre(mod: torch.nn.Module, args: tuple) -> tuple | None:
        if not STATE.checking or in_types is None:
            return None
        return tuple(_assert_all(tuple(args), list(in_types), type(mod).__name__))

    def post(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
        if not STATE.checking:
            return None
        return _assert_all(out, out_types, type(mod).__name__)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    return module
