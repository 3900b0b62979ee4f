"""``spmd.trace()``: log every checked op with its operand and result types, at the user's line.

Each line goes to the ``spmd_types.trace`` logger at INFO, e.g.
``model.py:42  F.linear({dp: V, tp: R}, {dp: R, tp: V}) -> {dp: V, tp: V}``.
``SPMD_TYPES_TRACE=1`` in the environment turns it on for the whole run.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator

from .._core.errors import user_source_line
from .._core.state import STATE

__all__ = ["trace", "log_op"]

LOGGER = logging.getLogger("spmd_types.trace")


@contextlib.contextmanager
def trace(enabled: bool = True) -> Iterator[None]:
    """Log each checked op's input and output types at the user's line (logger ``spmd_types.trace``, INFO).

    Example::

        logging.basicConfig(level=logging.INFO)
        with spmd.typecheck(), spmd.trace():
            y = x @ w          # logs: train.py:12  Tensor.__matmul__({tp: R}, {tp: V}) -> {tp: V}
    """
    saved = STATE.tracing
    STATE.tracing = bool(enabled)
    try:
        yield
    finally:
        STATE.tracing = saved


def log_op(name: str, operands: Iterable[Any], result: Any) -> None:
    """One trace line: ``file:line  name(types, ...) -> types``."""
    where = user_source_line() or "?"
    where = where.split(": ", 1)[0]
    shown = ", ".join(_types(o) for o in operands)
    LOGGER.info("%s  %s(%s) -> %s", where, name, shown, _types(result))


def _types(x: Any) -> str:
    types = getattr(x, "_spmd_types", x)
    if types is None:
        return "untyped"
    fmt = getattr(types, "format", None)
    if fmt is not None:
        return fmt()
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_types(v) for v in x) + "]"
    return "untyped" if hasattr(x, "shape") else repr(x)
