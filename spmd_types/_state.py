"""Per-thread checking state: is typechecking on, and is it strict about plain tensors."""

from __future__ import annotations

import threading

__all__ = ["STATE"]


class _CheckState(threading.local):
    checking: bool = False
    strict: bool = False


STATE = _CheckState()
