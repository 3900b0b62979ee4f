"""Values that carry no gradient may mix I with R or V (issue 9, item 2).

Seed 003 keeps Invariant (I) apart from R, V and P because the backward would
hand the I operand an unsummed gradient (or sum one twice). An operand that
carries no gradient (an integer tensor, one that does not require grad,
anything under ``torch.no_grad``) has no backward, so the mix is sound: a
gradient-free I is read as R, and beside a differentiable I a gradient-free R
is read as I. Every accepted case runs on simulated ranks and is compared
with one device, forward and gradients; the unsound neighbours stay rejected.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import per_rank, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
N = 2


@pytest.fixture
def tp2():
    return fake_mesh((N,), ("tp",))


def _same(t: torch.Tensor) -> torch.Tensor:
    return per_rank(lambda r: t.clone())


def _ranks(t: torch.Tensor) -> list[torch.Tensor]:
    values = rank_values(t)
    return [values[r] for r in sorted(values)]


def test_integer_ids_typed_r_meet_an_invariant_embedding(tp2):
    """Megatron: token ids (R) looked up in an embedding whose weight is I: the result is I."""
    torch.manual_seed(0)
    ids0, w0 = torch.randint(0, 10, (3, 5)), torch.randn(10, 4, dtype=torch.float64)
    w_ref = w0.clone().requires_grad_()
    F.embedding(ids0, w_ref).pow(2).sum().backward()
    with LocalTensorMode(N), spmd.set_current_mesh(tp2), spmd.typecheck():
        w = _same(w0).requires_grad_()
        ids = spmd.assert_type(_same(ids0), {"tp": R})
        out = F.embedding(ids, spmd.assert_type(w, {"tp": I}))
        assert spmd.get_type(out) == {"tp": I}
        out.pow(2).sum().backward()
        for g in _ranks(w.grad):
            torch.testing.assert_close(g, w_ref.grad)


def test_integer_ids_typed_i_meet_a_sharded_embedding(tp2):
    """Token ids typed I looked up in an embedding sharded on its hidden dim (V): the result is V."""
    torch.manual_seed(1)
    ids0, w0 = torch.randint(0, 10, (3, 5)), torch.randn(10, 4, dtype=torch.float64)
    w_ref = w0.clone().requires_grad_()
    ref = F.embedding(ids0, w_ref)
    ref.pow(3).sum().backward()
    with LocalTensorMode(N), spmd.set_current_mesh(tp2), spmd.typecheck():
        w = per_rank(lambda r: w0.chunk(N, 1)[r].clone()).requires_grad_()
        ids = spmd.assert_type(_same(ids0), {"tp": I})
        out = F.embedding(ids, spmd.assert_type(w, {"tp": S(1)}))
        assert spmd.get_type(out) == {"tp": V}
        out.pow(3).sum().backward()
        torch.testing.assert_close(torch.cat(_ranks(out), -1), ref.detach())
        torch.testing.assert_close(torch.cat(_ranks(w.grad), 1), w_ref.grad)


def test_clip_coefficient_under_no_grad(tp2):
    """A clipping coefficient typed I scales V gradients inside torch.no_grad."""
    grads0 = [torch.randn(4) for _ in range(N)]
    with LocalTensorMode(N), spmd.set_current_mesh(tp2), spmd.typecheck(), torch.no_grad():
        g = spmd.assert_type(per_rank(lambda r: grads0[r].clone()), {"tp": V})
        coef = spmd.assert_type(_same(torch.tensor(0.5)), {"tp": I})
        scaled = g * coef
        assert spmd.get_type(scaled) == {"tp": V}
        g.mul_(coef)
        for r, v in enumerate(_ranks(g)):
            torch.testing.assert_close(v, grads0[r] * 0.5)


def test_constant_mask_that_needs_no_grad_meets_varying_activations(tp2):
    """With grad mode on, an I tensor that does not require grad (a mask) times a V activation that does."""
    acts0 = [torch.randn(4, dtype=torch.float64) for _ in range(N)]
    mask0 = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    with LocalTensorMode(N), spmd.set_current_mesh(tp2), spmd.typecheck():
        a = per_rank(lambda r: acts0[r].clone()).requires_grad_()
        out = spmd.assert_type(a, {"tp": V}) * spmd.assert_type(_same(mask0), {"tp": I})
        assert spmd.get_type(out) == {"tp": V}
        out.pow(2).sum().backward()
        for r, v in enumerate(_ranks(a.grad)):
            torch.testing.assert_close(v, 2 * acts0[r] * mask0 * mask0)


def test_differentiable_invariant_times_gradient_free_replicate_is_invariant(tp2):
    w0, c0 = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    with LocalTensorMode(N), spmd.set_current_mesh(tp2), spmd.typecheck():
        w = _same(w0).requires_grad_()
        out = spmd.assert_type(w, {"tp": I}) * spmd.assert_type(_same(c0), {"tp": R})
        assert spmd.get_type(out) == {"tp": I}
        out.sum().backward()
        for v in _ranks(w.grad):
            torch.testing.assert_close(v, c0)


# ---------------------------------------------------------------------------
# the unsound neighbours stay rejected


I_MIX = "Invariant (I) values only combine with other I values: {op} combines {a} (I) with {b} ({t})."


def test_varying_ids_never_meet_a_differentiable_invariant_weight(tp2):
    with spmd.set_current_mesh(tp2), spmd.typecheck():
        ids = spmd.assert_type(torch.randint(0, 10, (3,)), {"tp": V})
        w = spmd.assert_type(torch.randn(10, 4, requires_grad=True), {"tp": I})
        with pytest.raises(spmd.SpmdTypeError) as err:
            F.embedding(ids, w)
    assert err.value.rule.startswith(I_MIX.format(op="F.embedding", a="weight", b="input", t="V"))


def test_differentiable_invariant_still_never_meets_varying(tp2):
    with spmd.set_current_mesh(tp2), spmd.typecheck():
        w = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
        v = spmd.assert_type(torch.randn(4), {"tp": V})
        with pytest.raises(spmd.SpmdTypeError) as err:
            w * v
    assert err.value.fixes == ("spmd.convert(w, 'tp', src=spmd.I, dst=spmd.R)",)


def test_relaxed_result_is_not_cached_for_differentiable_operands(tp2):
    """The result cache is keyed by types: a gradient-free acceptance must not be reused when gradients flow."""
    with spmd.set_current_mesh(tp2), spmd.typecheck():
        v = spmd.assert_type(torch.randn(4), {"tp": V})
        with torch.no_grad():
            c = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
            assert spmd.get_type(c * v) == {"tp": V}
        with pytest.raises(spmd.SpmdTypeError, match=r"Invariant \(I\) values only combine"):
            c * v


def test_foreach_relaxed_result_is_not_cached_for_differentiable_operands(tp2):
    """The multi-tensor kernels cache per-element types too: a gradient-free acceptance is not reused."""
    with spmd.set_current_mesh(tp2), spmd.typecheck():
        v = spmd.assert_type(torch.randn(4), {"tp": V})
        c = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
        with torch.no_grad():
            assert spmd.get_type(torch._foreach_mul([c], [v])[0]) == {"tp": V}
        with pytest.raises(spmd.SpmdTypeError, match=r"Invariant \(I\) values only combine"):
            torch._foreach_mul([c], [v])


def test_a_gradient_free_acceptance_is_remembered_with_the_gradients(tp2):
    """The result cache keeps a gradient-free acceptance under the operands' gradients too: the same types
    with a differentiable operand are refused again, however often the gradient-free form ran first."""
    with spmd.set_current_mesh(tp2), spmd.typecheck():
        for _ in range(3):
            x = spmd.assert_type(torch.randn(4), {"tp": I})
            y = spmd.assert_type(torch.randn(4), {"tp": V})
            assert spmd.get_type(x * y) == {"tp": V}  # x carries no gradient: read as R
        for _ in range(2):
            x = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
            with pytest.raises(spmd.SpmdTypeError, match="Invariant"):
                x * spmd.assert_type(torch.randn(4), {"tp": V})
        with torch.no_grad():  # no gradient anywhere: accepted again
            assert spmd.get_type(x * spmd.assert_type(torch.randn(4), {"tp": V})) == {"tp": V}
