"""Boundaries that declare types: functions and modules (``typed_boundary``, ``attach_boundary``) and the
outputs of a region with declared types (``local_map``, ``no_typecheck``), each typed by ``assert_type``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from .._core.errors import Rejection, op_error
from .._core.state import STATE
from .._core.types import P, PartitionSpec, TypeMap, compatible
from .._local.transitions import route_call
from .asserts import TypeSpec, _placed, assert_type
from .declarations import check_declarations, check_module, check_positional
from .reading import present
from .tensor import make_typed

__all__ = ["typed_boundary", "attach_boundary", "declared_leaf", "type_declared_outputs"]


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

    check_declarations("spmd.typed_boundary", [] if in_types is None else in_types, out_types or [])

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not STATE.checking:
                return fn(*args, **kwargs)
            if in_types is not None:
                offset = check_positional(f"spmd.typed_boundary({fn.__qualname__})", args, in_types)
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
    check_module("spmd.attach_boundary", module)
    check_declarations("spmd.attach_boundary", [] if in_types is None else in_types, out_types or [])

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


# ---------------------------------------------------------------------------
# outputs of a region with declared types (local_map, no_typecheck)


def declared_leaf(spec: Any) -> tuple[Mapping, Any] | None:
    """A declared type for one tensor as ``(types, partition spec)``: a type dict, a PartitionSpec, or both as a pair.

    None for anything else (a sequence of declarations, say).
    """
    if isinstance(spec, Mapping):
        return spec, None
    if isinstance(spec, PartitionSpec):
        return {}, spec
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], Mapping) and (
            spec[1] is None or isinstance(spec[1], (PartitionSpec, tuple))):
        return spec[0], spec[1]
    return None


def type_declared_outputs(who: str, name: str, out: Any, out_types: Any) -> Any:
    """Give a region's outputs their declared types: one declaration, or one (or None) per output.

    ``who`` is how messages name the region (``local_map``, ``spmd.no_typecheck``).
    A declaration is a type dict, a PartitionSpec, or a ``(types, PartitionSpec)``
    pair; the output's structure says which (a tensor takes one declaration).
    A typed value that passed through the body must already be what is declared.
    """
    leaf = declared_leaf(out_types)
    if leaf is not None and (isinstance(out, torch.Tensor) or isinstance(out_types, Mapping)):
        return _type_declared(who, name, 0, out, leaf)
    if not isinstance(out, (tuple, list)) or len(out) != len(out_types):
        raise TypeError(f"{who}({name}): {len(out_types)} out_types for the {type(out).__name__} it returned")
    return type(out)(o if t is None else (type_declared_outputs(who, name, o, t) if declared_leaf(t) is None
                                          else _type_declared(who, name, i, o, declared_leaf(t)))
                     for i, (o, t) in enumerate(zip(out, out_types)))


def _type_declared(who: str, name: str, index: int, out: Any, declared: tuple[Mapping, Any]) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{who}({name}): output {index} is a {type(out).__name__}, not a tensor")
    want, spec = _placed(out, declared[0], declared[1])
    have: TypeMap | None = present(out, who)[0] if getattr(out, "_spmd_types", None) is not None else None
    if have is not None:
        for axis, w in want.items:
            h = have.get(axis)
            if w is P and h is not None and h.is_varying:
                continue  # each rank's piece of the declared pending sum: reinterpret(V, P), no communication either way
            if not compatible(h, w, out.dim()):
                fix = route_call(f"output{index}", axis, h, w) if h is not None else None
                raise op_error(
                    Rejection(
                        f"{who}: output {index} of {name} is {h} on axis '{axis}', and out_types declares {w}.",
                        [("output", f"{index}: {have.format()}"), ("declared", want.format()),
                         ("axis", f"'{axis}': {h} is not {w}")],
                        [fix + " before returning"] if fix else [],
                    ),
                    who.removeprefix("spmd."),
                    (),
                )
    typed = make_typed(out, want)
    if spec is not None:
        typed._spmd_spec = spec
    return typed
