"""Global SPMD: a plain contraction over a sharded dim is the pending sum it is, once claimed P.

torchtitan writes a row-parallel layer as ``F.linear`` on operands sharded on the
contracted dim and asserts its output P at the module boundary; seed 003 asks for
``out_partial_axes=``. Both typecheck, and give the same values and gradients;
a use before the claim is an error naming both fixes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import per_rank, rank_values, simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
TP = 4


def _full(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _row_parallel(claim: str):
    """Loss and gradients of a row-parallel linear on 4 simulated tp ranks, the pending sum claimed by ``claim``."""
    x_full, w_full = _full(3, 8, seed=0), _full(5, 8, seed=1)
    with simulate((TP,), ("tp",), ranks="local", device="cpu"), spmd.typecheck(local=False):
        x = per_rank(lambda r: x_full.chunk(TP, 1)[r].clone()).requires_grad_()
        w = per_rank(lambda r: w_full.chunk(TP, 1)[r].clone()).requires_grad_()
        spmd.assert_type(x, {"tp": S(1)})
        spmd.assert_type(w, {"tp": S(1)})
        if claim == "explicit":
            y = spmd.linear(x, w, out_partial_axes="tp")
        elif claim == "assert":
            y = F.linear(x, w)
            spmd.assert_type(y, {"tp": P})  # torchtitan's out_src_shardings
        else:  # a declared output type claims it
            y = spmd.local_map(out_types={"tp": P})(lambda a, b: spmd.reinterpret(F.linear(a, b), "tp", src=V, dst=P))(
                x, w) if claim == "local_map" else None
        out = spmd.all_reduce(y, "tp", src=P, dst=I)
        loss = (out * out).sum()
        loss.backward()
        return rank_values(loss)[0], rank_values(x.grad), rank_values(w.grad), spmd.get_type(y)


@pytest.mark.parametrize("claim", ["assert", "explicit", "local_map"])
def test_claimed_contraction_equals_one_device(claim):
    loss, gx, gw, types = _row_parallel(claim)
    x_full, w_full = _full(3, 8, seed=0).requires_grad_(), _full(5, 8, seed=1).requires_grad_()
    ref = (F.linear(x_full, w_full) ** 2).sum()
    ref.backward()
    assert types == {"tp": P}
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(torch.cat([gx[r] for r in range(TP)], 1), x_full.grad)
    torch.testing.assert_close(torch.cat([gw[r] for r in range(TP)], 1), w_full.grad)


@pytest.fixture
def glob():
    with simulate((TP,), ("tp",)), spmd.typecheck(local=False):
        yield


def _sharded(*shape, dim):
    return spmd.assert_type(torch.randn(*shape), {"tp": S(dim)})


def test_use_before_the_claim_is_an_error_naming_both_fixes(glob):
    h, w = _sharded(4, 8, dim=1), _sharded(6, 8, dim=1)
    out = F.linear(h, w)
    with pytest.raises(spmd.SpmdTypeError) as info:
        torch.relu(out)
    assert info.value.rule == (
        "Global SPMD: input sums over a sharded dim (a contraction or a reduction): it is a pending sum (P) on 'tp', "
        "used by torch.relu before anything claimed it. Claim it (an assert, a declared output type) or ask for it "
        "with out_partial_axes.")
    assert info.value.fixes == ("spmd.assert_type(out, {'tp': spmd.P}) right after it",
                                "spmd.sum / spmd.linear / spmd.matmul / spmd.einsum(..., out_partial_axes='tp')")


def test_a_claim_of_another_type_is_refused(glob):
    out = F.linear(_sharded(4, 8, dim=1), _sharded(6, 8, dim=1))
    with pytest.raises(spmd.SpmdTypeError, match="P is not I"):
        spmd.assert_type(out, {"tp": I})


def test_a_collective_with_src_p_is_a_claim(glob):
    out = F.linear(_sharded(4, 8, dim=1), _sharded(6, 8, dim=1))
    reduced = spmd.all_reduce(out, "tp", src=P, dst=R)
    assert spmd.get_type(reduced) == {"tp": R}
    torch.relu(reduced)  # no pending sum left


def test_explicit_partial_on_the_wrong_axis_is_still_refused():
    with simulate((2, 2), ("dp", "tp")), spmd.typecheck(local=False):
        h = spmd.assert_type(torch.randn(4, 8), {"tp": S(1)})
        w = spmd.assert_type(torch.randn(6, 8), {"tp": S(1)})
        with pytest.raises(spmd.SpmdTypeError, match="contracted index 'k' .* is sharded on 'tp'"):
            spmd.linear(h, w, out_partial_axes="dp")


def test_local_spmd_is_unchanged():
    """Locally a matmul of V operands is each rank's own product (V): the pending sum needs a reinterpret."""
    with simulate((TP,), ("tp",)), spmd.typecheck():
        out = F.linear(spmd.assert_type(torch.randn(4, 2), {"tp": V}), spmd.assert_type(torch.randn(6, 2), {"tp": V}))
        assert spmd.get_type(out) == {"tp": V}
        with pytest.raises(spmd.SpmdTypeError, match="V is not P"):
            spmd.assert_type(out, {"tp": P})


def test_adding_into_a_buffer_typed_p_is_a_claim(glob):
    """torchtitan's MoE counts tokens per expert with a sum over sharded dims, added into a buffer typed P."""
    buf = spmd.assert_type(torch.zeros(8), {"tp": P})
    routed = spmd.assert_type(torch.ones(4, 8), {"tp": S(0)})
    counts = routed.sum(0)  # a pending sum on tp
    with torch.no_grad():
        buf.add_(counts)
    assert spmd.get_type(buf) == {"tp": P}
    other = spmd.assert_type(torch.zeros(8), {"tp": R})
    with pytest.raises(spmd.SpmdTypeError, match="sums over a sharded dim"):
        other.add_(counts)  # an R destination claims nothing (and P into R is wrong anyway)
