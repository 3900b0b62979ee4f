"""The typing rules for ordinary torch ops (seed 003 "Local SPMD", CONTRACT section 5).

Driven from the rules table: every row of ``_rules_table.ROWS`` has a recipe
below with one accepted and one rejected call, and a row without a recipe
fails ``test_every_row_has_a_recipe``. The rest of the file covers the seed's
combination list, weak scalars and plain tensors, linear ops on P, in-place
ops and ``out=``, and the transformer ops the contract names.

All tensors are typed on the mesh (dp=2, tp=4); the interesting axis is
``tp`` and ``dp`` is always R, so every result must also come out R on dp.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import fake_mesh

import spmd_types as spmd
from spmd_types import I, P, R, S, V, _tensor
from spmd_types._op_registry import ENTRIES, UNRESOLVED, _resolve, entry_for
from spmd_types._rules_table import ROWS, Row, RuleKind


@pytest.fixture(scope="module")
def mesh():
    return fake_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test sees the rules themselves, not a result cached by an earlier test."""
    for cache in getattr(_tensor, "_CACHES", ()):
        cache.clear()
    yield


def typed(t: torch.Tensor, tp, dp=R) -> torch.Tensor:
    return spmd.assert_type(t, {"dp": dp, "tp": tp})


@pytest.fixture
def x(mesh):
    """Typed operands, made inside typecheck(); the test body runs inside it too."""
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        torch.manual_seed(0)
        ns = SimpleNamespace(
            r=typed(torch.randn(4, 4), R),
            i=typed(torch.randn(4, 4), I),
            v=typed(torch.randn(4, 4), V),
            p=typed(torch.randn(4, 4), P),
            s0=typed(torch.randn(4, 4), S(0)),
            mask=typed(torch.rand(4, 4) > 0.5, R),
            mask_v=typed(torch.rand(4, 4) > 0.5, V),
            idx=typed(torch.tensor([0, 2]), R),
            idx_v=typed(torch.tensor([0, 2]), V),
            idx_p=typed(torch.tensor([0, 2]), P),
            target=typed(torch.tensor([0, 1, 2, 3]), R),
            w3=typed(torch.randn(2, 4, 4), R),
        )
        yield ns


def rejects(fragment: str):
    """Expect an SpmdTypeError whose message contains ``fragment`` (plain text, not a regex)."""
    return pytest.raises(spmd.SpmdTypeError, match=re.escape(fragment))


def tp_type(out: torch.Tensor):
    types = spmd.get_type(out)
    assert types is not None, f"{type(out).__name__} came back untyped"
    assert types["dp"] is R, types
    return types["tp"]


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


NOT_LINEAR = "is not linear in"
P_TIMES_P = "Partial * Partial"
P_PLUS = "can only be added to another pending sum"
P_TIMES_NON_R = "can only be multiplied by a Replicate"
NEEDS_R = "must be Replicate (R)"
IN_PLACE = "An in-place op cannot change its tensor's type"


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
                                 lambda x: _set_and_get(x.r.clone(), 0, x.v[1]), IN_PLACE),
    "torch.index_select": Recipe(lambda x: torch.index_select(x.p, 0, x.idx), P,
                                 lambda x: torch.index_select(x.p, 0, x.idx_v), NEEDS_R),
    "torch.index_add": Recipe(lambda x: torch.index_add(x.p, 0, x.idx, x.p[:2]), P,
                              lambda x: torch.index_add(x.p, 0, x.idx, x.r[:2]), P_PLUS),
    "torch.index_put": Recipe(lambda x: x.p.index_put((x.idx,), x.p[0]), P,
                              lambda x: x.p.index_put((x.idx,), x.r[0]), P_PLUS),
    "torch.cat": Recipe(lambda x: torch.cat([x.p, x.p]), P, lambda x: torch.cat([x.p, x.r]), P_PLUS),
    "Tensor.copy_": Recipe(lambda x: x.p.clone().copy_(x.p), P, lambda x: x.r.clone().copy_(x.v), IN_PLACE),
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
    "Tensor.new_full": Recipe(lambda x: x.p.new_full((4, 4), 0.0), P,
                              lambda x: x.p.new_full((4, 4), 2.0) + x.p, P_PLUS),
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


# ---------------------------------------------------------------------------
# the seed's combination list


def test_op_of_r_is_r(x):
    assert tp_type(torch.exp(x.r) + x.r * x.r) is R


def test_op_of_i_is_i(x):
    assert tp_type(torch.exp(x.i) + x.i * x.i) is I


def test_op_of_v_is_v(x):
    assert tp_type(torch.exp(x.v) + x.v * x.v) is V


def test_op_of_r_and_v_is_v(x):
    assert tp_type(x.r + x.v) is V
    assert tp_type(torch.maximum(x.v, x.r)) is V
    assert tp_type(x.r @ x.v) is V


def test_shard_is_varying(x):
    assert tp_type(x.s0 + x.r).is_varying
    assert tp_type(x.s0 * x.v).is_varying


def test_linear_op_of_p_is_p(x):
    assert tp_type(torch.neg(x.p)) is P
    assert tp_type(x.p.sum()) is P
    assert tp_type(x.p.t()) is P


def test_p_plus_p_is_p(x):
    assert tp_type(x.p + x.p) is P
    assert tp_type(x.p - x.p) is P
    assert tp_type(torch.add(x.p, x.p, alpha=2)) is P


@pytest.mark.parametrize("other", ["r", "v", "p"])
def test_invariant_never_mixes(x, other):
    with pytest.raises(spmd.SpmdTypeError):
        x.i + getattr(x, other)
    with pytest.raises(spmd.SpmdTypeError):
        getattr(x, other) * x.i


def test_invariant_with_r_names_the_fix(x):
    with pytest.raises(spmd.SpmdTypeError) as err:
        x.i * x.r
    assert "Invariant (I) values only combine with other I values" in err.value.rule
    assert any("src=spmd.I, dst=spmd.R" in f for f in err.value.fixes)


def test_p_times_p_rejected(x):
    with rejects(P_TIMES_P):
        x.p * x.p
    with rejects(P_TIMES_P):
        torch.mul(x.p, x.p)


def test_p_times_v_rejected(x):
    with rejects("multiplied by a Replicate"):
        x.p * x.v
    with rejects("multiplied by a Replicate"):
        x.v @ x.p


@pytest.mark.parametrize("op", [torch.exp, torch.tanh, torch.sigmoid, torch.abs, torch.relu, torch.rsqrt])
def test_p_through_nonlinear_rejected(x, op):
    with rejects("is not linear in input"):
        op(x.p)


def test_p_in_divisor_or_exponent_rejected(x):
    with rejects("not linear in other"):
        x.r / x.p
    with rejects("not linear in other"):
        torch.div(x.p, x.p)
    with rejects("not linear"):
        x.r ** x.p
    with rejects("not linear"):
        x.p ** 2


def test_p_times_r_and_p_over_r_accepted(x):
    assert tp_type(x.p * x.r) is P
    assert tp_type(x.r * x.p) is P
    assert tp_type(x.p / x.r) is P
    assert tp_type(torch.div(x.p, x.r)) is P


def test_p_plus_r_rejected(x):
    with rejects(P_PLUS):
        x.p + x.r
    with rejects(P_PLUS):
        x.v - x.p


# ---------------------------------------------------------------------------
# weak Python scalars and plain tensors


@pytest.mark.parametrize("name", ["r", "i", "v", "p"])
def test_scalar_times_keeps_type(x, name):
    t = getattr(x, name)
    want = spmd.get_type(t)["tp"]
    assert tp_type(t * 2) is want
    assert tp_type(2 * t) is want
    assert tp_type(t / 2) is want
    assert tp_type(-t) is want


def test_scalar_plus(x):
    assert tp_type(x.r + 1) is R
    assert tp_type(1 - x.v) is V
    assert tp_type(x.i + 1) is I
    with rejects("adds a constant to P"):
        x.p + 1
    with rejects("adds a constant to P"):
        1 - x.p


def test_adding_zero_to_p_is_p(x):
    assert tp_type(x.p + 0) is P
    assert tp_type(torch.where(x.mask, x.p, 0.0)) is P


def test_scalar_nonlinear(x):
    assert tp_type(x.r ** 2) is R
    assert tp_type(1 / x.r) is R
    with pytest.raises(spmd.SpmdTypeError):
        1 / x.p


def test_plain_tensor_is_weak(x):
    plain = torch.randn(4, 4)
    assert tp_type(x.r + plain) is R
    assert tp_type(plain * x.v) is V
    assert tp_type(x.p * plain) is P
    assert tp_type(plain @ x.p) is P
    assert tp_type(torch.cat([x.v, plain])) is V
    with rejects("adds a constant to P"):
        x.p + plain


def test_plain_only_stays_plain(x):
    out = torch.randn(2) + torch.randn(2)
    assert spmd.get_type(out) is None


def test_strict_rejects_plain_tensor(x):
    plain = torch.randn(4, 4)
    with spmd.typecheck(strict=True):
        with pytest.raises(spmd.SpmdTypeError) as err:
            x.r + plain
        assert "Strict typechecking" in err.value.rule
        assert "plain (untyped) tensor" in err.value.rule
        assert err.value.fixes == ("spmd.assert_type(plain, {'dp': spmd.R, 'tp': spmd.R})",)
        # Python scalars stay weak under strict checking
        assert tp_type(x.r + 1) is R
        assert tp_type(x.p * 2) is P


# ---------------------------------------------------------------------------
# linear ops on P


LINEAR_ON_P = {
    "getitem": lambda p: p[0],
    "getitem_int_list": lambda p: p[[0, 2]],
    "slice": lambda p: p[:, 1:3],
    "slice_step": lambda p: p[::2],
    "ellipsis_none": lambda p: p[..., None],
    "linear_w_R": None,  # below
    "to_dtype": lambda p: p.to(torch.float64),
    "to_kw": lambda p: p.to(dtype=torch.bfloat16),
    "float": lambda p: p.double().float(),
    "type_as": lambda p: p.type_as(torch.zeros(1, dtype=torch.float64)),
    "cat": lambda p: torch.cat([p, p], dim=1),
    "stack": lambda p: torch.stack([p, p]),
    "mean": lambda p: p.mean(),
    "mean_dim": lambda p: torch.mean(p, dim=-1, keepdim=True),
    "sum": lambda p: p.sum(),
    "sum_dim": lambda p: torch.sum(p, dim=(0, 1)),
    "view": lambda p: p.view(2, 8),
    "reshape": lambda p: p.reshape(-1),
    "permute": lambda p: p.permute(1, 0),
    "transpose": lambda p: p.transpose(0, 1),
    "T": lambda p: p.T,
    "contiguous": lambda p: p.t().contiguous(),
    "expand": lambda p: p[None].expand(3, 4, 4),
    "unsqueeze": lambda p: p.unsqueeze(0),
    "squeeze": lambda p: p[None].squeeze(0),
    "flatten": lambda p: p.flatten(),
    "split": lambda p: p.split(2),
    "chunk": lambda p: p.chunk(2, dim=1),
    "unbind": lambda p: p.unbind(0),
    "clone": lambda p: p.clone(),
    "cumsum": lambda p: p.cumsum(0),
    "repeat": lambda p: p.repeat(2, 1),
    "narrow": lambda p: p.narrow(0, 1, 2),
    "triu": lambda p: torch.triu(p),
    "neg": lambda p: -p,
    "pad_zero": lambda p: F.pad(p, (1, 1)),
    "masked_fill_zero": lambda p: p.masked_fill(torch.eye(4, dtype=torch.bool), 0),
}


@pytest.mark.parametrize("name", [k for k in LINEAR_ON_P if LINEAR_ON_P[k] is not None])
def test_linear_op_on_p(x, name):
    out = LINEAR_ON_P[name](x.p)
    outs = out if isinstance(out, (list, tuple)) else [out]
    assert outs and all(tp_type(o) is P for o in outs)


def test_f_linear_on_p(x):
    assert tp_type(F.linear(x.p, x.r)) is P
    assert tp_type(F.linear(x.r, x.p)) is P  # linear in the weight too
    assert tp_type(F.linear(x.p, x.r, x.p[0])) is P  # a P bias is a P term
    assert tp_type(F.linear(x.v, x.r, x.r[0])) is V
    with rejects(P_TIMES_P):
        F.linear(x.p, x.p)
    with rejects(P_TIMES_NON_R):
        F.linear(x.p, x.v)


# ---------------------------------------------------------------------------
# in-place ops and out=


def test_inplace_changing_type_rejected(x):
    with rejects("from R to V"):
        x.r.clone().add_(x.v)
    with rejects(P_TIMES_P):
        x.p.clone().mul_(x.p)
    with rejects("from R to P"):
        x.r.clone().mul_(x.p)
    r = x.r.clone()
    with rejects("from R to V"):
        r += x.v
    with rejects(P_PLUS):
        x.p.clone().add_(1)


def test_inplace_keeping_type_accepted(x):
    p = x.p.clone()
    out = p.add_(x.p)
    assert out is p and tp_type(p) is P
    v = x.v.clone()
    assert tp_type(v.add_(x.r)) is V
    p2 = x.p.clone()
    p2 *= x.r
    p2 += x.p
    p2 /= 2
    assert tp_type(p2) is P
    s0 = x.s0.clone()
    assert tp_type(s0.mul_(x.v)).is_varying
    r = x.r.clone()
    assert tp_type(r.zero_()) is R
    assert tp_type(x.p.clone().masked_fill_(x.mask, 0)) is P


def test_out_argument(x):
    with rejects("out= tensor from R to V"):
        torch.add(x.r, x.v, out=x.r.clone())
    dest = x.v.clone()
    out = torch.add(x.r, x.v, out=dest)
    assert out is dest and tp_type(dest) is V
    with rejects("plain"):
        torch.mul(x.p, x.r, out=torch.empty(4, 4))
    assert tp_type(torch.matmul(x.p, x.r, out=x.p.clone())) is P


def test_setitem(x):
    p = x.p.clone()
    p[0] = x.p[1]
    p[1:3, 0] = 0.0  # zero is a valid pending sum
    assert tp_type(p) is P
    with rejects(P_PLUS):
        p[0] = x.r[0]
    with rejects(P_PLUS):
        p[0] = 1.0
    r = x.r.clone()
    r[x.idx] = x.r[:2]
    assert tp_type(r) is R
    with rejects("from R to V"):
        r[0] = x.v[0]
    v = x.v.clone()
    v[0] = x.r[0]  # R data written into V keeps V
    assert tp_type(v) is V
    with rejects("not linear in index"):
        p[x.idx_p] = x.p[:2]


# ---------------------------------------------------------------------------
# where, masked_fill and the transformer ops


def test_where(x):
    assert tp_type(torch.where(x.mask, x.p, x.p)) is P
    assert tp_type(torch.where(x.mask, x.r, x.v)) is V
    assert tp_type(torch.where(x.mask_v, x.r, x.r)) is V
    with rejects(P_PLUS):
        torch.where(x.mask, x.p, x.r)
    with rejects(NEEDS_R):
        torch.where(x.mask_v, x.p, x.p)
    with rejects(P_PLUS):
        torch.where(x.mask, x.p, 1.0)


def test_masked_fill(x):
    assert tp_type(x.p.masked_fill(x.mask, 0)) is P
    assert tp_type(torch.masked_fill(x.p, x.mask, 0.0)) is P
    assert tp_type(x.r.masked_fill(x.mask, -math.inf)) is R
    assert tp_type(x.v.masked_fill(x.mask, -math.inf)) is V
    with rejects(NOT_LINEAR + " input"):
        x.p.masked_fill(x.mask, -math.inf)
    with rejects(NOT_LINEAR):
        x.p.masked_fill(x.mask, 1)
    with rejects(NEEDS_R):
        x.p.masked_fill(x.mask_v, 0)


def _qkv(t):
    return t.view(1, 1, 4, 4)


def test_sdpa_linear_in_value_only(x):
    assert tp_type(F.scaled_dot_product_attention(_qkv(x.r), _qkv(x.r), _qkv(x.p))) is P
    assert tp_type(F.scaled_dot_product_attention(_qkv(x.v), _qkv(x.v), _qkv(x.v), is_causal=True)) is V
    for q, k in ((x.p, x.r), (x.r, x.p)):
        with rejects(NOT_LINEAR):
            F.scaled_dot_product_attention(_qkv(q), _qkv(k), _qkv(x.r))
    with rejects(NEEDS_R):
        F.scaled_dot_product_attention(_qkv(x.v), _qkv(x.r), _qkv(x.p))
    with rejects(NOT_LINEAR + " attn_mask"):  # the mask is not linear
        F.scaled_dot_product_attention(_qkv(x.r), _qkv(x.r), _qkv(x.p), attn_mask=_qkv(x.p))


def test_embedding_linear_in_weight(x):
    assert tp_type(F.embedding(x.idx, x.p)) is P
    assert tp_type(F.embedding(x.idx, x.r)) is R
    assert tp_type(F.embedding(x.idx_v, x.r)) is V
    with rejects("not linear in input"):
        F.embedding(x.idx_p, x.r)
    with rejects(NEEDS_R):
        F.embedding(x.idx_v, x.p)


def test_cross_entropy(x):
    assert tp_type(F.cross_entropy(x.v, x.target)) is V
    with rejects("F.cross_entropy is not linear in input"):
        F.cross_entropy(x.p, x.target)


NONLINEAR_NN = {
    "softmax": lambda t: F.softmax(t, -1),
    "tensor.softmax": lambda t: t.softmax(-1),
    "torch.softmax": lambda t: torch.softmax(t, -1),
    "log_softmax": lambda t: F.log_softmax(t, -1),
    "layer_norm": lambda t: F.layer_norm(t, (4,)),
    "rms_norm": lambda t: F.rms_norm(t, (4,)),
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "dropout": lambda t: F.dropout(t, 0.5),
}


@pytest.mark.parametrize("name", list(NONLINEAR_NN))
def test_nn_nonlinear_rejects_p(x, name):
    fn = NONLINEAR_NN[name]
    assert tp_type(fn(x.r)) is R
    assert tp_type(fn(x.v)) is V
    with rejects(NOT_LINEAR + " input"):
        fn(x.p)


def test_norm_weight_must_match(x):
    assert tp_type(F.layer_norm(x.r, (4,), weight=x.r[0])) is R
    with rejects("Invariant"):
        F.layer_norm(x.r, (4,), weight=x.i[0])


# ---------------------------------------------------------------------------
# ops not in the table, factories, metadata, backward


def test_unknown_op_is_nonlinear(x):
    assert torch.cosh not in ENTRIES and torch.Tensor.cosh not in ENTRIES
    assert tp_type(torch.cosh(x.r)) is R
    assert tp_type(torch.cosh(x.v)) is V
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch.cosh(x.p)
    assert "torch.cosh is not in the typing-rules table, so it is treated as non-linear" in err.value.rule
    with pytest.raises(spmd.SpmdTypeError) as err:
        x.p.cosh()
    assert "Tensor.cosh is not in the typing-rules table" in err.value.rule


def test_factories(x):
    assert tp_type(torch.zeros_like(x.p)) is P
    assert tp_type(x.p.new_zeros(2)) is P
    assert tp_type(torch.full_like(x.p, 0)) is P
    assert tp_type(torch.ones_like(x.p)) is R
    assert tp_type(torch.rand_like(x.p)) is R
    assert tp_type(torch.full_like(x.p, 3.0)) is R
    assert tp_type(x.p.new_ones(2)) is R
    assert tp_type(x.p.new_full((2,), 5.0)) is R
    assert tp_type(torch.ones_like(x.v)) is V
    assert tp_type(torch.ones_like(x.i)) is I


def test_metadata_never_rejects(x):
    assert x.p.shape == (4, 4)
    assert x.p.size(0) == 4 and x.p.dim() == 2 and x.p.numel() == 16 and len(x.p) == 4
    assert x.p.dtype is torch.float32 and x.p.is_cpu and not x.p.requires_grad
    for value in (x.p.size(), x.p.numel(), x.p.is_contiguous(), x.p.stride()):
        assert not isinstance(value, torch.Tensor)


def test_grad_attributes_on_p(x):
    leaf = spmd.assert_type(torch.randn(4, requires_grad=True), {"dp": I, "tp": P})
    assert leaf.grad is None
    (leaf * 2).sum().backward()
    assert spmd.get_type(leaf.grad) == {"dp": I, "tp": R}  # backward_type of {dp: I, tp: P}
    leaf.grad = None
    leaf.requires_grad = True
    leaf.data = torch.zeros(4)
    assert leaf.grad is None and spmd.get_type(leaf) == {"dp": I, "tp": P}


def test_backward_from_r_scalar_rejected(x):
    w = typed(torch.randn(4, requires_grad=True), R)
    loss = (w * 2).sum()
    with rejects("backward() from a Replicate (R) value"):
        loss.backward()


def test_backward_from_invariant_scalar_accepted(x):
    w = spmd.assert_type(torch.randn(4, requires_grad=True), {"dp": I, "tp": I})
    (w * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((4,), 2.0))


def test_backward_with_explicit_gradient_accepted(x):
    w = typed(torch.randn(4, requires_grad=True), R)
    (w * 2).sum().backward(torch.ones(()))
    assert w.grad is not None


def test_unchecked_outside_typecheck(mesh):
    with spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            p = typed(torch.randn(4), P)
        out = p * p  # erased: no checking outside typecheck()
    assert out.shape == (4,)


def test_result_cache_tells_fill_values_apart(x):
    assert tp_type(F.pad(x.p, (1, 1))) is P
    with rejects(NOT_LINEAR + " input"):
        F.pad(x.p, (1, 1), value=1.0)


def test_keyword_spellings_of_linear_arguments(x):
    """Linear arguments passed by keyword (their names differ per op) are still terms, not constants."""
    idx = torch.zeros(1, 4, dtype=torch.long)
    assert tp_type(torch.addmv(x.p[0], mat=x.p, vec=x.r[0])) is P
    assert tp_type(x.p.scatter(0, idx, src=x.p[:1])) is P
    assert tp_type(x.p.scatter(0, idx, value=0.0)) is P
    assert tp_type(x.p.index_put((x.idx,), values=x.p[:2])) is P
    for bad in (
        lambda: torch.addmv(x.p[0], mat=x.r, vec=x.r[0]),
        lambda: torch.addr(x.p, vec1=x.r[0], vec2=x.r[0]),
        lambda: torch.baddbmm(x.p[None], batch1=x.r[None], batch2=x.r[None]),
        lambda: x.p.scatter_add(0, idx, src=x.r[:1]),
        lambda: x.p.scatter(0, idx, value=1.0),
        lambda: x.p.index_put((x.idx,), values=x.r[:2]),
    ):
        with rejects(P_PLUS):
            bad()
