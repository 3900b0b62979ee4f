"""docs/published_api.md's versioned table: every cell is same / differs / not built / a dash, every choice it
cites exists, and the totals it states are the table's. The not-built rows raise NotImplementedError naming them."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch.distributed as dist

import spmd_types as spmd

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
COLUMNS = ("0.2.3", "0.2.5", "0.3.1", "called by PyTorch")
KINDS = ("—", "not built", "differs", "same")


def _rows() -> list[list[str]]:
    text = (DOCS / "published_api.md").read_text()
    section = text[text.index("## The API, release by release"):text.index("## Called by PyTorch")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| name")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in rows]


def test_every_cell_says_same_differs_not_built_or_absent():
    rows = _rows()
    assert len(rows) > 40
    for row in rows:
        assert len(row) == 1 + len(COLUMNS), row[0]
        for cell in row[1:]:
            assert cell.startswith(KINDS), f"{row[0]}: {cell!r}"
            if cell.startswith(("differs", "not built")) and cell not in ("differs", "not built"):
                assert cell.split(" ", 1)[1], f"{row[0]}: a difference says why"


def test_the_totals_are_the_tables():
    totals = {c: dict.fromkeys(KINDS, 0) for c in COLUMNS}
    for row in _rows():
        for column, cell in zip(COLUMNS, row[1:]):
            totals[column][next(k for k in KINDS if cell.startswith(k))] += 1
    text = (DOCS / "published_api.md").read_text()
    for column in COLUMNS:
        t = totals[column]
        absent = "not called" if column == "called by PyTorch" else "not in it"
        assert (f"{column}: {t['same']} same, {t['differs']} differ, {t['not built']} not built, {t['—']} {absent}"
                in text), column


def test_every_cited_choice_exists():
    choices = (DOCS / "index.md").read_text()
    numbers = {int(n) for n in re.findall(r"^(\d+)\. \*\*", choices, flags=re.M)}
    for row in _rows():
        for n in re.findall(r"\[(\d+)\]\(choices\.md\)", " ".join(row)):
            assert int(n) in numbers, f"{row[0]} cites choice {n}"


def test_the_not_built_rows_raise_naming_themselves():
    from spmd_types.checker import SpmdTypeMode

    with pytest.raises(NotImplementedError) as info:
        SpmdTypeMode()
    assert str(info.value) == ("spmd_types.checker.SpmdTypeMode is not built: checking here is spmd.typecheck() over "
                               "typed tensors (spmd.LTensor), not a TorchFunctionMode; use `with spmd.typecheck():`")
    spmd.set_dist(dist)
    with pytest.raises(NotImplementedError, match=r"^spmd_types\.set_dist\(module\) is not built"):
        spmd.set_dist(object())
