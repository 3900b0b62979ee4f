"""docs/collectives.md carries every row of the forward/backward table, and a diagram for every op.

The page is generated (``python docs/generate.py``; ``test_docs`` checks it is
current). These tests spell the expected rows from ``_transitions`` themselves,
so a renderer that dropped or garbled a row fails here even when the page is
current.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from spmd_types._core.types import P, V
from spmd_types._local.transitions import ROUTE, TRANSITIONS, find

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "collectives.md"
OPS = ("reinterpret", "convert", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "redistribute")


def _text() -> str:
    return PAGE.read_text()


def _section(op: str) -> str:
    """The page from ``## op`` up to the next ``## ``."""
    match = re.search(rf"^## {op}\n(.*?)(?=^## |\Z)", _text(), flags=re.S | re.M)
    assert match, f"docs/collectives.md has no section for {op}"
    return match.group(1)


def _backward_comm(op: str, src, dst) -> str:
    # src=V on a reduction is reinterpret(V, P) first (no communication), then the P row.
    row = find(op, src, dst) or (find(op, P, dst) if op in ("all_reduce", "reduce_scatter") and src is V else None)
    assert row is not None, (op, src, dst)
    return row.comm


@pytest.mark.parametrize("row", TRANSITIONS, ids=[f"{t.op}-{t.src}-{t.dst}" for t in TRANSITIONS])
def test_every_transition_row_is_on_the_page(row):
    bop, bsrc, bdst = row.backward
    line = (
        f"| `{row.op}(src={row.src}, dst={row.dst})` | {row.comm} | `{bop}(src={bsrc}, dst={bdst})` "
        f"| {_backward_comm(bop, bsrc, bdst)} | {row.meaning} |"
    )
    assert _text().count(line) == 2, f"expected in the full table and in the {row.op} section: {line}"
    assert line in _section(row.op)


@pytest.mark.parametrize("row", TRANSITIONS, ids=[f"{t.op}-{t.src}-{t.dst}" for t in TRANSITIONS])
def test_every_transition_row_has_forward_and_backward_diagrams(row):
    section = _section(row.op)
    match = re.search(rf"^### {re.escape(f'{row.op}(src={row.src}, dst={row.dst})')}\n(.*?)(?=^### |\Z)", section,
                      flags=re.S | re.M)
    assert match, f"no diagram subsection for {row.op}({row.src} -> {row.dst})"
    block = match.group(1).split("```")[1]
    assert "=>" in block and "<=" in block


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_a_signature_and_a_diagram(op):
    section = _section(op)
    assert f"spmd.{op}(x, axis" in section
    blocks = section.split("```")[1::2]
    assert any("=>" in b for b in blocks), f"{op} has no forward diagram"


def test_redistribute_lists_every_route():
    section = _section("redistribute")
    for (src, dst), op in ROUTE.items():
        assert f"| {src} -> {dst} | `{op}(src={src}, dst={dst})` |" in section


def test_a_missing_row_would_fail_the_generator_check(monkeypatch):
    """Dropping a row from the table changes the rendered page, so ``generate.py --check`` catches it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_generate", PAGE.parent / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.collectives_page() == _text()
    monkeypatch.setattr(gen, "TRANSITIONS", TRANSITIONS[:-1])
    assert gen.collectives_page() != _text()
