"""Regenerate the docs pages that are rendered from the code's tables.

Run: python docs/generate.py            (writes docs/rules.md and docs/collectives.md)
     python docs/generate.py --check    (exit 1 if a page is out of date)
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # render this checkout's package, not whichever one is installed

import spmd_types as spmd  # noqa: E402
from spmd_types._comm.collectives import EXTREME_ROWS  # noqa: E402
from spmd_types._comm.dtypes import backward_reduces  # noqa: E402
from spmd_types._core.types import I, P, R, V  # noqa: E402
from spmd_types._local.op_registry import _resolve  # noqa: E402
from spmd_types._local.rules_table import FUSED_OPTIMIZERS, ROWS, RuleKind  # noqa: E402
from spmd_types._local.transitions import ROUTE, TRANSITIONS, find  # noqa: E402

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
    if row.linear_if:
        name, allowed = row.linear_if
        values = " or ".join("not given" if v is None else repr(v) for v in allowed)
        terms += f" (linear only when {name} is {values})"
    if row.zero_buffer:
        terms += f"; {row.zero_buffer} all zeros: the values' type"
    return terms


def rules_page() -> str:
    lines = [
        "# The typing-rules table",
        "",
        "Generated from `spmd_types/_local/rules_table.py` by `python docs/generate.py`; do not edit by hand.",
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
        "A buffer of zeros is the exception: the rows whose algebra says *all zeros* write values into",
        "a tensor, and when that tensor holds only zeros and carries no gradient (`torch.zeros(...)`,",
        "`zeros_like`, `new_zeros`), the result is the values alone and takes their type where the",
        "ordinary rule would refuse: `torch.zeros(n, h).scatter_add_(0, idx, x)` is P for a P `x`, V for",
        "a V `x`. A plain buffer written in place becomes typed (unless another tensor shares its storage).",
        "The buffer's values are read on every such call (one reduction, only where the ordinary rule",
        "refuses; [choice 30](choices.md)). Under `strict=True` that buffer is accepted.",
        "",
        "## Rows",
        "",
        "| ops | kind | algebra | why |",
        "|---|---|---|---|",
    ]
    for row in ROWS:
        names = ", ".join(f"`{n.lstrip('?')}`" for n in row.names if _resolve(n.lstrip("?"))[0] is not None)
        lines.append(f"| {names} | {row.kind.value} | {_algebra(row)} | {row.reason} |")
    return "\n".join(lines + _multi_tensor_section()) + "\n"


def _multi_tensor_section() -> list[str]:
    """The multi-tensor (``torch._foreach_*``) and fused optimizer kernels."""
    import torch

    from spmd_types._checker.foreach import single_form

    lines = [
        "",
        "## Multi-tensor and fused optimizer kernels",
        "",
        "`torch._foreach_X(lists...)` runs one op per element; element i is checked by the row of the op's",
        "single-tensor form on element i of every list argument (a number or a single tensor is shared by",
        "all elements), so each result element gets its own type. A gradient that is still P (a pending sum)",
        "gets an error naming its parameter and the missing all-reduce.",
        "",
        "| kernel | element checked as |",
        "|---|---|",
    ]
    for name in sorted(n for n in dir(torch) if n.startswith("_foreach_")):
        entry = single_form(name)
        form = f"`{_display(entry)}`" if entry.known else "not in the table: non-linear"
        lines.append(f"| `torch.{name}` | {form} |")
    row = FUSED_OPTIMIZERS
    names = ", ".join(f"`{n.lstrip('?')}`" for n in row.names if _resolve(n.lstrip("?"))[0] is not None)
    lines += ["", "| fused kernels | kind | why |", "|---|---|---|", f"| {names} | {row.kind.value} | {row.reason} |"]
    return lines


def _display(entry) -> str:
    from spmd_types._local.op_registry import entry_for

    return entry_for(entry.func).display


# ---------------------------------------------------------------------------
# docs/collectives.md: one section per type-changing op. The tables come from
# _transitions (TRANSITIONS, ROUTE) and the signatures from the functions, so the
# page goes stale (and --check fails) when either changes; the diagrams are
# hand-written below, and a TRANSITIONS row without one stops the renderer.

_OPS = ("reinterpret", "convert", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "redistribute")

_INTRO = {
    "reinterpret": "Changes the type without touching the local data and without communication. The meaning may "
    "change: `reinterpret(R, P)` of `[3.]` on 4 ranks means `[12.]`. JAX calls these casts `pcast` / `pvary`.",
    "convert": "Changes the type keeping the meaning, with local work only (keep a slice, zero-fill); never "
    "communicates forward. V is read as the per-rank values stacked on dim 0; `S(d)` as shards of dim d.",
    "all_reduce": "Finishes a pending sum. `dst` picks the backward: R keeps the gradient pending (all-reduce), "
    "I says it is already summed (nothing). `src=V` means `reinterpret(V, P)` first; `op=\"avg\"` averages.",
    "all_gather": "Gathers every rank's value: stacked on a new dim 0 (`src=V`) or concatenated on d (`src=S(d)`). "
    "`dst=R` backward is a reduce-scatter; `dst=I` backward is a local slice.",
    "reduce_scatter": "Finishes a pending sum and keeps this rank's part: index `rank` of dim 0 (`dst=V`) or its "
    "shard of dim d (`dst=S(d)`). `src=V` means `reinterpret(V, P)` first. Backward is an all-gather.",
    "all_to_all": "Splits on one dim, sends piece j to rank j, concatenates on another: `S(i) -> S(j)` re-shards. "
    "Backward is the all-to-all back.",
    "redistribute": "Keeps the meaning and communicates as needed: runs the one op that `_transitions.ROUTE` names "
    "for the (src, dst) pair, so its backward is that op's backward. V -> V must be spelled `S(i) -> S(j)` (which "
    "dims to split and concatenate). It also takes partition specs (see [redistribute.md](redistribute.md)).",
}

# (op, src, dst) -> (forward input, forward output, backward grad_input, backward grad_output), one entry per
# rank (three ranks) or one entry for a value that is the same on every rank. A leading + marks a pending sum.
_DIAGRAMS: dict[tuple[str, object, object], tuple[list[str], list[str], list[str], list[str]]] = {
    ("reinterpret", R, I): (["A"], ["A"], ["+g", "+0", "+0"], ["g"]),
    ("reinterpret", R, V): (["A"], ["A", "A", "A"], ["+g0", "+g1", "+g2"], ["g0", "g1", "g2"]),
    ("reinterpret", R, P): (["A"], ["+A", "+A", "+A"], ["+g", "+g", "+g"], ["g"]),
    ("reinterpret", I, R): (["A"], ["A"], ["g0 + g1 + g2"], ["+g0", "+g1", "+g2"]),
    ("reinterpret", I, V): (["A"], ["A", "A", "A"], ["g0 + g1 + g2"], ["g0", "g1", "g2"]),
    ("reinterpret", V, P): (["A", "B", "C"], ["+A", "+B", "+C"], ["g", "g", "g"], ["g"]),
    ("convert", R, I): (["A"], ["A"], ["+g", "+0", "+0"], ["g"]),
    ("convert", I, R): (["A"], ["A"], ["g0 + g1 + g2"], ["+g0", "+g1", "+g2"]),
    ("convert", R, V): (
        ["[A, B, C]"], ["[A]", "[B]", "[C]"], ["+[g0, 0, 0]", "+[0, g1, 0]", "+[0, 0, g2]"], ["[g0]", "[g1]", "[g2]"]
    ),
    ("convert", I, V): (["[A, B, C]"], ["[A]", "[B]", "[C]"], ["[g0, g1, g2]"], ["[g0]", "[g1]", "[g2]"]),
    ("convert", R, P): (["A"], ["+A", "+0", "+0"], ["+g", "+0", "+0"], ["g"]),
    ("convert", I, P): (["A"], ["+A", "+0", "+0"], ["g"], ["g"]),
    ("convert", V, P): (
        ["[A]", "[B]", "[C]"], ["+[A, 0, 0]", "+[0, B, 0]", "+[0, 0, C]"], ["[g0]", "[g1]", "[g2]"], ["[g0, g1, g2]"]
    ),
    ("all_reduce", P, R): (["+A", "+B", "+C"], ["A + B + C"], ["g0 + g1 + g2"], ["+g0", "+g1", "+g2"]),
    ("all_reduce", P, I): (["+A", "+B", "+C"], ["A + B + C"], ["g"], ["g"]),
    ("all_gather", V, R): (
        ["[A]", "[B]", "[C]"], ["[A, B, C]"],
        ["[a0 + b0 + c0]", "[a1 + b1 + c1]", "[a2 + b2 + c2]"], ["+[a0, a1, a2]", "+[b0, b1, b2]", "+[c0, c1, c2]"],
    ),
    ("all_gather", V, I): (["[A]", "[B]", "[C]"], ["[A, B, C]"], ["[g0]", "[g1]", "[g2]"], ["[g0, g1, g2]"]),
    ("reduce_scatter", P, V): (
        ["+[A0, A1, A2]", "+[B0, B1, B2]", "+[C0, C1, C2]"], ["[A0 + B0 + C0]", "[A1 + B1 + C1]", "[A2 + B2 + C2]"],
        ["[g0, g1, g2]"], ["[g0]", "[g1]", "[g2]"],
    ),
    ("all_to_all", V, V): (
        ["[A0, A1, A2]", "[B0, B1, B2]", "[C0, C1, C2]"], ["[A0, B0, C0]", "[A1, B1, C1]", "[A2, B2, C2]"],
        ["[a0, a1, a2]", "[b0, b1, b2]", "[c0, c1, c2]"], ["[a0, b0, c0]", "[a1, b1, c1]", "[a2, b2, c2]"],
    ),
}

# redistribute runs another op; one example of the routing, on S(d) layouts.
_REDISTRIBUTE_DIAGRAM = (
    "redistribute(x, axis, src=P, dst=S(0)) runs reduce_scatter(src=P, dst=S(0)):",
    ["+[A0, A1, A2]", "+[B0, B1, B2]", "+[C0, C1, C2]"], ["[A0 + B0 + C0]", "[A1 + B1 + C1]", "[A2 + B2 + C2]"],
)

_REDUCTIONS = ("all_reduce", "reduce_scatter")


def _draw(left: list[str], right: list[str], arrow: str) -> str:
    """A seed-003 diagram: one line per rank, the arrow on the middle rank; a single entry is replicated."""
    lcol = left if len(left) == 3 else ["", left[0], ""]
    rcol = right if len(right) == 3 else ["", right[0], ""]
    width = max(len(s) for s in lcol)
    lines = [f"{a:<{width}}  {arrow if i == 1 else '  '}  {b}".rstrip() for i, (a, b) in enumerate(zip(lcol, rcol))]
    return "\n".join(line for line in lines if line)  # one value on each side: one line


def _call(op: str, src, dst) -> str:
    return f"{op}(src={src}, dst={dst})"


def _comm(op: str, src, dst) -> str:
    """What ``op(src, dst)`` communicates; ``src=V`` on a reduction is ``reinterpret(V, P)`` then the op."""
    row = find(op, src, dst)
    if row is None and op in _REDUCTIONS and src is V:
        row = find(op, P, dst)
    if row is None:
        raise KeyError(f"no table row for {_call(op, src, dst)}")
    return row.comm


def _signature(name: str) -> str:
    sig = inspect.signature(getattr(spmd, name))
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return f"spmd.{name}{sig.replace(parameters=params, return_annotation=inspect.Signature.empty)}"


def _grid() -> list[str]:
    """Seed 003's "Comms by state transition" grid, from TRANSITIONS."""
    order = (R, I, V, P)
    lines = ["| src \\ dst | " + " | ".join(str(t) for t in order) + " |", "|---" * 5 + "|"]
    for src in order:
        cells = [", ".join(f"`{t.op}`" for t in TRANSITIONS if t.src is src and t.dst is dst) or "-" for dst in order]
        lines.append(f"| **{src}** | " + " | ".join(cells) + " |")
    return lines


def _row_line(t) -> str:
    bop, bsrc, bdst = t.backward
    return (
        f"| `{_call(t.op, t.src, t.dst)}` | {t.comm} | `{_call(bop, bsrc, bdst)}` | {_comm(bop, bsrc, bdst)} "
        f"| {t.meaning} |"
    )


def _op_section(op: str) -> list[str]:
    lines = [f"## {op}", "", "```python", _signature(op), "```", "", _INTRO[op], ""]
    if op == "redistribute":
        lines += ["| src -> dst | runs | its backward | backward comm |", "|---|---|---|---|"]
        for (src, dst), routed in ROUTE.items():
            row = find(routed, src, dst)
            if row is None:
                raise KeyError(f"ROUTE names {_call(routed, src, dst)}, which TRANSITIONS lacks")
            bop, bsrc, bdst = row.backward
            lines.append(f"| {src} -> {dst} | `{_call(routed, src, dst)}` | `{_call(bop, bsrc, bdst)}` "
                         f"| {_comm(bop, bsrc, bdst)} |")
        title, left, right = _REDISTRIBUTE_DIAGRAM
        return lines + ["", title, "", "```", _draw(left, right, "=>"), "```", ""]
    rows = [t for t in TRANSITIONS if t.op == op]
    lines += ["| forward | forward comm | backward (on the gradient) | backward comm | meaning |", "|---|---|---|---|---|"]
    lines += [_row_line(t) for t in rows]
    lines.append("")
    for t in rows:
        fin, fout, gin, gout = _DIAGRAMS[(t.op, t.src, t.dst)]
        bop, bsrc, bdst = t.backward
        lines += [
            f"### {_call(t.op, t.src, t.dst)}",
            "",
            f"Forward ({t.comm}), then backward `{_call(bop, bsrc, bdst)}` ({_comm(bop, bsrc, bdst)}):",
            "",
            f"![{_call(t.op, t.src, t.dst)}: forward and backward, three ranks](img/{t.op}_{t.src}_{t.dst}.svg)",
            "",
            "```",
            "forward:",
            _draw(fin, fout, "=>"),
            "",
            "backward:",
            _draw(gin, gout, "<="),
            "```",
            "",
        ]
    if op == "all_reduce":
        lines += _extreme_section()
    return lines


def _extreme_section() -> list[str]:
    """``all_reduce(op="max"|"min")``: not linear, so its rows live in ``_collectives.EXTREME_ROWS``."""
    lines = [
        '### all_reduce(op="max"|"min")',
        "",
        "The elementwise max (min) over ranks of a V (or `S(d)`) value. Not linear, so not in seed 003's table: the",
        "backward sends the gradient to the ranks holding the extreme, split evenly among ties (as `torch.amax` does),",
        "and a double backward is an error. A P input is rejected: its value is the sum over ranks, and the max of",
        "the summands is not a function of that sum (finish the sum first, or type the value V where it is made).",
        "",
        "| forward | forward comm | backward comm | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| `all_reduce(src={r.src}, dst={r.dst}, op=\"max\")` | all_reduce | {r.backward_comm} | {r.meaning} |"
              for r in EXTREME_ROWS]
    return lines + [
        "",
        "```",
        "forward:",
        _draw(["[1, 5]", "[4, 2]", "[4, 0]"], ["[4, 5]"], "=>"),
        "",
        "backward (dst=I; ties split):",
        _draw(["[0, g1]", "[g0 / 2, 0]", "[g0 / 2, 0]"], ["[g0, g1]"], "<="),
        "```",
        "",
    ]


def _low_precision_section() -> list[str]:
    """The rows whose backward sums the gradient: in reduced precision they need a backward op_dtype."""
    lines = [
        "## Low-precision communication",
        "",
        "Every op above takes `op_dtype=` (cast the input, communicate and sum in it), `out_dtype=` (cast the",
        "result) and `backward_options=` (the same options for the op the backward runs); see",
        "[low-precision communication](low_precision.md). A call in reduced precision (an `op_dtype`, an",
        "`out_dtype` or an input narrower than 32 bits) whose backward sums the gradient over ranks must say",
        "`backward_options={\"op_dtype\": ...}`. These rows, read from the table above:",
        "",
        "| forward | backward (sums the gradient) |",
        "|---|---|",
    ]
    for t in TRANSITIONS:
        if backward_reduces(t.op, t.src, t.dst):
            bop, bsrc, bdst = t.backward
            lines.append(f"| `{_call(t.op, t.src, t.dst)}` | `{_call(bop, bsrc, bdst)}` |")
    return lines + [
        "",
        "and `all_reduce(src=V, dst=R)` (`reinterpret(V, P)` then the P row), `all_reduce(op=\"max\"|\"min\", dst=R)`",
        "(the pending gradient is summed), and `redistribute` wherever it routes to one of these.",
        "",
    ]


def collectives_page() -> str:
    lines = [
        "# The type-changing operations",
        "",
        "Generated by `python docs/generate.py` from `spmd_types/_local/transitions.py` (`TRANSITIONS`, `ROUTE`) and the",
        "functions' signatures; the diagrams live in `docs/generate.py`. Do not edit by hand.",
        "",
        "Every op takes `(x, axis, *, src, dst)`. `V` in a table stands for V or `S(d)` (the same in local SPMD);",
        "the backward runs on the gradient, whose types are the backward types (R and P swap, I and V stay).",
        "",
        "**Diagrams** (seed 003, \"Comms by API\"): three ranks, one line each; a value written on one line only",
        "is the same on every rank; a leading `+` marks a pending sum (`+A / +B / +C` means `A + B + C`). The",
        "forward reads `input => output`; the backward `grad_input <= grad_output`, so `grad_input` lines up",
        "with `input` (same shape, same number of values across the ranks).",
        "",
        "## Every transition",
        "",
        "Seed 003's \"Comms by state transition\" grid: the ops that go from one type to another.",
        "",
    ]
    lines += _grid()
    lines += [
        "",
        "Seed 003's \"Comms by forwards-backwards\" table, one row per (op, src, dst):",
        "",
        "| forward | forward comm | backward (on the gradient) | backward comm | meaning |",
        "|---|---|---|---|---|",
    ]
    lines += [_row_line(t) for t in TRANSITIONS]
    lines.append("")
    for op in _OPS:
        lines += _op_section(op)
    lines += _low_precision_section()
    return "\n".join(lines).rstrip("\n") + "\n"


PAGES = {"rules.md": rules_page, "collectives.md": collectives_page}


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
