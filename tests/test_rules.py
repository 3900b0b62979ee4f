"""The typing rules table, row by row (seed 003 "Local SPMD", CONTRACT section 5).

Every row of ``_rules_table.ROWS`` has a recipe below with one accepted and
one rejected call, and a row without a recipe fails
``test_every_row_has_a_recipe``. The semantics beyond single rows are in
``test_rules_semantics.py``.

All tensors are typed on the mesh (dp=2, tp=4); the interesting axis is
``tp`` and ``dp`` is always R, so every result must also come out R on dp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from rules_support import IN_PLACE, NEEDS_R, NOT_LINEAR, P_PLUS, P_TIMES_NON_R, P_TIMES_P, rejects, tp_type, typed  # noqa: F401

import spmd_types as spmd
from spmd_types import P, R, V
from spmd_types._checker import tensor as _tensor
from spmd_types._local.op_registry import ENTRIES, UNRESOLVED, _resolve, entry_for
from spmd_types._local.rules_table import ROWS, Row, RuleKind

# ---------------------------------------------------------------------------
# per-row recipes


@dataclass
class Recipe:
    """An accepted call and what it gives on 'tp', and a rejected call and a piece of its rule.

    ``expect`` is an SpmdType for a tensor result (every tensor of a list /
    tuple result), or a Python class for a non-tensor result. ``reject`` is
    None only for METADATA rows, which never reject; ``why`` then says so.
    """

    accept: Callable[[Any], Any]
    expect: Any
    reject: Callable[[Any], Any] | None
    why: str




def _set_and_get(t, index, value):
    t[index] = value
    return t


def _grad_roundtrip(x):
    leaf = typed(torch.randn(4, requires_grad=True), P)
    leaf.grad = None
    return leaf.grad


RECIPES: dict[str, Recipe] = {
    # arithmetic
    "torch.add": Recipe(lambda x: x.p + x.p, P, lambda x: x.p + x.r, P_PLUS),
    "torch.mul": Recipe(lambda x: x.p * x.r, P, lambda x: x.p * x.p, P_TIMES_P),
    "torch.div": Recipe(lambda x: x.p / x.r, P, lambda x: x.r / x.p, NOT_LINEAR + " other"),
    "Tensor.__rtruediv__": Recipe(lambda x: torch.Tensor.__rtruediv__(x.r, x.p), P, lambda x: 1 / x.p, NOT_LINEAR),
    "torch.neg": Recipe(lambda x: torch.neg(x.p), P, lambda x: torch.neg(x.p, out=x.r.clone()), IN_PLACE),
    "torch.floor_divide": Recipe(lambda x: torch.pow(x.r, x.v), V, lambda x: x.p.exp(), NOT_LINEAR),
    # comparisons and reading values out
    "torch.eq": Recipe(lambda x: x.r == x.v, V, lambda x: x.p > 0, NOT_LINEAR),
    "Tensor.item": Recipe(lambda x: x.r[0, 0].item(), float, lambda x: x.p[0, 0].item(), NOT_LINEAR),
    # products
    "torch.matmul": Recipe(lambda x: x.p @ x.r, P, lambda x: x.p @ x.p, P_TIMES_P),
    "Tensor.__iter__": Recipe(lambda x: list(x.p), P, lambda x: next(iter(x.p)) + x.r[0], P_PLUS),
    "torch.einsum": Recipe(lambda x: torch.einsum("ij,jk->ik", x.p, x.r), P,
                           lambda x: torch.einsum("ij,jk->ik", x.p, x.p), P_TIMES_P),
    "F.linear": Recipe(lambda x: F.linear(x.p, x.r), P, lambda x: F.linear(x.p, x.r, x.r[0]), P_PLUS),
    "F.bilinear": Recipe(lambda x: F.bilinear(x.p, x.r, x.w3), P, lambda x: F.bilinear(x.p, x.p, x.w3), P_TIMES_P),
    "torch.addmm": Recipe(lambda x: torch.addmm(x.p, x.p, x.r), P, lambda x: torch.addmm(x.r, x.p, x.r), P_PLUS),
    # reductions
    "torch.sum": Recipe(lambda x: x.p.sum(0), P, lambda x: torch.sum(x.p, 0, out=x.r[0].clone()), IN_PLACE),
    "torch.amax": Recipe(lambda x: x.v.amax(0), V, lambda x: x.p.amax(0), NOT_LINEAR),
    # shapes, views, indexing
    "torch.view": Recipe(lambda x: x.p.view(16), P, lambda x: torch.tril(x.p, out=x.r.clone()), IN_PLACE),
    "Tensor.__getitem__": Recipe(lambda x: x.p[1:, 0], P, lambda x: x.p[x.idx_p], NOT_LINEAR + " index"),
    # view_as takes only a shape from its other operand, never its type
    "Tensor.view_as": Recipe(lambda x: x.p.view_as(x.v), P, lambda x: x.p.view_as(x.r) + x.r, P_PLUS),
    "Tensor.__setitem__": Recipe(lambda x: _set_and_get(x.p.clone(), 0, x.p[1]), P,
                                 lambda x: _set_and_get(x.r_grad * 1, 0, x.v[1]), IN_PLACE),
    "torch.index_select": Recipe(lambda x: torch.index_select(x.p, 0, x.idx), P,
                                 lambda x: torch.index_select(x.p, 0, x.idx_v), NEEDS_R),
    "torch.index_add": Recipe(lambda x: torch.index_add(x.p, 0, x.idx, x.p[:2]), P,
                              lambda x: torch.index_add(x.p, 0, x.idx, x.r[:2]), P_PLUS),
    "torch.index_put": Recipe(lambda x: x.p.index_put((x.idx,), x.p[0]), P,
                              lambda x: x.p.index_put((x.idx,), x.r[0]), P_PLUS),
    # scatter's deprecated reduce="multiply" multiplies the destination by the values
    "torch.index_copy": Recipe(lambda x: x.p.index_copy(0, x.idx, x.p[:2]), P,
                               lambda x: x.p.scatter(0, x.idx[None], x.p[:1], reduce="multiply"), NOT_LINEAR),
    # into a buffer of zeros a sum takes the values' type (tests/test_zero_buffers.py: every op and form)
    "torch.scatter_reduce": Recipe(lambda x: torch.zeros(4, 4).scatter_reduce(0, x.idx[None], x.p[:1], "sum"), P,
                                   lambda x: torch.zeros(4, 4).scatter_reduce(0, x.idx[None], x.p[:1], "amax"),
                                   NOT_LINEAR + " src"),
    "torch.cat": Recipe(lambda x: torch.cat([x.p, x.p]), P, lambda x: torch.cat([x.p, x.r]), P_PLUS),
    "Tensor.copy_": Recipe(lambda x: x.p.clone().copy_(x.p), P, lambda x: (x.r_grad * 1).copy_(x.v), IN_PLACE),
    "torch.where": Recipe(lambda x: torch.where(x.mask, x.p, x.p), P,
                          lambda x: torch.where(x.mask_v, x.p, x.p), NEEDS_R),
    "Tensor.where": Recipe(lambda x: x.p.where(x.mask, x.p), P, lambda x: x.p.where(x.mask, x.r), P_PLUS),
    "torch.masked_fill": Recipe(lambda x: x.p.masked_fill(x.mask, 0.0), P,
                                lambda x: x.p.masked_fill(x.mask, -math.inf), NOT_LINEAR),
    "F.pad": Recipe(lambda x: F.pad(x.p, (1, 1)), P, lambda x: F.pad(x.p, (1, 1), value=1.0), NOT_LINEAR),
    # casts: the type is kept (P stays P, so adding R to it is still rejected)
    "Tensor.to": Recipe(lambda x: x.p.to(torch.float64), P, lambda x: x.p.float() + x.r, P_PLUS),
    # neural-network functions
    "F.embedding": Recipe(lambda x: F.embedding(x.idx, x.p), P, lambda x: F.embedding(x.idx_v, x.p), NEEDS_R),
    "F.scaled_dot_product_attention": Recipe(
        lambda x: F.scaled_dot_product_attention(x.r[None], x.r[None], x.p[None]), P,
        lambda x: F.scaled_dot_product_attention(x.p[None], x.r[None], x.r[None]), NOT_LINEAR + " query"),
    "F.layer_norm": Recipe(lambda x: F.layer_norm(x.v, (4,)), V, lambda x: F.layer_norm(x.p, (4,)), NOT_LINEAR),
    "F.gelu": Recipe(lambda x: F.gelu(x.r), R, lambda x: F.gelu(x.p), NOT_LINEAR),
    "F.dropout": Recipe(lambda x: F.dropout(x.v, 0.1), V, lambda x: F.dropout(x.p, 0.1), NOT_LINEAR),
    "F.cross_entropy": Recipe(lambda x: F.cross_entropy(x.r, x.target), R,
                              lambda x: F.cross_entropy(x.p, x.target), NOT_LINEAR),
    # passthrough: the type is kept, so a later misuse of P is still caught
    "Tensor.detach": Recipe(lambda x: x.p.detach(), P, lambda x: x.p.detach() + x.r, P_PLUS),
    # factories
    "torch.zeros_like": Recipe(lambda x: torch.zeros_like(x.p), P, lambda x: torch.zeros_like(x.p) + x.r, P_PLUS),
    # ones_like(P) is an ordinary constant: R, not P, so it does not add to P
    "torch.ones_like": Recipe(lambda x: torch.ones_like(x.p), R, lambda x: torch.ones_like(x.p) + x.p, P_PLUS),
    # x.new_*(size): a new constant of its own shape, R whatever x is (the published API's meaning)
    "Tensor.new_zeros": Recipe(lambda x: x.p.new_zeros((4, 4)), R, lambda x: x.p.new_full((4, 4), 2.0) + x.p, P_PLUS),
    # metadata: never rejects; on a P tensor it returns a plain non-tensor value
    "Tensor.size": Recipe(lambda x: x.p.size(), torch.Size, None, "metadata never rejects"),
    "Tensor.grad": Recipe(_grad_roundtrip, type(None), None, "reading or setting .grad never rejects"),
}


def row_key(row: Row) -> str:
    return row.names[0].lstrip("?")


ROW_IDS = [row_key(r) for r in ROWS]


def test_row_keys_are_unique():
    assert len(set(ROW_IDS)) == len(ROW_IDS)


def test_every_row_has_a_recipe():
    """A new row in the table needs a recipe here (and a stale recipe must go)."""
    missing = [k for k in ROW_IDS if k not in RECIPES]
    stale = [k for k in RECIPES if k not in ROW_IDS]
    assert not missing, f"rows without a test recipe in tests/test_rules.py RECIPES: {missing}"
    assert not stale, f"recipes for rows no longer in the table: {stale}"


def _check_result(out: Any, expect: Any) -> None:
    if isinstance(expect, type):
        assert not isinstance(out, torch.Tensor), out
        assert isinstance(out, expect), (out, expect)
    elif isinstance(out, (list, tuple)):
        assert out and all(tp_type(o) is expect for o in out), out
    else:
        assert tp_type(out) is expect, out


@pytest.mark.parametrize("key", ROW_IDS)
def test_row_accepts(key, x):
    recipe = RECIPES[key]
    _check_result(recipe.accept(x), recipe.expect)


@pytest.mark.parametrize("key", ROW_IDS)
def test_row_rejects(key, x):
    row = ROWS[ROW_IDS.index(key)]
    recipe = RECIPES[key]
    if recipe.reject is None:
        assert row.kind is RuleKind.METADATA, f"only METADATA rows may have no rejected case ({key})"
        # never rejects: the accepted call already ran on a P tensor and returned a non-tensor
        assert isinstance(recipe.expect, type) and not issubclass(recipe.expect, torch.Tensor)
        return
    with pytest.raises(spmd.SpmdTypeError) as err:
        recipe.reject(x)
    assert recipe.why in err.value.rule, err.value.rule


def test_recipes_call_their_own_row(x):
    """Each recipe's accepted call goes through its row (so the recipe tests that row)."""
    seen: list[Any] = []
    original = _tensor._typed_call

    def spy(func, args, kwargs):
        seen.append(func)
        return original(func, args, kwargs)

    for key, recipe in RECIPES.items():
        row = ROWS[ROW_IDS.index(key)]
        seen.clear()
        _tensor._typed_call = spy
        try:
            recipe.accept(x)
        finally:
            _tensor._typed_call = original
        if row.kind is RuleKind.METADATA:
            continue  # unchecked: never reaches the rules
        if key == "Tensor.__iter__":
            # torch's Tensor.__iter__ skips __torch_function__ (gh-54457) and iterates
            # self.unbind(0), which the view row types the same way
            assert any(r.kind is RuleKind.LINEAR for r in (ENTRIES[f].row for f in seen if f in ENTRIES))
            continue
        rows = [ENTRIES[f].row for f in seen if f in ENTRIES]
        assert any(r is row for r in rows), f"{key}: the accepted call never reached its row"


def test_every_name_resolves_to_its_row():
    assert UNRESOLVED == [], f"names in the table that torch does not have: {UNRESOLVED}"
    for row in ROWS:
        for raw in row.names:
            func, _ = _resolve(raw.lstrip("?"))
            if func is None:
                assert raw.startswith("?"), raw
                continue
            assert entry_for(func).row is row, raw


def test_contract_ops_are_classified():
    """The transformer ops CONTRACT section 5 names are all in the table."""
    ops = [
        F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.einsum, F.embedding,
        F.layer_norm, F.rms_norm, F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax,
        torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.view, torch.Tensor.reshape,
        torch.reshape, torch.Tensor.permute, torch.permute, torch.cat, torch.where, torch.Tensor.to,
        torch.Tensor.float, torch.Tensor.add_, torch.Tensor.mul_, torch.Tensor.__iadd__, F.gelu, F.silu,
        F.scaled_dot_product_attention, F.cross_entropy, F.dropout, torch.Tensor.masked_fill,
        torch.Tensor.masked_fill_, torch.Tensor.transpose, torch.Tensor.contiguous, torch.Tensor.expand,
        torch.Tensor.unsqueeze, torch.Tensor.squeeze, torch.Tensor.flatten, torch.Tensor.split,
        torch.Tensor.chunk, torch.Tensor.sum, torch.Tensor.mean, torch.rsqrt, torch.Tensor.pow,
        torch.Tensor.type_as, torch.stack, torch.Tensor.view_as, torch.triu, torch.Tensor.repeat,
        torch.Tensor.detach, torch.zeros_like, torch.ones_like, torch.Tensor.clone,
    ]
    missing = [getattr(f, "__name__", f) for f in ops if f not in ENTRIES]
    assert not missing, missing


def test_nonlinear_rows_sweep(x):
    """Every name of every NONLINEAR row rejects P, where a call with tensor arguments fits.

    ``Tensor.*`` names are called as bound methods of the typed tensor (so that
    LTensor's own binary operators are used), everything else as ``f(p)`` and
    then ``f(p, r)``.
    """
    checked, tried = 0, 0
    for row in ROWS:
        if row.kind is not RuleKind.NONLINEAR:
            continue
        for raw in row.names:
            name = raw.lstrip("?")
            func, attr = _resolve(name)
            if func is None:
                continue
            tried += 1
            for extra in ((), (x.r,)):
                try:
                    if name.startswith("Tensor."):
                        getattr(x.p, attr)(*extra)
                    else:
                        func(x.p, *extra)
                except spmd.SpmdTypeError as err:
                    assert "is not linear in" in err.rule, (name, err.rule)
                    checked += 1
                    break
                except (TypeError, RuntimeError, ValueError, IndexError):
                    continue  # needs other arguments
                else:
                    raise AssertionError(f"{name} accepted a P operand")
    assert checked >= 0.9 * tried, (checked, tried)
