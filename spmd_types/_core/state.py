"""Per-thread checking state: is typechecking on, strict about plain tensors, global on which axes."""

from __future__ import annotations

import os
import threading

__all__ = ["STATE", "checking_turned_on", "is_type_checking", "TYPE_CHECKING", "BY_GRADIENT", "BY_MESH", "BY_GRADIENT_AND_MESH",
           "mark_uncacheable"]


class _CheckState(threading.local):
    def __init__(self) -> None:
        # Set on every thread's own instance (not read from class defaults): torch.compile guards on
        # these reads, and a guard on a class attribute of a threading.local fails on a fresh thread.
        self.checking = False
        self.strict = False
        # global SPMD: on, with these axes left in local SPMD
        self.global_mode = False
        self.local_axes: frozenset = frozenset()
        # axes an explicit-partial op (spmd.sum(..., out_partial_axes=)) is about to make P
        self.out_partial: frozenset = frozenset()
        # set by the rules when the last inference depended on more than the operand types (an operand moved
        # onto the current mesh: True); BY_GRADIENT when it depended on the types and on which operands carry a
        # gradient only (a gradient-free mix of I): cached by types and those bits
        self.uncacheable: bool | str = False
        # spmd.trace() (or SPMD_TYPES_TRACE=1): log every checked op
        self.tracing = os.environ.get("SPMD_TYPES_TRACE", "") == "1"


STATE = _CheckState()
# True until a thread first turns checking on; until then no thread checks, and the erased assert_type (the call a
# process that never checks makes, up to a hundred times a step) reads this module global, not the per-thread flag
# (a thread-local read costs it about 50 ns). Whatever sets STATE.checking to True calls checking_turned_on() first.
never_checked = True


def checking_turned_on() -> None:
    """Note that some thread checks from now on (the erased assert_type reads ``STATE.checking`` since)."""
    global never_checked
    never_checked = False


BY_GRADIENT = "by gradient"  # STATE.uncacheable: the answer also read which operands carry a gradient
BY_MESH = "by mesh"  # STATE.uncacheable: the answer also read the current mesh (operands moved onto it)
BY_GRADIENT_AND_MESH = "by gradient and mesh"  # both of the above
_KEYED = {BY_GRADIENT: {BY_GRADIENT}, BY_MESH: {BY_MESH}, BY_GRADIENT_AND_MESH: {BY_GRADIENT, BY_MESH}}


def mark_uncacheable(reason: bool | str) -> None:
    """Record that the answer being worked out read more than its cache key: ``True`` (anything, never
    cached), or ``BY_GRADIENT`` / ``BY_MESH`` (that only: a cache adds the operands' gradient bits, or the
    current mesh's token, to its key); the two together are ``BY_GRADIENT_AND_MESH``."""
    have = STATE.uncacheable
    if have is True or reason is True:
        STATE.uncacheable = True
    elif have is False:
        STATE.uncacheable = reason
    else:
        both = _KEYED[have] | _KEYED[reason]  # type: ignore[index]
        STATE.uncacheable = BY_GRADIENT_AND_MESH if len(both) == 2 else reason


def is_type_checking() -> bool:
    """True inside :func:`spmd_types.typecheck` on this thread.

    Example::

        if spmd.is_type_checking():
            spmd.mutate_type(counts, "tp", src=spmd.P, dst=spmd.V)
    """
    return STATE.checking


class _TypeChecking:
    """``spmd.TYPE_CHECKING``: true exactly while checking is on (``bool()`` reads the flag each time)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return STATE.checking

    def __repr__(self) -> str:
        return f"TYPE_CHECKING({STATE.checking})"


TYPE_CHECKING = _TypeChecking()
