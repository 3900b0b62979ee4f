"""``spmd.no_typecheck``: code the checker cannot see, with its types declared at the edges.

As a ``with`` block it only switches checking off on this thread (values
computed inside come out plain; give them types with ``assert_type``). As a
decorator with ``in_types=`` / ``out_types=`` it checks the inputs on entry,
runs the body unchecked, and types the outputs on exit, so the code around
it stays checked. Gradients follow by duality from the declared types: the
body is trusted, as a registered ``transparent=False`` autograd Function is.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

from .._checker.asserts import assert_type
from .._checker.boundaries import type_declared_outputs
from .._checker.latent import apply_remembered
from .._core.mesh import Axis
from .._core.state import STATE
from .._core.traced import pop_region, push_region, register_call, routed, traced_call, zero
from .._core.types import SpmdType

__all__ = ["no_typecheck"]

TypeDict = Mapping[Axis, SpmdType]


def no_typecheck(
    fn: Callable[..., Any] | None = None,
    *,
    in_types: Sequence[TypeDict | None] | None = None,
    out_types: TypeDict | Sequence[TypeDict | None] | None = None,
) -> Any:
    """Run code unchecked: a ``with`` block, or a function whose inputs and outputs have declared types.

    ``in_types`` has one type dict per positional argument (``None`` skips
    one; extra leading arguments such as ``self`` are skipped); ``out_types``
    is one dict, or one per output (``None`` leaves that output plain).

    Example::

        @spmd.no_typecheck(in_types=[{"tp": spmd.V}], out_types={"tp": spmd.V})
        def fused_kernel(x):
            return my_triton_op(x)      # not checked; the result is typed V on tp

        with spmd.no_typecheck():
            stats = debug_stats(x)      # plain values, checking off in this block
    """
    if isinstance(in_types, Mapping):
        raise TypeError(
            f"spmd.no_typecheck: in_types takes one type dict (or None) per positional argument, got one dict "
            f"{in_types!r}: write in_types=[{in_types!r}]"
        )
    region = _Region(in_types, out_types)
    return region(fn) if fn is not None else region


class _Region:
    def __init__(self, in_types: Any, out_types: Any) -> None:
        self.in_types, self.out_types = in_types, out_types
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        if self.in_types is not None or self.out_types is not None:
            raise TypeError(
                "spmd.no_typecheck: in_types= and out_types= type a function's arguments and results; decorate "
                "the function (@spmd.no_typecheck(in_types=..., out_types=...)), or use a bare "
                "`with spmd.no_typecheck():` and assert_type its results"
            )
        if STATE.checking and routed():  # torch.compile traces: the block's edges become graph nodes
            self._saved.append(None)
            traced_call("no_typecheck.enter", [], NONE_DECLARED, "block")
            return
        self._saved.append(STATE.checking)
        STATE.checking = False

    def __exit__(self, *exc: Any) -> None:
        saved = self._saved.pop()
        if saved is None:
            traced_call("no_typecheck.exit", [], NONE_DECLARED, "block")
            return
        STATE.checking = saved
        if STATE.checking and exc[0] is None:
            apply_remembered(assert_type)  # what assert_type was told inside the block

    def __call__(self, f: Callable[..., Any]) -> Callable[..., Any]:
        in_types, out_types = self.in_types, self.out_types
        name = f.__qualname__  # read here: dynamo cannot read a function's __qualname__ in a trace

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not STATE.checking:
                return f(*args, **kwargs)
            if routed():  # torch.compile traces: the function's edges become graph nodes
                offset = len(args) - (0 if in_types is None else len(in_types))
                traced_call("no_typecheck.enter", list(args[max(offset, 0):]) if in_types is not None else [],
                            NONE_DECLARED if in_types is None else in_types, name)
                out = f(*args, **kwargs)
                traced_call("no_typecheck.exit", out if out_types is not None else [],
                            NONE_DECLARED if out_types is None else out_types, name)
                return out
            if in_types is not None:
                offset = len(args) - len(in_types)
                if offset < 0:
                    raise TypeError(
                        f"spmd.no_typecheck({f.__qualname__}): {len(in_types)} in_types for {len(args)} arguments"
                    )
                args = tuple(args[:offset]) + tuple(
                    a if spec is None else assert_type(a, spec) for a, spec in zip(args[offset:], in_types)
                )
            STATE.checking = False
            try:
                out = f(*args, **kwargs)
            finally:
                STATE.checking = True
            return out if out_types is None else _type_outputs(f.__qualname__, out, out_types)

        return wrapper


def _type_outputs(name: str, out: Any, out_types: Any) -> Any:
    return type_declared_outputs("spmd.no_typecheck", name, out, out_types)


# ---------------------------------------------------------------------------
# under torch.compile: an enter node and an exit node; the checker runs the body unchecked between them

NONE_DECLARED = "none declared"


def _enter_checked(args: list, in_types: Any, name: str) -> int:
    if in_types != NONE_DECLARED:
        offset = len(args) - len(in_types)
        if offset < 0:
            raise TypeError(f"spmd.no_typecheck({name}): {len(in_types)} in_types for {len(args)} arguments")
        for a, spec in zip(args[offset:], in_types):
            if spec is not None:
                assert_type(a, spec)
    push_region(_Unchecked())
    return 0


def _exit_checked(out: Any, out_types: Any, name: str) -> Any:
    pop_region()
    return out if out_types == NONE_DECLARED else _type_outputs(name, out, out_types)


class _Unchecked:
    """The checker inside a no_typecheck region: checking off, and what assert_type was told applied at its end."""

    def __enter__(self) -> None:
        self.saved = STATE.checking
        STATE.checking = False

    def __exit__(self, *exc: Any) -> None:
        STATE.checking = self.saved
        if STATE.checking:
            apply_remembered(assert_type)


register_call("no_typecheck.enter", _enter_checked, zero)
register_call("no_typecheck.exit", _exit_checked, zero, rebinds=True)
