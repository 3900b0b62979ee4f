"""Per-thread checking state: is typechecking on, strict about plain tensors, global on which axes."""

from __future__ import annotations

import threading

__all__ = ["STATE"]


class _CheckState(threading.local):
    checking: bool = False
    strict: bool = False
    # global SPMD: on, with these axes left in local SPMD
    global_mode: bool = False
    local_axes: frozenset = frozenset()
    # axes an explicit-partial op (spmd.sum(..., out_partial_axes=)) is about to make P
    out_partial: frozenset = frozenset()
    # set by the rules when the last inference depended on more than the operand types (a gradient-free mix of I,
    # an operand moved onto the current mesh): its result is not cached by types
    uncacheable: bool = False


STATE = _CheckState()
