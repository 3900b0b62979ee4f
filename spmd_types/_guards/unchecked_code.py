"""Functions registered with ``spmd.register_no_typecheck``: ops run while one of them is on the stack are unchecked.

The registry holds code objects, so every way of reaching the function (an
import alias, a bound method, a stored callback) is covered without wrapping
it. Checking an op looks for them on the current thread's stack only while the
registry is not empty.
"""

from __future__ import annotations

import sys
from types import CodeType

__all__ = ["UNCHECKED_CODES", "in_unchecked_code"]

UNCHECKED_CODES: set[CodeType] = set()


def in_unchecked_code() -> bool:
    """Whether a registered function is running on this thread (somewhere up the stack)."""
    frame = sys._getframe(1)
    codes = UNCHECKED_CODES
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False
