"""``spmd.no_typecheck``: unchecked regions, with inputs checked on entry and outputs typed on exit."""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import CommCounter, denote, pair, per_rank, random_value

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def tp4():
    m = fake_mesh((4,), ("tp",))
    with spmd.set_current_mesh(m):
        yield m


def test_with_block_switches_checking_off_and_back(tp4):
    with spmd.typecheck():
        x = spmd.assert_type(torch.ones(2), {"tp": P})
        with spmd.no_typecheck():
            assert not spmd.is_checking()
            y = torch.exp(x)  # P through a non-linear op: the checker would refuse it
            assert spmd.get_type(y) is None
            with spmd.no_typecheck():  # nests
                assert not spmd.is_checking()
            assert not spmd.is_checking()
        assert spmd.is_checking()
        with pytest.raises(spmd.SpmdTypeError):
            torch.exp(x)
    assert not spmd.is_checking()


def test_with_block_restores_checking_after_an_exception(tp4):
    with spmd.typecheck():
        with pytest.raises(KeyError):
            with spmd.no_typecheck():
                raise KeyError("x")
        assert spmd.is_checking()


def _opaque(x: torch.Tensor) -> torch.Tensor:
    """Stands for a kernel the checker cannot see: exp of this rank's values."""
    return torch.exp(x)


def test_decorator_checks_inputs_and_types_outputs(tp4):
    kernel = spmd.no_typecheck(_opaque, in_types=[{"tp": V}], out_types={"tp": V})
    with spmd.typecheck():
        x = spmd.assert_type(torch.ones(2), {"tp": V})
        y = kernel(x)
        assert spmd.get_type(y) == {"tp": V}
        with pytest.raises(spmd.SpmdTypeError) as info:
            kernel(spmd.assert_type(torch.ones(2), {"tp": R}))
        assert info.value.rule == "Type assertion failed: the tensor is R on axis 'tp', and the assertion says V."
    assert torch.equal(kernel(torch.ones(2)), torch.exp(torch.ones(2)))  # erased outside typecheck


def test_numerics_and_gradients_on_simulated_ranks(tp4):
    """The declared types carry the gradient across: V in, V out; values and gradient match one device."""

    @spmd.no_typecheck(in_types=[{"tp": V}], out_types={"tp": V})
    def kernel(x):
        return torch.exp(x)

    with LocalTensorMode(4):
        x = random_value(tp4, {"tp": V}, (3,)).requires_grad_()
        with spmd.typecheck(), CommCounter() as comms:
            y = kernel(spmd.assert_type(x, {"tp": V}))
            loss = spmd.all_reduce(y.sum(), "tp", src=V, dst=I)
            (gx,) = torch.autograd.grad(loss, x)
        assert comms.counts == {"all_reduce": 1}
        xs = denote(x, tp4, {"tp": V}).clone().requires_grad_()
        torch.testing.assert_close(denote(y, tp4, {"tp": V}), xs.detach().exp())
        (want,) = torch.autograd.grad(xs.exp().sum(), xs)
        torch.testing.assert_close(denote(gx, tp4, {"tp": V}), want)


def test_methods_tuples_and_skipped_outputs(tp4):
    class Block(torch.nn.Module):
        @spmd.no_typecheck(in_types=[{"tp": P}], out_types=[{"tp": R}, None])
        def forward(self, h):
            total = h.sum()  # unchecked: the body is trusted
            return h * 0 + total, total.item()

    with spmd.typecheck():
        out, n = Block()(spmd.assert_type(torch.ones(2), {"tp": P}))
        assert spmd.get_type(out) == {"tp": R} and n == 2.0


def test_a_typed_value_passed_through_must_match_its_declared_type(tp4):
    @spmd.no_typecheck(in_types=[{"tp": P}], out_types={"tp": R})
    def passthrough(h):
        return h

    with spmd.typecheck():
        with pytest.raises(spmd.SpmdTypeError) as info:
            passthrough(spmd.assert_type(torch.ones(2), {"tp": P}))
    assert info.value.rule == (
        "spmd.no_typecheck: output 0 of test_a_typed_value_passed_through_must_match_its_declared_type.<locals>."
        "passthrough is P on axis 'tp', and out_types declares R."
    )
    assert info.value.fixes == ("spmd.all_reduce(output0, 'tp', src=spmd.P, dst=spmd.R) before returning",)


def test_bad_uses(tp4):
    with pytest.raises(TypeError) as info:
        with spmd.no_typecheck(in_types=[{"tp": V}]):
            pass
    assert str(info.value) == (
        "spmd.no_typecheck: in_types= and out_types= type a function's arguments and results; decorate the "
        "function (@spmd.no_typecheck(in_types=..., out_types=...)), or use a bare `with spmd.no_typecheck():` "
        "and assert_type its results"
    )

    @spmd.no_typecheck(in_types=[{"tp": V}, {"tp": V}], out_types=[{"tp": V}, {"tp": V}])
    def two(a, b):
        return a

    @spmd.no_typecheck(out_types={"tp": V})
    def number():
        return 3

    with spmd.typecheck():
        x = spmd.assert_type(torch.ones(2), {"tp": V})
        with pytest.raises(TypeError) as info:
            two(x)
        assert str(info.value) == "spmd.no_typecheck(test_bad_uses.<locals>.two): 2 in_types for 1 arguments"
        with pytest.raises(TypeError) as info:
            two(x, x)
        assert str(info.value) == "spmd.no_typecheck(test_bad_uses.<locals>.two): 2 out_types for the LTensor it returned"
        with pytest.raises(TypeError) as info:
            number()
        assert str(info.value) == "spmd.no_typecheck(test_bad_uses.<locals>.number): output 0 is a int, not a tensor"
        assert spmd.is_checking()


def test_per_rank_pair_identity_across_the_region(tp4):
    """A linear body declared P in, P out: the adjoint identity holds through the region on simulated ranks."""

    @spmd.no_typecheck(in_types=[{"tp": P}], out_types={"tp": P})
    def scale(h):
        return h * 3

    with LocalTensorMode(4):
        x = random_value(tp4, {"tp": P}, (2,)).requires_grad_()
        with spmd.typecheck():
            y = scale(spmd.assert_type(x, {"tp": P}))
        g = per_rank(lambda r: torch.tensor([1.0, -2.0]))
        (gx,) = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(pair(y, g, tp4, {"tp": P}), pair(x, gx, tp4, {"tp": P}), rtol=1e-5, atol=1e-5)
