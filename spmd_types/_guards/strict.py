"""Strict typechecking's checks that are not about one op's operands.

``typecheck(strict=True)`` already rejects a plain tensor meeting a typed one
in an op (``_rules``). Two more places can let an untyped value slip in:

* a typed collective (``spmd.all_reduce`` ...) given a plain tensor: its
  ``src=`` cannot be checked against anything (:func:`untyped_input`);
* ``backward()`` from a plain (untyped) loss that reaches typed leaves: the
  seed gradient 1 means one thing for an I loss, the mesh size for an R loss,
  a per-rank list for a V loss; with no type nothing says which
  (:func:`check_typed_root`).

A backward from a typed root runs inside :func:`typed_root`, which marks this
thread; a typed leaf's gradient hook calls :func:`check_typed_root`, which, in
strict mode, rejects an accumulation with no typed root on the thread. The
autograd engine runs CPU work on the thread that called ``backward()``;
elsewhere (a device's own engine thread) checking is off, so nothing is
reported there, never wrongly.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.mesh import current_mesh
from .._core.state import STATE

__all__ = ["typed_root", "check_typed_root", "untyped_input"]


class _Roots(threading.local):
    depth: int = 0


_ROOTS = _Roots()


@contextlib.contextmanager
def typed_root() -> Iterator[None]:
    """Mark a ``backward()`` from a typed root as running on this thread."""
    _ROOTS.depth += 1
    try:
        yield
    finally:
        _ROOTS.depth -= 1


def check_typed_root(param: Any, types: Any) -> None:
    """Strict mode: a typed leaf got a gradient from a backward with no typed root (an untyped loss)."""
    if _ROOTS.depth or not (STATE.checking and STATE.strict):
        return
    mesh = current_mesh()
    axes = mesh.axis_names if mesh is not None else tuple(a for a, _ in types.items)
    spelled = "{" + ", ".join(f"'{a}': ..." for a in axes) + "}"
    raise SpmdTypeError(
        Rejection(
            "Strict typechecking: backward() ran from a plain (untyped) loss and reached a typed leaf. "
            "The seed gradient 1 on every rank means 1 for an I loss, the mesh size for an R loss and "
            "a per-rank list for a V loss; an untyped loss says none of these.",
            [("leaf", f"{tuple(param.shape)} typed {types.format()}"), ("loss", "plain tensor (untyped)")],
            [f"loss = spmd.assert_type(loss, {spelled}) before loss.backward(), with the loss's own types"],
        ),
        user_source_line(),
    )


def untyped_input(opname: str, call_text: str, names: tuple[str, ...], src: Any) -> SpmdTypeError:
    """Strict mode: a typed communication op was given a plain tensor."""
    spelled = "{" + ", ".join(f"'{n}': {src.code()}" for n in names) + "}"
    return SpmdTypeError(
        Rejection(
            f"Strict typechecking: {opname} got a plain (untyped) tensor, so its src={src} cannot be "
            "checked; give it a type first.",
            [("op", call_text), ("input", "plain tensor (untyped)")],
            [f"spmd.assert_type(x, {spelled})"],
        ),
        user_source_line(),
    )
