"""An R or I tensor that carries no gradient and has no alias may become V in place (written with per-rank values).

torchtitan's token dispatcher fills ``out = x.new_empty(shape)`` (R) with ``out[idx] = routed`` (V): the
same data on every rank is replaced by per-rank data, which is what V means; with no gradient nothing can
go wrong in backward, and with no alias no other tensor still claims R. Anything else keeps choice 7.
"""

from __future__ import annotations

import pytest
import torch

import spmd_types as spmd
from spmd_types.testing import per_rank, rank_values, simulate

R, I, V = spmd.R, spmd.I, spmd.V


def test_a_fresh_replicated_buffer_filled_with_varying_rows_becomes_varying_and_carries_the_gradient():
    rows = {r: torch.arange(6.0, dtype=torch.float64).view(3, 2) + 10 * r for r in range(2)}
    perm = torch.tensor([2, 0, 1])
    with simulate((2,), ("ep",), ranks="local", device="cpu"), spmd.typecheck():
        routed = spmd.assert_type(per_rank(lambda r: rows[r].clone()).requires_grad_(), {"ep": V})
        out = routed.new_empty((3, 2))
        assert spmd.get_type(out) == {"ep": R}
        out[perm, :] = routed
        assert spmd.get_type(out) == {"ep": V}
        (out * torch.arange(3.0, dtype=torch.float64).view(3, 1)).sum().backward()
        for r in range(2):
            want = torch.empty(3, 2, dtype=torch.float64)
            want[perm] = rows[r]
            torch.testing.assert_close(rank_values(out)[r], want)
            grad = torch.arange(3.0, dtype=torch.float64).view(3, 1).expand(3, 2)[perm]
            torch.testing.assert_close(rank_values(routed.grad)[r], grad)


def test_a_buffer_with_an_alias_or_a_gradient_keeps_its_type():
    with simulate((2,), ("ep",)), spmd.typecheck():
        v = spmd.assert_type(torch.ones(3, 2), {"ep": V})
        aliased = spmd.assert_type(torch.zeros(3, 2), {"ep": R})
        view = aliased[0]  # another tensor on its storage still claims R
        with pytest.raises(spmd.SpmdTypeError, match="An in-place op cannot change its tensor's type"):
            aliased[torch.tensor([0, 1, 2]), :] = v
        assert spmd.get_type(view) == {"ep": R}
        needs_grad = spmd.assert_type(torch.zeros(3, 2, requires_grad=True) * 1, {"ep": R})
        with pytest.raises(spmd.SpmdTypeError, match="from R to V on axis 'ep'"):
            needs_grad.add_(v)  # its gradient would be typed by the old type
