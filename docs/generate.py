"""Regenerate the docs pages that are rendered from the code's tables.

Run: python docs/generate.py            (writes docs/rules.md)
     python docs/generate.py --check    (exit 1 if a page is out of date)
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from spmd_types._op_registry import _resolve
from spmd_types._rules_table import ROWS, RuleKind

HERE = pathlib.Path(__file__).parent

_KIND_TEXT = {
    RuleKind.NONLINEAR: "op(R..)->R, op(I..)->I, op(V..)->V, op(R, V)->V; P rejected; I mixes with nothing",
    RuleKind.LINEAR: "as non-linear, and also P in every linear term -> P (other arguments must be R)",
    RuleKind.MULTILINEAR: "as non-linear, and also one P factor times R factors -> P; P * P, P * V rejected",
    RuleKind.PASSTHROUGH: "the input's type, whatever it is",
    RuleKind.FACTORY: "the input's type, with P -> R for a non-zero constant",
    RuleKind.METADATA: "no tensor result: not checked",
}


def _algebra(row) -> str:
    if row.kind in (RuleKind.NONLINEAR, RuleKind.METADATA):
        return ""
    terms = " + ".join(" * ".join(group) for group in row.terms)
    if row.linear_if_zero:
        terms += f" (linear only when {row.linear_if_zero} is 0)"
    return terms


def rules_page() -> str:
    lines = [
        "# The typing-rules table",
        "",
        "Generated from `spmd_types/_rules_table.py` by `python docs/generate.py`; do not edit by hand.",
        "",
        "Each row is a family of torch ops that share one rule. *Algebra* spells the op as a sum of",
        "products of its linear arguments; every other tensor argument is non-linear. An op that is",
        "not in this table is treated as non-linear, and its error message says so.",
        "",
        "## Rule kinds",
        "",
        "| kind | result type |",
        "|---|---|",
    ]
    lines += [f"| {kind.value} | {text} |" for kind, text in _KIND_TEXT.items()]
    lines += [
        "",
        "Python numbers and plain (untyped) tensors are *weak*: they take the other operands' type,",
        "except that a weak value added to a pending sum is rejected (it would be added once per rank).",
        "Under `spmd.typecheck(strict=True)` a plain tensor meeting a typed one is an error.",
        "",
        "## Rows",
        "",
        "| ops | kind | algebra | why |",
        "|---|---|---|---|",
    ]
    for row in ROWS:
        names = ", ".join(f"`{n.lstrip('?')}`" for n in row.names if _resolve(n.lstrip("?"))[0] is not None)
        lines.append(f"| {names} | {row.kind.value} | {_algebra(row)} | {row.reason} |")
    return "\n".join(lines) + "\n"


PAGES = {"rules.md": rules_page}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for name, render in PAGES.items():
        path = HERE / name
        text = render()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print("out of date (run python docs/generate.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
