"""Strict typechecking (issue 11, item 5) and what backward() from a V loss means.

* ``typecheck(strict=True)``: a plain tensor given to a typed communication op
  (``spmd.all_reduce``, ``reinterpret``, ``convert``, ... ) is an error, and so is
  ``backward()`` from a plain (untyped) loss that reaches a typed leaf.
* A V loss is a list of per-rank losses (seed 003). ``backward()`` seeds 1 on
  every rank: the cotangent ``[1, ..., 1]`` of that list, so the gradients are
  those of the sum of the per-rank losses. Checked here on simulated ranks
  against the single-device gradient of that sum.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode, maybe_disable_local_tensor_mode

import spmd_types as spmd
from spmd_types.testing import CommCounter, denote, per_rank, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def dp4():
    mesh = fake_mesh((4,), ("dp",))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        yield mesh


def test_untyped_input_to_a_collective(dp4):
    x = per_rank(lambda r: torch.full((4,), float(r)))
    with spmd.typecheck(strict=True), CommCounter() as comms:
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.all_reduce(x, "dp", src=P, dst=R)
    assert comms.total == 0, "the error comes before any communication"
    err = info.value
    assert err.rule == (
        "Strict typechecking: spmd.all_reduce got a plain (untyped) tensor, so its src=P cannot be checked; "
        "give it a type first."
    )
    assert err.seen == (("op", "spmd.all_reduce(x, 'dp', src=spmd.P, dst=spmd.R)"), ("input", "plain tensor (untyped)"))
    assert err.fixes == ("spmd.assert_type(x, {'dp': spmd.P})",)
    with spmd.typecheck(strict=True):
        for op, kwargs in ((spmd.reinterpret, {"src": V, "dst": P}), (spmd.convert, {"src": R, "dst": V}),
                           (spmd.redistribute, {"src": R, "dst": R})):
            with pytest.raises(spmd.SpmdTypeError, match="^Strict typechecking: spmd"):
                op(x, "dp", **kwargs)
    with spmd.typecheck():  # not strict: a plain input runs untyped
        y = spmd.all_reduce(x, "dp", src=P, dst=R)
    assert spmd.get_type(y) is None
    assert all(torch.equal(v, torch.full((4,), 6.0)) for v in rank_values(y).values())


def _leaf(mesh_types):
    w = torch.randn(3, requires_grad=True)
    return spmd.assert_type(w, mesh_types)


def test_backward_from_an_untyped_loss():
    mesh = fake_mesh((4,), ("dp",))
    with spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            w = _leaf({"dp": I})
        loss = (w * w).sum()  # computed outside typecheck: a plain loss
        assert spmd.get_type(loss) is None
        with spmd.typecheck(strict=True):
            with pytest.raises(spmd.SpmdTypeError) as info:
                loss.backward(retain_graph=True)
        err = info.value
        assert err.rule == (
            "Strict typechecking: backward() ran from a plain (untyped) loss and reached a typed leaf. The seed "
            "gradient 1 on every rank means 1 for an I loss, the mesh size for an R loss and a per-rank list for "
            "a V loss; an untyped loss says none of these."
        )
        assert err.seen == (("leaf", "(3,) typed {dp: I}"), ("loss", "plain tensor (untyped)"))
        assert err.fixes == ("loss = spmd.assert_type(loss, {'dp': ...}) before loss.backward(), with the loss's own types",)
        w.grad = None
        with spmd.typecheck():  # not strict: accepted, the gradient is typed as usual
            loss.backward(retain_graph=True)
            assert spmd.get_type(w.grad) == {"dp": I}
        w.grad = None
        with spmd.typecheck(strict=True):  # a typed loss, by either spelling: accepted
            (w * 2).sum().backward()
            torch.autograd.backward([(w * 3).sum()])
        torch.testing.assert_close(w.grad, torch.full((3,), 5.0))


def _per_rank_data(n: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    with maybe_disable_local_tensor_mode():
        return {r: torch.randn(3, generator=g) for r in range(n)}


@pytest.mark.parametrize("param_type", [R, I])
def test_backward_from_a_v_loss_is_the_gradient_of_the_sum(dp4, param_type):
    data = _per_rank_data(4)
    w0 = torch.tensor([0.5, -1.0, 2.0])
    with spmd.typecheck(strict=True):
        w = spmd.assert_type(per_rank(lambda r: w0.clone()).requires_grad_(), {"dp": param_type})
        x = spmd.assert_type(per_rank(lambda r: data[r].clone()), {"dp": V})
        used = spmd.reinterpret(w, "dp", src=I, dst=R) if param_type is I else w
        loss = ((used * x).sin() * used).sum()  # one loss per rank: V
        assert spmd.get_type(loss) == {"dp": V}
        loss.backward()
        assert spmd.get_type(w.grad) == {"dp": spmd.backward_type(param_type)}
    got = denote(w.grad, dp4, {"dp": spmd.backward_type(param_type)})
    with maybe_disable_local_tensor_mode():  # one device: the gradient of the sum of the per-rank losses
        ref = w0.clone().requires_grad_()
        sum(((ref * data[r]).sin() * ref).sum() for r in range(4)).backward()
        want = ref.grad
    torch.testing.assert_close(got, want)
