"""SpmdTypeError and the one place its message is assembled.

A message states the rule broken, then what was seen (op, operand types,
axis), then the user's own source line, then the fix: the exact call that
makes the program well typed. Plain text off a terminal; rendered with
``rich`` when stderr is a terminal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

__all__ = ["SpmdTypeError", "RedistributeError", "DTensorPropagationError", "Rejection", "user_source_line"]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # spmd_types/
_SKIP_DIRS: tuple[str, ...] = (_PKG_DIR + os.sep,)


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def user_source_line() -> str | None:
    """``path:line: code`` of the innermost frame outside spmd_types, torch and the stdlib."""
    found = user_source()
    return found[0] if found else None


def user_source(start: Any = None) -> tuple[str, str] | None:
    """``(path:line: code, code)`` of the innermost user frame (from frame ``start`` outwards), or None.

    While a compiled graph is checked (:func:`checking_at`), the innermost user frame is the graph
    node's own: the line the user wrote, recorded when the graph was traced.
    """
    _init_skip_dirs()
    if start is None and _SITE.site is not None:
        return _format_site(*_SITE.site)
    frame = sys._getframe(1) if start is None else start
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return _format_site(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's (not this package's, torch's or the standard library's)."""
    _init_skip_dirs()
    # typing_extensions: its @deprecated wrapper sits between the user and a deprecated torch function
    return (not os.path.abspath(filename).startswith(_SKIP_DIRS) and not filename.startswith("<")
            and not filename.endswith("typing_extensions.py"))


def _init_skip_dirs() -> None:
    global _SKIP_DIRS
    if len(_SKIP_DIRS) == 1:
        # with a trailing separator: torch's folder is a prefix of torchtitan's, which is user code
        _SKIP_DIRS = tuple(d + os.sep for d in (_PKG_DIR, _torch_dir(), os.path.dirname(contextlib.__file__)))


def _format_site(filename: str, lineno: int) -> tuple[str, str]:
    code = linecache.getline(filename, lineno).strip()
    full = os.path.abspath(filename)
    try:
        shown = os.path.relpath(full)
    except ValueError:
        shown = full
    if shown.startswith(".."):
        shown = full
    return f"{shown}:{lineno}: {code}", code


class _Site(threading.local):
    site: tuple[str, int] | None = None


_SITE = _Site()


@contextlib.contextmanager
def checking_at(filename: str | None, lineno: int) -> Iterator[None]:
    """Report ``filename:lineno`` as the user's line of every error raised inside (a compiled graph's node)."""
    saved = _SITE.site
    _SITE.site = None if filename is None else (filename, lineno)
    try:
        yield
    finally:
        _SITE.site = saved


@dataclass
class Rejection:
    """Why a check failed, before it is turned into a message.

    ``rule`` is the rule broken, ``seen`` the (label, value) lines that show
    what was seen, ``fixes`` the calls that would make it well typed.
    """

    rule: str
    seen: Sequence[tuple[str, str]] = ()
    fixes: Sequence[str] = ()
    notes: Sequence[str] = field(default_factory=tuple)


class SpmdTypeError(TypeError, RuntimeError):
    """A program that is not well typed under the SPMD typing rules.

    ``str(err)`` is the full message; ``err.rule``, ``err.fixes`` and
    ``err.source`` hold its parts. A ``TypeError`` (CONTRACT section 10) and,
    as the published package's is, a ``RuntimeError``; ``context=`` (the
    published API's keyword) is shown after the message.

    Example::

        try:
            y = p * p  # both Partial
        except spmd.SpmdTypeError as err:
            print(err.fixes[0])   # spmd.all_reduce(...)
    """

    def __init__(self, msg: Rejection | str, source: str | None = None, *, context: str | None = None) -> None:
        rejection = msg  # the published parameter name: a message, or here a Rejection
        if isinstance(rejection, str):
            rejection = Rejection(rejection)
        self.rejection = rejection
        self.rule = rejection.rule
        self.seen = tuple(rejection.seen)
        self.fixes = tuple(rejection.fixes)
        self.notes = tuple(rejection.notes)
        self.source = source
        self.context = context
        self.plain = format_plain(rejection, source) + (f"\n\n{context}" if context else "")
        shown = _render(rejection, source, self.plain)
        super().__init__(shown + (f"\n\n{context}" if context and shown is not self.plain else ""))
        self._shown_context = context

    def __str__(self) -> str:
        """The message, and a ``context`` set after the error was made (as the published API allows)."""
        text = super().__str__()
        late = getattr(self, "context", None)
        if late and late != getattr(self, "_shown_context", None):
            text += f"\n\n{late}"
        return text

    def __reduce__(self):
        return (_rebuilt, (type(self), Rejection(self.rule, self.seen, self.fixes, self.notes), self.source,
                           self.context))


def _rebuilt(cls: type, rejection: Rejection, source: str | None, context: str | None) -> SpmdTypeError:
    return cls(rejection, source, context=context)


class RedistributeError(SpmdTypeError):
    """A collective or redistribute that the layout does not allow (gathering an axis that is not the minor-most
    of its dim), as the published package names it.

    Example::

        try:
            spmd.all_gather(x, "tp", src=spmd.S(0), dst=spmd.R)   # dim 0 sharded on ("tp", "dp")
        except spmd.RedistributeError as err:
            print(err.fixes[0])
    """


class DTensorPropagationError(SpmdTypeError):
    """Global SPMD: an op whose result's layout no shard rule gives (the published package's name).

    Example::

        try:
            y = x.reshape(6, 2, 4)   # x sharded on dim 1 in global SPMD
        except spmd.DTensorPropagationError as err:
            print(err.rule)
    """


def op_error(rejection: Rejection, attr_name: str, params: tuple[str, ...],
             cls: type[SpmdTypeError] = SpmdTypeError) -> SpmdTypeError:
    """The error for a rejected op, with operands spelled as in the user's own line where possible."""
    from .source import operand_expressions

    found = user_source()
    if found is None:
        return cls(rejection, None)
    source, code = found
    exprs = operand_expressions(code, attr_name, params)
    exprs = {label: e for label, e in exprs.items() if label != e}
    if exprs:
        fixes = []
        for fix in rejection.fixes:
            for label, expr in exprs.items():
                fix = fix.replace(f"({label}, ", f"({expr}, ")
            fixes.append(fix)
        seen = []
        for key, value in rejection.seen:
            if key == "operands":
                lines = []
                for line in value.split("\n"):
                    label, _, rest = line.partition(": ")
                    lines.append(f"{label} ({exprs[label]}): {rest}" if label in exprs else line)
                value = "\n".join(lines)
            seen.append((key, value))
        rejection = dataclasses.replace(rejection, seen=seen, fixes=fixes)
    return cls(rejection, source)


def _rows(rejection: Rejection, source: str | None) -> list[tuple[str, str]]:
    rows = list(rejection.seen)
    if source:
        rows.append(("at", source))
    for i, fix in enumerate(rejection.fixes):
        rows.append(("fix" if i == 0 else "or", fix))
    for note in rejection.notes:
        rows.append(("note", note))
    return rows


def format_plain(rejection: Rejection, source: str | None) -> str:
    lines = [rejection.rule]
    rows = _rows(rejection, source)
    width = max((len(label) for label, _ in rows), default=0) + 2
    for label, value in rows:
        head = f"  {label + ':':<{width}}"
        value_lines = value.split("\n")
        lines.append(head + value_lines[0])
        lines.extend(" " * len(head) + v for v in value_lines[1:])
    return "\n".join(lines)


def _use_rich() -> bool:
    mode = os.environ.get("SPMD_TYPES_ERRORS", "auto")
    if mode == "plain" or os.environ.get("NO_COLOR"):
        return False
    if mode == "rich":
        return True
    stream = sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def _render(rejection: Rejection, source: str | None, plain: str) -> str:
    if not _use_rich():
        return plain
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # rich is a dependency, but never let rendering hide the error
        return plain
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for label, value in _rows(rejection, source):
        style = "green" if label in ("fix", "or") else ("dim" if label == "at" else "")
        table.add_row(label + ":", Text(value, style=style))
    console = Console(force_terminal=True, width=120, highlight=False)
    with console.capture() as cap:
        console.print(Text(rejection.rule, style="bold red"))
        console.print(table)
    return "\n" + cap.get().rstrip()
