"""Pinned texts of the typing-rules errors (plain rendering: pytest's stderr is not a TTY).

Each test pins the whole ``str(err)``, including the ``at:`` line, which
shows this file's own source line the way ``_errors.user_source_line`` does
(the path relative to the working directory, unless that climbs out of it).
The statement that raises is the only line in this file with that text, so
``at(code)`` can find its line number.
"""

# ruff: noqa: E501, F841  (pinned messages are long lines; `h = p * v` shows an assignment in `at:`)
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import fake_mesh

import spmd_types as spmd
from spmd_types import I, P, R, V
from spmd_types._checker import tensor as _tensor
from spmd_types._local.op_registry import entry_for

_FILE = os.path.abspath(__file__)
with open(_FILE) as _f:
    _LINES = [line.strip() for line in _f]


def at(code: str) -> str:
    """``path:line: code`` for the one line of this file that reads ``code``."""
    hits = [n for n, line in enumerate(_LINES, 1) if line == code]
    assert len(hits) == 1, (code, hits)
    shown = os.path.relpath(_FILE)
    if shown.startswith(".."):
        shown = _FILE
    return f"{shown}:{hits[0]}: {code}"


def pinned(text: str, code: str) -> str:
    return text.strip("\n").replace("@AT@", at(code))


@pytest.fixture(scope="module")
def mesh():
    return fake_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(autouse=True)
def plain_errors(monkeypatch):
    monkeypatch.setenv("SPMD_TYPES_ERRORS", "plain")
    for cache in getattr(_tensor, "_CACHES", ()):
        cache.clear()


@pytest.fixture
def env(mesh):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        yield


def t(tp, shape=(4, 4), dp=R, grad=False):
    return spmd.assert_type(torch.randn(*shape, requires_grad=grad), {"dp": dp, "tp": tp})


def test_p_times_p(env):
    p = t(P)
    with pytest.raises(spmd.SpmdTypeError) as err:
        p * p
    assert str(err.value) == pinned("""
Partial * Partial: Tensor.__mul__ (*) is linear in each factor separately, not in both, so at most one factor may be a pending sum (P).
  op:       Tensor.__mul__ (*)
  operands: input (p): {dp: R, tp: P}
            other (p): {dp: R, tp: P}
  axis:     'tp': input is P and other is P
  at:       @AT@
  fix:      spmd.all_reduce(p, 'tp', src=spmd.P, dst=spmd.R)
""", "p * p")
    assert err.value.plain == str(err.value)
    assert isinstance(err.value, TypeError)


def test_p_times_v(env):
    p, v = t(P), t(V)
    with pytest.raises(spmd.SpmdTypeError) as err:
        h = p * v
    assert str(err.value) == pinned("""
A pending sum (P) can only be multiplied by a Replicate (R) value: Tensor.__mul__ (*) multiplies P by V, and a sum times a per-rank value is not the sum of the products.
  op:       Tensor.__mul__ (*)
  operands: input (p): {dp: R, tp: P}
            other (v): {dp: R, tp: V}
  axis:     'tp': input is P and other is V
  at:       @AT@
  fix:      spmd.all_reduce(p, 'tp', src=spmd.P, dst=spmd.R)
""", "h = p * v")


def test_p_plus_r(env):
    partial, bias = t(P), t(R)
    with pytest.raises(spmd.SpmdTypeError) as err:
        out = partial + bias
    assert str(err.value) == pinned("""
A pending sum (P) can only be added to another pending sum: Tensor.__add__ (+) adds P to R, and the R value would be added once on every rank.
  op:       Tensor.__add__ (+)
  operands: input (partial): {dp: R, tp: P}
            other (bias): {dp: R, tp: R}
  axis:     'tp': input is P and other is R
  at:       @AT@
  fix:      spmd.all_reduce(partial, 'tp', src=spmd.P, dst=spmd.R)
  or:       spmd.convert(bias, 'tp', src=spmd.R, dst=spmd.P)
""", "out = partial + bias")


def test_p_plus_scalar(env):
    p = t(P)
    with pytest.raises(spmd.SpmdTypeError) as err:
        y = p + 1
    assert str(err.value) == pinned("""
A pending sum (P) can only be added to another pending sum: Tensor.__add__ (+) adds a constant to P, and it would be added once on every rank.
  op:       Tensor.__add__ (+)
  operands: input (p): {dp: R, tp: P}
            other (1): Python number
  axis:     'tp': other is a constant
  at:       @AT@
  fix:      spmd.all_reduce(p, 'tp', src=spmd.P, dst=spmd.R)
""", "y = p + 1")


def test_p_through_nonlinear(env):
    logits = t(P)
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch.exp(logits)
    assert str(err.value) == pinned("""
torch.exp is not linear in input, so input cannot be a pending sum (P).
  op:       torch.exp
  operands: input (logits): {dp: R, tp: P}
  axis:     'tp': input is P
  at:       @AT@
  fix:      spmd.all_reduce(logits, 'tp', src=spmd.P, dst=spmd.R)
""", "torch.exp(logits)")


def test_p_in_divisor(env):
    r, p = t(R), t(P)
    with pytest.raises(spmd.SpmdTypeError) as err:
        q = r / p
    assert str(err.value) == pinned("""
Tensor.__truediv__ (/) is not linear in other, so other cannot be a pending sum (P).
  op:       Tensor.__truediv__ (/)
  operands: input (r): {dp: R, tp: R}
            other (p): {dp: R, tp: P}
  axis:     'tp': other is P
  at:       @AT@
  fix:      spmd.all_reduce(p, 'tp', src=spmd.P, dst=spmd.R)
""", "q = r / p")


def test_unknown_op_says_so(env):
    p = t(P)
    assert not entry_for(torch.cosh).known
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch.cosh(p)
    assert str(err.value) == pinned("""
torch.cosh is not linear in input, so input cannot be a pending sum (P). (torch.cosh is not in the typing-rules table, so it is treated as non-linear.)
  op:       torch.cosh
  operands: input (p): {dp: R, tp: P}
  axis:     'tp': input is P
  at:       @AT@
  fix:      spmd.all_reduce(p, 'tp', src=spmd.P, dst=spmd.R)
""", "torch.cosh(p)")


def test_invariant_mixed_with_replicate(env):
    w, x = t(I, grad=True), t(R, grad=True)
    with pytest.raises(spmd.SpmdTypeError) as err:
        w + x
    assert str(err.value) == pinned("""
Invariant (I) values only combine with other I values: Tensor.__add__ (+) combines input (I) with other (R). Convert the I operand to R, so that its gradient is all-reduced in backward.
  op:       Tensor.__add__ (+)
  operands: input (w): {dp: R, tp: I}
            other (x): {dp: R, tp: R}
  axis:     'tp': input is I and other is R
  at:       @AT@
  fix:      spmd.convert(w, 'tp', src=spmd.I, dst=spmd.R)
""", "w + x")


def test_where_condition_must_be_r(env):
    p = t(P)
    cond = spmd.assert_type(torch.rand(4, 4) > 0.5, {"dp": R, "tp": V})
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch.where(cond, p, p)
    assert str(err.value) == pinned("""
torch.where is linear in input but not in condition: with a pending sum (P) in input, condition must be Replicate (R), and it is V.
  op:       torch.where
  operands: condition (cond): {dp: R, tp: V}
            input (p): {dp: R, tp: P}
            other (p): {dp: R, tp: P}
  axis:     'tp': input is P and condition is V
  at:       @AT@
  fix:      spmd.all_reduce(p, 'tp', src=spmd.P, dst=spmd.R)
""", "torch.where(cond, p, p)")


def test_inplace_changes_type(env):
    r, v = t(R), t(V)
    alias = r.view_as(r)  # noqa: F841 - another tensor on r's storage still claims R
    with pytest.raises(spmd.SpmdTypeError) as err:
        r.add_(v)
    assert str(err.value) == pinned("""
An in-place op cannot change its tensor's type: Tensor.add_ would change its first operand from R to V on axis 'tp'.
  op:          Tensor.add_
  destination: {dp: R, tp: R}
  result:      {dp: R, tp: V}
  axis:        'tp': R -> V
  at:          @AT@
  fix:         the out-of-place form, assigning the result (e.g. `x = x + y` for `x += y`)
""", "r.add_(v)")


def test_out_changes_type(env):
    r, v = t(R), t(V)
    alias = r.view_as(r)  # noqa: F841 - another tensor on r's storage still claims R
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch.add(r, v, out=r)
    assert str(err.value) == pinned("""
An in-place op cannot change its tensor's type: torch.add would change its out= tensor from R to V on axis 'tp'.
  op:          torch.add
  destination: {dp: R, tp: R}
  result:      {dp: R, tp: V}
  axis:        'tp': R -> V
  at:          @AT@
  fix:         the out-of-place form, assigning the result (e.g. `x = x + y` for `x += y`)
""", "torch.add(r, v, out=r)")


def test_linear_bias_with_partial_input(env):
    x, w, b = t(P), t(R), t(R, shape=(4,))
    with pytest.raises(spmd.SpmdTypeError) as err:
        F.linear(x, w, b)
    assert str(err.value) == pinned("""
A pending sum (P) can only be added to another pending sum: F.linear adds P to R, and the R value would be added once on every rank.
  op:       F.linear
  operands: input (x): {dp: R, tp: P}
            weight (w): {dp: R, tp: R}
            bias (b): {dp: R, tp: R}
  axis:     'tp': input is P and bias is R
  at:       @AT@
  fix:      spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)
  or:       spmd.convert(b, 'tp', src=spmd.R, dst=spmd.P)
""", "F.linear(x, w, b)")


def test_cross_entropy_partial_logits(env):
    logits = t(P)
    labels = spmd.assert_type(torch.tensor([0, 1, 2, 3]), {"dp": R, "tp": R})
    with pytest.raises(spmd.SpmdTypeError) as err:
        F.cross_entropy(logits, labels)
    assert err.value.rule == "F.cross_entropy is not linear in input, so input cannot be a pending sum (P)."
    assert ("axis", "'tp': input is P") in err.value.seen
    assert err.value.fixes == ("spmd.all_reduce(logits, 'tp', src=spmd.P, dst=spmd.R)",)
    assert err.value.source == at("F.cross_entropy(logits, labels)")


def test_strict_plain_tensor(env):
    r = t(R)
    plain = torch.ones(4, 4)
    with spmd.typecheck(strict=True):
        with pytest.raises(spmd.SpmdTypeError) as err:
            r + plain
    assert str(err.value) == pinned("""
Strict typechecking: Tensor.__add__ (+) got a plain (untyped) tensor as other; give it a type first.
  op:      Tensor.__add__ (+)
  operand: other: plain tensor (untyped)
  at:      @AT@
  fix:     spmd.assert_type(plain, {'dp': spmd.R, 'tp': spmd.R})
  note:    the typed operand input is {dp: R, tp: R}
""", "r + plain")


def test_backward_from_replicate(env):
    w = spmd.assert_type(torch.randn(4, requires_grad=True), {"dp": I, "tp": R})
    loss = (w * 2).sum()
    with pytest.raises(spmd.SpmdTypeError) as err:
        loss.backward()
    assert str(err.value) == pinned("""
backward() from a Replicate (R) value seeds a gradient of 1 on every rank; the gradient of R is a pending sum (P), so that seed means the mesh size, not 1, and every gradient would be scaled by it.
  op:   Tensor.backward
  root: {dp: I, tp: R}
  axis: 'tp': root is R
  at:   @AT@
  fix:  spmd.convert(loss, 'tp', src=spmd.R, dst=spmd.I)
  or:   spmd.all_reduce(..., 'tp', src=spmd.P, dst=spmd.I) where the loss is reduced
""", "loss.backward()")


def test_into_zeros_the_index_rule_remains(env):
    """A buffer of zeros takes the values' type (choice 30); beside P values the index must still be R."""
    p, idx = t(P, shape=(2,)), t(V, shape=(2,)).long()
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch.zeros(4).index_add(0, idx, p)
    assert str(err.value) == pinned("""
Tensor.index_add is linear in source but not in index: with a pending sum (P) in source, index must be Replicate (R), and it is V.
  op:       Tensor.index_add
  operands: input (torch.zeros(4)): all zeros (takes the written values' type)
            dim (0): Python number
            index (idx): {dp: R, tp: V}
            source (p): {dp: R, tp: P}
  axis:     'tp': source is P and index is V
  at:       @AT@
  fix:      spmd.all_reduce(p, 'tp', src=spmd.P, dst=spmd.R)
""", "torch.zeros(4).index_add(0, idx, p)")
