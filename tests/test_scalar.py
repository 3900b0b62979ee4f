"""``spmd.Scalar(value, types)``: a per-rank number typed like a 0-d tensor of that type."""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types._comm.call import resolve_comm
from spmd_types._comm.impl import group_rank
from spmd_types.testing import CommCounter, denote, per_rank, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def tp4():
    m = fake_mesh((4,), ("tp",))
    with spmd.set_current_mesh(m):
        yield m


def test_a_plain_number_is_weak_a_scalar_is_typed(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        x = spmd.assert_type(torch.ones(3), {"dp": R, "tp": R})
        s = spmd.Scalar(3, {"dp": V, "tp": R})
        assert s.dim() == 0 and s.dtype == torch.int64 and int(s) == 3
        assert spmd.get_type(x * 3) == {"dp": R, "tp": R}  # weak: takes x's type
        assert spmd.get_type(x * s) == {"dp": V, "tp": R}  # this rank's number: V on dp
        assert spmd.get_type(s * x) == {"dp": V, "tp": R}


def test_dtypes_are_those_a_python_number_gives():
    mesh = fake_mesh((2,), ("tp",))
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        bf = spmd.assert_type(torch.ones(2, dtype=torch.bfloat16), {"tp": V})
        ints = spmd.assert_type(torch.ones(2, dtype=torch.int32), {"tp": V})
        assert (bf * spmd.Scalar(2.5, {"tp": V})).dtype == (torch.ones(2, dtype=torch.bfloat16) * 2.5).dtype
        assert (ints * spmd.Scalar(2.5, {"tp": V})).dtype == (torch.ones(2, dtype=torch.int32) * 2.5).dtype
        assert (ints * spmd.Scalar(2, {"tp": V})).dtype == torch.int32
        assert spmd.Scalar(True, {"tp": V}).dtype == torch.bool
        assert spmd.Scalar(1, {"tp": V}, dtype=torch.float16).dtype == torch.float16


def test_per_rank_values_forward_and_backward(tp4):
    """y = x / n with a per-rank n: the value and the gradient are those of one device's stacked arrays."""
    with LocalTensorMode(4):
        x = per_rank(lambda r: torch.arange(3.0) + r).requires_grad_()
        counts = {0: 1.0, 1: 2.0, 2: 4.0, 3: 8.0}
        with spmd.typecheck():
            n = spmd.Scalar(per_rank(lambda r: torch.tensor(counts[r])), {"tp": V})
            with CommCounter() as comms:
                y = spmd.assert_type(x, {"tp": V}) / n
                (gx,) = torch.autograd.grad(y.sum(), x)
            assert comms.total == 0 and spmd.get_type(y) == {"tp": V}
        xs = denote(x, tp4, {"tp": V}).clone().requires_grad_()
        ns = torch.tensor([counts[r] for r in range(4)])
        torch.testing.assert_close(denote(y, tp4, {"tp": V}), xs.detach() / ns[:, None])
        (want,) = torch.autograd.grad((xs / ns[:, None]).sum(), xs)
        torch.testing.assert_close(denote(gx, tp4, {"tp": V}), want)


def test_a_per_rank_symint_from_the_simulator(tp4):
    with LocalTensorMode(4), spmd.typecheck():
        index = group_rank(resolve_comm("test", "tp"))
        s = spmd.Scalar(index * 10, {"tp": V})
        assert {r: int(v) for r, v in rank_values(s).items()} == {0: 0, 1: 10, 2: 20, 3: 30}


def test_erased_outside_typecheck(tp4):
    s = spmd.Scalar(2.0, {"tp": V})
    assert type(s) is torch.Tensor and float(s) == 2.0 and spmd.get_type(s) is None


def test_a_per_rank_scalar_cannot_pose_as_replicated(tp4):
    with spmd.typecheck():
        w = spmd.assert_type(torch.ones(2, requires_grad=True), {"tp": I})
        with pytest.raises(spmd.SpmdTypeError) as info:
            w * spmd.Scalar(0.5, {"tp": V})
        assert info.value.rule == (
            "Invariant (I) values only combine with other I values: Tensor.__mul__ (*) combines input (I) with "
            "other (V). Convert the I operand to R, so that its gradient is all-reduced in backward."
        )
        y = spmd.assert_type(torch.ones(2), {"tp": P})
        with pytest.raises(spmd.SpmdTypeError) as info:
            y * spmd.Scalar(0.5, {"tp": P})
        assert info.value.rule == (
            "Partial * Partial: Tensor.__mul__ (*) is linear in each factor separately, not in both, so at most "
            "one factor may be a pending sum (P)."
        )


def test_bad_values(tp4):
    with pytest.raises(TypeError) as info:
        spmd.Scalar([1.0], {"tp": V})
    assert str(info.value) == "spmd.Scalar takes a Python number (or a 0-d tensor), got list"
    with pytest.raises(ValueError) as info:
        spmd.Scalar(torch.ones(2), {"tp": V})
    assert str(info.value) == "spmd.Scalar takes a 0-d tensor, got shape [2]"
    with spmd.typecheck():
        typed = spmd.Scalar(1.0, {"tp": V})
        with pytest.raises(TypeError) as info:
            spmd.Scalar(typed, {"tp": V})
        assert str(info.value) == "spmd.Scalar takes a plain number or a plain 0-d tensor; this tensor is typed already"
        with pytest.raises(TypeError) as info:
            spmd.Scalar(1.0, [V])
        assert str(info.value) == (
            "assert_type takes types as a dict {axis: type}, e.g. {'tp': spmd.R}, an spmd.SpmdType, a PartitionSpec, "
            "or one of R, I, V, P; got [V]"
        )


def test_global_spmd_has_no_place_for_a_per_rank_scalar(tp4):
    with spmd.typecheck(local=False):
        assert spmd.get_type(spmd.Scalar(2.0, {"tp": R})) == {"tp": R}
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.Scalar(2.0, {"tp": V})
    assert info.value.rule == (
        "Global SPMD: the tensor is V on axis 'tp', which is checked in global SPMD, but no dim is sharded on it: "
        "say how it reassembles with S(d) or partition_spec=."
    )


# ---------------------------------------------------------------------------
# issue 14, item 4: factories from a typed scalar (choice 28)


def test_a_copy_of_a_typed_scalar_written_as_an_op_keeps_its_type_on_simulated_ranks(tp4):
    """torch.tensor / torch.full read no types (choice 28): the spellings the docs give do, with the values."""
    with LocalTensorMode(4), spmd.typecheck():
        s = spmd.Scalar(per_rank(lambda r: torch.tensor(r / 2)), {"tp": V})
        s2 = spmd.Scalar(per_rank(lambda r: torch.tensor(float(r))), {"tp": V})
        copies = {
            "torch.tensor(s)": s.detach().clone(),
            "torch.tensor(s, dtype=torch.float64)": s.to(torch.float64),
            "torch.full((4,), s)": s.expand(4).clone(),
            "torch.tensor([s, s2])": torch.stack([s, s2]),
        }
        for name, c in copies.items():
            assert spmd.get_type(c) == {"tp": V}, name
        assert copies["torch.tensor(s, dtype=torch.float64)"].dtype == torch.float64
        for r, v in rank_values(copies["torch.full((4,), s)"]).items():
            assert torch.equal(v, torch.full((4,), r / 2))
        for r, v in rank_values(copies["torch.tensor([s, s2])"]).items():
            assert torch.equal(v, torch.tensor([r / 2, float(r)]))


def test_a_factory_of_a_typed_scalar_is_plain_and_strict_mode_names_it(tp4):
    """torch.tensor is not overridable by a tensor subclass: its result is plain (weak), as choice 28 says."""
    with spmd.typecheck(strict=True):
        s = spmd.Scalar(0.5, {"tp": V})
        with pytest.warns(UserWarning, match="To copy construct from a tensor"):
            copy = torch.tensor(s)
        assert spmd.get_type(copy) is None
        x = spmd.assert_type(torch.ones(3), {"tp": V})
        with pytest.raises(spmd.SpmdTypeError) as err:
            x * copy
    assert err.value.rule == (
        "Strict typechecking: Tensor.__mul__ (*) got a plain (untyped) tensor as other; give it a type first.")
