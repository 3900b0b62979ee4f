"""Tracebacks of SpmdTypeError that show the user's frames, not the checker's.

The message already names the user's line (``at:``); the traceback can say the
same by leaving out the package's own frames (and torch's dispatch frames in
between). Modes, from ``SPMD_TYPES_TRACEBACK_FILTERING`` or
:func:`traceback_filtering`:

* ``off``: tracebacks as Python builds them;
* ``tracebackhide``: the package's modules hide their frames from pytest and
  IPython (``__tracebackhide__``), for SpmdTypeError only;
* ``quiet_remove_frames``: an SpmdTypeError leaving a ``traceback_filtering()``
  block has its traceback rebuilt without the package's and torch's frames;
* ``remove_frames``: the same, with the full traceback kept as ``__cause__``;
* ``auto`` (the default): ``tracebackhide`` under pytest or IPython, else
  ``quiet_remove_frames``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import types
from typing import Any

from .errors import SpmdTypeError

__all__ = ["traceback_filtering", "hide_frames", "filter_traceback", "UnfilteredStackTrace"]

MODES = ("off", "auto", "tracebackhide", "quiet_remove_frames", "remove_frames")
_MODE = [os.environ.get("SPMD_TYPES_TRACEBACK_FILTERING", "auto")]
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UnfilteredStackTrace(Exception):
    """Carries the full traceback of a filtered SpmdTypeError (``remove_frames`` mode) as its ``__cause__``."""


def _mode() -> str:
    mode = _MODE[0]
    if mode not in MODES:
        return "off"
    if mode == "auto":
        return "tracebackhide" if ("pytest" in sys.modules or "IPython" in sys.modules) else "quiet_remove_frames"
    return mode


def hide_frames(excinfo: Any) -> bool:
    """pytest's ``__tracebackhide__`` hook for the package's modules: hide them for an SpmdTypeError."""
    if _mode() == "off":
        return False
    try:
        return excinfo.errisinstance(SpmdTypeError)
    except AttributeError:  # IPython passes no excinfo
        return True


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PKG) or path.startswith(os.path.dirname(os.path.abspath(contextlib.__file__))) or \
        f"{os.sep}torch{os.sep}" in path or filename.startswith("<")


def filter_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the package's, torch's and the standard library's frames."""
    out = None
    for frame, lineno in reversed(list(traceback.walk_tb(tb))):
        if not _internal(frame.f_code.co_filename):
            out = types.TracebackType(out, frame, frame.f_lasti, lineno)
    return out


NOTE = ("spmd_types left its own and torch's frames out of this traceback; "
        "SPMD_TYPES_TRACEBACK_FILTERING=off (or spmd.traceback_filtering('off')) keeps them")


class _Filtering:
    """The block :func:`traceback_filtering` returns: sets the mode inside; filters an SpmdTypeError leaving it.

    A class, not a generator: ``contextlib.contextmanager`` puts the original
    traceback back on an exception that leaves its block, which would undo the filtering.
    """

    __slots__ = ("mode", "saved")

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.saved = mode

    def __enter__(self) -> None:
        self.saved = _MODE[0]
        _MODE[0] = self.mode

    def __exit__(self, kind: Any, err: BaseException | None, tb: types.TracebackType | None) -> bool:
        try:
            if isinstance(err, SpmdTypeError) and not getattr(err, "_spmd_filtered", False):
                resolved = _mode()  # the innermost block's mode decides
                if resolved in ("quiet_remove_frames", "remove_frames"):
                    _filter(err, keep_full=resolved == "remove_frames")
        finally:
            _MODE[0] = self.saved
        return False


def _filter(err: SpmdTypeError, keep_full: bool) -> None:
    """Rebuild ``err``'s traceback without internal frames, once, with one note saying how to see them."""
    full = err.__traceback__
    if keep_full:
        unfiltered = UnfilteredStackTrace("the full traceback of the SpmdTypeError below")
        unfiltered.__traceback__ = full
        unfiltered.__cause__ = err.__cause__
        err.__cause__ = unfiltered
    err.__traceback__ = filter_traceback(full)
    err.add_note(NOTE)
    err._spmd_filtered = True  # type: ignore[attr-defined]  # nested blocks filter once


def traceback_filtering(mode: str = "auto") -> _Filtering:
    """Filter the traceback of an SpmdTypeError leaving the block (and set the mode inside it).

    Modes: ``off``, ``auto`` (the default), ``tracebackhide``,
    ``quiet_remove_frames``, ``remove_frames`` (the full traceback kept as
    ``__cause__``); an unknown mode is a ``ValueError``. A filtered error
    carries one note saying how to see every frame.

    Example::

        with spmd.traceback_filtering():
            train_step(model, batch)   # an SpmdTypeError shows your frames only
        with spmd.traceback_filtering("off"):
            ...                        # the full traceback
    """
    if mode not in MODES:
        raise ValueError(f"traceback_filtering: mode must be one of {', '.join(MODES)}; got {mode!r}")
    return _Filtering(mode)
