"""docs/jax.md: each JAX primitive's spmd call has, as its backward, our call for JAX's transpose.

The test reads the table from the page, so the page is what is checked. A
call is expanded into the table rows it runs (``src=V`` on a reduction is
``reinterpret(V, P)`` first, contract section 4); its backward is the reversed
list of each step's ``_transitions.backward_of``, with consecutive reinterprets
composed into one (they move no data). A row marked ``relabel`` matches only
after dropping the free relabels ``reinterpret(V, P)`` before a reduction and
``reinterpret(R, V)`` after a gather; a row marked ``exact`` must match without.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from spmd_types._core.types import I, P, R, V
from spmd_types._local.transitions import backward_of, find

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "jax.md"
_TYPES = {"I": I, "V": V, "P": P, "R": R}
_JAX_TYPES = {"I": I, "V": V, "U": P, "R": R}  # JAX Invariant, Varying, Unreduced, Reduced
_REDUCTIONS = ("all_reduce", "reduce_scatter")


def _rows() -> list[dict]:
    rows = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[0].startswith("`"):
            continue
        call = re.fullmatch(r"`spmd\.(\w+)\(x, axis, src=(\w), dst=(\w)[^)]*\)`", cells[4])
        assert call, f"cannot read the spmd call in: {line}"
        jax_src, jax_dst = (s.strip() for s in cells[1].split("->"))
        rows.append({
            "names": re.findall(r"`(\w+)`", cells[0]),
            "jax": (_JAX_TYPES[jax_src], _JAX_TYPES[jax_dst]),
            "transpose": re.findall(r"`(\w+)`", cells[3])[0],
            "call": (call.group(1), _TYPES[call.group(2)], _TYPES[call.group(3)]),
            "match": cells[6],
        })
    return rows


ROWS = _rows()
BY_NAME = {name: row["call"] for row in ROWS for name in row["names"]}


def _steps(call: tuple) -> list[tuple]:
    """The table rows ``call`` runs."""
    op, src, dst = call
    if find(op, src, dst) is not None:
        return [call]
    if op in _REDUCTIONS and src is V and find(op, P, dst) is not None:
        return [("reinterpret", V, P), (op, P, dst)]
    raise AssertionError(f"{op}(src={src}, dst={dst}) is not a call the package accepts")


def _compose(steps: list[tuple]) -> list[tuple]:
    """Consecutive reinterprets as one (or none, when they cancel)."""
    out: list[tuple] = []
    for step in steps:
        if out and step[0] == out[-1][0] == "reinterpret":
            src = out.pop()[1]
            if src is not step[2]:
                assert find("reinterpret", src, step[2]) is not None, (src, step[2])
                out.append(("reinterpret", src, step[2]))
        else:
            out.append(step)
    return out


def _backward(call: tuple) -> list[tuple]:
    steps = [s for step in reversed(_steps(call)) for s in _steps(backward_of(*step))]
    return _compose(steps)


def _drop_relabels(steps: list[tuple]) -> list[tuple]:
    out = list(steps)
    if len(out) > 1 and out[0] == ("reinterpret", V, P) and out[1][0] in _REDUCTIONS:
        out.pop(0)
    if len(out) > 1 and out[-1] == ("reinterpret", R, V) and out[-2][0] == "all_gather":
        out.pop()
    return out


def test_the_table_has_every_primitive():
    expected = {
        "pvary", "pbroadcast", "preduced", "vary_unreduced_cast", "reduced_vary_cast", "psum_invariant", "psum2",
        "unreduced_psum", "all_gather_invariant", "pscatter", "all_gather_reduced", "unreduced_psum_scatter",
        "all_gather", "psum_scatter", "reduce_scatter", "all_to_all",
    }
    assert expected <= set(BY_NAME)
    assert all(row["transpose"] in BY_NAME for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row["names"][0] for row in ROWS])
def test_backward_is_the_call_for_jax_transpose(row):
    ours = _backward(row["call"])
    theirs = _compose(_steps(BY_NAME[row["transpose"]]))
    if row["match"] == "exact":
        assert ours == theirs
        assert row["jax"] == row["call"][1:], "JAX's types, translated, should be the call's"
    else:
        assert row["match"] == "relabel"
        assert ours != theirs, "marked relabel but matches exactly"
        assert _drop_relabels(ours) == _drop_relabels(theirs)
        # JAX's V may stand for our R after a gather, nothing else.
        assert row["jax"][0] is row["call"][1]
        assert row["jax"][1] is row["call"][2] or (row["call"][0] == "all_gather" and row["call"][2] is R)
