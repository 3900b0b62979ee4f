"""The result of ``check_equivalence``: one row per compared value, the divergences, and the table a person reads."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Comparison", "Divergence", "NotCompared", "EquivalenceReport", "DivergenceError", "NondeterministicStepError"]

Kind = Literal["output", "random", "grad", "param", "loss"]


@dataclass(frozen=True)
class Comparison:
    """One value compared with the reference: the largest difference, the tolerance it was held to.

    ``name`` is a module's qualified name for its forward output (``#k`` for its k-th call after
    the first, ``[i]`` for the i-th tensor of an output with several; the root module is named by
    its class), a parameter's name for its gradient or updated value, or ``"loss"``. ``ranks``
    lists the ranks whose copy of an R or I value disagrees with the others. ``source`` is the
    user's ``file:line: code`` that produced the value in the parallel run, where known. ``reason``
    says why the error is infinite (the runs made the value with different shapes).
    """

    name: str
    kind: Kind
    max_abs_error: float
    tolerance: float
    reference_norm: float
    ranks: tuple[int, ...] = ()
    source: str | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        """True when the value matches the reference within tolerance and every R/I copy agrees."""
        return not self.ranks and self.max_abs_error <= self.tolerance


@dataclass(frozen=True)
class Divergence(Comparison):
    """A compared value that differs from the reference beyond its tolerance (or whose R/I copies disagree).

    Example::

        d = report.first
        d.name, d.kind, d.max_abs_error, d.tolerance, d.source
        # ('decoder.layers.0.mlp.linear_fc2', 'output', 0.31, 1.1e-09, 'my_model.py:57: out = out + self.bias')
    """


@dataclass(frozen=True)
class NotCompared:
    """A value that was not compared, and why (never a guess at its layout)."""

    name: str
    kind: Kind
    reason: str


class EquivalenceReport:
    """What :func:`~spmd_types.testing.check_equivalence` found, in execution order.

    ``compared`` holds every compared value (module outputs as their forwards finish, then the
    loss, the gradients and the updated parameters); ``divergences`` the ones that differ;
    ``first`` the earliest of them (None when ``ok``); ``not_compared`` the values left out,
    each with its reason. ``str(report)`` is the table; ``raise_if_diverged()`` raises
    :class:`DivergenceError` carrying it.

    Example::

        report = check_equivalence(build, step, batch)
        assert report.ok, report
    """

    def __init__(self, compared: list[Comparison], not_compared: list[NotCompared], *, title: str) -> None:
        self.compared = compared
        self.not_compared = not_compared
        self.title = title

    @property
    def divergences(self) -> list[Divergence]:
        """Every value that diverged, in execution order."""
        return [c for c in self.compared if isinstance(c, Divergence)]

    @property
    def first(self) -> Divergence | None:
        """The first divergence in execution order: where the bug starts (None when ``ok``)."""
        found = self.divergences
        return found[0] if found else None

    @property
    def ok(self) -> bool:
        """True when no compared value diverged."""
        return not self.divergences

    def raise_if_diverged(self) -> None:
        """Raise :class:`DivergenceError` (an ``AssertionError``) with the table if anything diverged."""
        if not self.ok:
            raise DivergenceError(self)

    def __rich__(self) -> Any:
        return _renderable(self, color=True)

    def __str__(self) -> str:
        from rich.console import Console

        width = max(100, 72 + max((len(c.name) for c in self.compared), default=0))
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False, emoji=False,
                legacy_windows=False, soft_wrap=True).print(_renderable(self, color=False))
        return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"first={self.first.name!r} ({self.first.kind})"  # type: ignore[union-attr]
        return (f"<EquivalenceReport {state}, {len(self.compared)} compared, {len(self.divergences)} diverged, "
                f"{len(self.not_compared)} not compared>")


class NondeterministicStepError(RuntimeError):
    """The step cannot be compared: two one-device runs from the same start differ, a random draw cannot be
    replayed on one device, or the float64 run strays from the run in ``dtype`` beyond round-off.

    Raised by :func:`~spmd_types.testing.check_equivalence` instead of widening a tolerance until
    the difference passes; the message names the value and the fix.
    """


class DivergenceError(AssertionError):
    """Raised by :meth:`EquivalenceReport.raise_if_diverged`; ``str(err)`` is the report's table.

    Example::

        with pytest.raises(DivergenceError) as err:
            check_equivalence(build, step, batch).raise_if_diverged()
        err.value.report.first.name
    """

    def __init__(self, report: EquivalenceReport) -> None:
        super().__init__(str(report))
        self.report = report


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.1e}"


def _verdict(c: Comparison, first: bool) -> str:
    if c.ok:
        return "ok"
    text = "DIVERGED"
    if c.ranks and c.kind == "random":
        text += f" (ranks {', '.join(map(str, c.ranks))})"
    elif c.ranks:
        text += f" (ranks {', '.join(map(str, c.ranks))} disagree)"
    return text + (" <- first" if first else "")


def _first_lines(first: Divergence, bad: int, n: int) -> list[str]:
    """The lines under the table that repeat the first divergence: what, where (``at:``) and why."""
    head = f"{bad} of {n} compared values diverged. The first: "
    if first.kind == "random":
        lines = [f"{head}the random draw in {first.name}: {first.reason}"]
    else:
        lines = [f"{head}{first.kind} of {first.name}, max error {_num(first.max_abs_error)} > tolerance "
                 f"{_num(first.tolerance)} (reference norm {_num(first.reference_norm)})"]
        if first.ranks:
            lines[0] = lines[0][:-1] + f"; ranks {', '.join(map(str, first.ranks))} disagree with their R/I peers)"
    lines.append(f"  at: {first.source}" if first.source else "  at: (source line unknown)")
    if first.reason is not None and first.kind != "random":
        lines.append(f"  why: {first.reason}")
    return lines


def _renderable(report: EquivalenceReport, *, color: bool) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("kind")
    table.add_column("value", overflow="fold")
    table.add_column("max error", justify="right")
    table.add_column("tolerance", justify="right")
    table.add_column("result", no_wrap=True)
    first = report.first
    for i, c in enumerate(report.compared, 1):
        style = ("bold red" if c is first else "red") if (color and not c.ok) else None
        table.add_row(str(i), c.kind, c.name, _num(c.max_abs_error), _num(c.tolerance), _verdict(c, c is first),
                      style=style)
    parts: list[Any] = [Text(report.title, style="bold" if color else ""), table]
    n, bad = len(report.compared), len(report.divergences)
    if first is None:
        parts.append(Text(f"ok: all {n} compared values match the reference within tolerance"))
    else:
        parts.append(Text("\n".join(_first_lines(first, bad, n)), style="bold red" if color else ""))
    why = [c for c in report.compared if c.reason is not None and c is not first]
    if why:
        parts.append(Text("\n".join(["why:"] + [f"  {c.kind} {c.name}: {c.reason}" for c in why])))
    if report.not_compared:
        rows = [f"not compared ({len(report.not_compared)}):"]
        rows += [f"  {nc.kind} {nc.name}: {nc.reason}" for nc in report.not_compared]
        parts.append(Text("\n".join(rows)))
    return Group(*parts)
