"""Optimizer steps, foreach kernels and gradient clipping are checked (issue 11, item 3).

A parameter that is R on an axis has a P gradient there; using it before its
all-reduce (the forgotten data-parallel gradient sync) is rejected with an
error naming the parameter, whichever optimizer implementation runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types import I, P, R, V
from spmd_types.testing import denote, random_value

IMPLS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
OPTIMIZERS = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
# the op that first uses the gradient, per (optimizer, implementation)
FIRST_USE = {
    ("SGD", "for-loop"): "Tensor.add_", ("Adam", "for-loop"): "Tensor.lerp_", ("AdamW", "for-loop"): "Tensor.lerp_",
    ("SGD", "foreach"): "torch._foreach_add_", ("Adam", "foreach"): "torch._foreach_lerp_",
    ("AdamW", "foreach"): "torch._foreach_lerp_",
    ("SGD", "fused"): "torch._fused_sgd_", ("Adam", "fused"): "torch._fused_adam_",
    ("AdamW", "fused"): "torch._fused_adamw_",
}
FIX = "p.grad = spmd.all_reduce(p.grad, 'dp', src=spmd.P, dst=spmd.R)"


@pytest.fixture
def mesh():
    return fake_mesh((2,), ("dp",))


def _model_with_grads(mesh, *, sync: bool):
    """A dp-replicated Linear after backward() from a V loss: gradients are P on 'dp' unless synced."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    spmd.assert_type(lin, {"dp": R})
    x = spmd.assert_type(random_value(mesh, {"dp": V}, (5, 4)) if _simulated() else torch.randn(5, 4), {"dp": V})
    lin(x).square().sum().backward()
    if sync:
        for p in lin.parameters():
            p.grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R)
    return lin, x


def _simulated() -> bool:
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode() is not None


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_on_unsynced_gradient_names_the_parameter(mesh, name, impl):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        lin, _ = _model_with_grads(mesh, sync=False)
        assert spmd.get_type(lin.weight.grad) == {"dp": P}
        opt = OPTIMIZERS[name](lin.parameters(), lr=0.1, **IMPLS[impl])
        with pytest.raises(spmd.SpmdTypeError) as err:
            opt.step()
    op = FIRST_USE[(name, impl)]
    assert err.value.rule == (
        f"The gradient of parameter 'weight' f32[3,4] is a pending sum (P) on 'dp': each rank holds only its "
        f"share, and {op} would use that share as the whole gradient. The gradient sync (an all-reduce) is "
        "missing between backward() and this use."
    )
    assert err.value.seen == (("op", op), ("parameter", "{dp: R}"), ("gradient", "{dp: P}"),
                              ("axis", "'dp': the gradient is P"))
    assert err.value.fixes == (FIX,)
    assert err.value.notes == ("for every parameter p whose gradient is P, after backward() and before the "
                               "optimizer step or gradient clipping",)
    assert "opt.step()" in err.value.source


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_unnamed_parameter_is_shown_by_shape_and_position(mesh, impl):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        w = spmd.assert_type(torch.nn.Parameter(torch.randn(4)), {"dp": R})
        b = spmd.assert_type(torch.nn.Parameter(torch.randn(2, 2)), {"dp": R})
        x = spmd.assert_type(torch.randn(4), {"dp": V})
        ((w * x).sum() + b.sum() * x.sum()).backward()
        w.grad = spmd.all_reduce(w.grad, "dp", src=P, dst=R)  # only w is synced
        with pytest.raises(spmd.SpmdTypeError) as err:
            torch.optim.SGD([w, b], lr=0.1, **IMPLS[impl]).step()
    op = FIRST_USE[("SGD", impl)]
    assert err.value.rule.startswith(
        f"The gradient of parameter f32[2,2] (number 1 in the kernel's parameter list) is a pending sum (P) on "
        f"'dp': each rank holds only its share, and {op} would"
    )


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_synced_step_matches_one_device(mesh, name, impl):
    """After the all-reduce the step is accepted, keeps the types, and equals the one-device step."""
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        lin, x = _model_with_grads(mesh, sync=True)
        opt = OPTIMIZERS[name](lin.parameters(), lr=0.1, **IMPLS[impl])
        opt.step()
        opt.step()  # the second step hits the cache
        assert spmd.get_type(lin.weight) == {"dp": R} and spmd.get_type(lin.bias) == {"dp": R}
        got = denote(lin.weight, mesh, {"dp": R})
        xs = denote(x, mesh, {"dp": V}).reshape(10, 4)
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    ref(xs).square().sum().backward()
    ref_opt = OPTIMIZERS[name](ref.parameters(), lr=0.1, **IMPLS[impl])
    ref_opt.step()
    ref_opt.step()
    torch.testing.assert_close(got, ref.weight.detach())


# ---------------------------------------------------------------------------
# torch._foreach_* element by element


@pytest.fixture
def typed(mesh):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        yield {t: spmd.assert_type(torch.randn(3), {"dp": t}) for t in (R, I, V, P)}


def test_foreach_mul_by_number_is_linear(typed):
    out = torch._foreach_mul([typed[P], typed[V], typed[R]], 2.0)
    assert [spmd.get_type(o) for o in out] == [{"dp": P}, {"dp": V}, {"dp": R}]
    p = typed[P].clone()
    torch._foreach_mul_([p], 0.5)
    assert spmd.get_type(p) == {"dp": P}


def test_foreach_types_each_element_like_its_single_form(typed):
    out = torch._foreach_add([typed[P], typed[V]], [typed[P], typed[R]])
    assert [spmd.get_type(o) for o in out] == [{"dp": P}, {"dp": V}]
    norms = torch._foreach_norm([typed[R], typed[V]])
    assert [spmd.get_type(n) for n in norms] == [{"dp": R}, {"dp": V}]
    plain = torch._foreach_sqrt([torch.ones(2)])
    assert spmd.get_type(plain[0]) is None


def test_foreach_norm_of_partial_is_rejected(typed):
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch._foreach_norm([typed[R], typed[P]])
    assert err.value.rule == "torch._foreach_norm is not linear in input, so input cannot be a pending sum (P)."
    assert err.value.notes == ("element 1 of 2, checked by the row of torch.linalg.vector_norm",)
    assert err.value.fixes == ("spmd.all_reduce(input, 'dp', src=spmd.P, dst=spmd.R)",)


def test_foreach_add_of_partial_and_replicate_is_rejected(typed):
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch._foreach_add([typed[P]], [typed[R]])
    assert err.value.rule == (
        "A pending sum (P) can only be added to another pending sum: torch._foreach_add adds P to R, and the R "
        "value would be added once on every rank."
    )
    assert err.value.notes == ("element 0 of 1, checked by the row of torch.add",)


def test_foreach_in_place_cannot_change_a_type(typed):
    r = typed[R].clone()
    alias = r.view_as(r)  # noqa: F841 - another tensor on r's storage still claims R (else R may become V)
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch._foreach_add_([r], [typed[V]])
    assert err.value.rule == (
        "An in-place op cannot change its tensor's type: torch._foreach_add_ would change its first operand "
        "from R to V on axis 'dp'."
    )


def test_foreach_op_outside_the_table_is_non_linear(typed):
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch._foreach_lgamma([typed[P]])
    assert err.value.notes == ("element 0 of 1, checked by the row of torch.lgamma (not in the table: non-linear)",)


# ---------------------------------------------------------------------------
# fused kernels beyond the gradient check


def test_fused_step_cannot_change_the_parameter_type(mesh):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        w = spmd.assert_type(torch.nn.Parameter(torch.randn(3)), {"dp": R})
        g = spmd.assert_type(torch.randn(3), {"dp": V})  # an R parameter updated by a per-rank value
        with pytest.raises(spmd.SpmdTypeError) as err:
            torch._fused_sgd_([w], [g], [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=True)
    assert err.value.rule == (
        "An in-place op cannot change its tensor's type: torch._fused_sgd_ would change its first operand "
        "from R to V on axis 'dp'."
    )


# ---------------------------------------------------------------------------
# gradient clipping


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm_on_unsynced_gradients_is_rejected(mesh, foreach):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        lin, _ = _model_with_grads(mesh, sync=False)
        with pytest.raises(spmd.SpmdTypeError) as err:
            torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0, foreach=foreach)
    op = "torch._foreach_norm" if foreach else "torch.linalg.vector_norm"
    assert err.value.rule.startswith(
        f"The gradient of parameter 'weight' f32[3,4] is a pending sum (P) on 'dp': each rank holds only its "
        f"share, and {op} would use"
    )
    assert err.value.fixes == (FIX,)


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm_on_synced_gradients(mesh, foreach):
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        lin, x = _model_with_grads(mesh, sync=True)
        want = denote(torch.cat([p.grad.flatten() for p in lin.parameters()]), mesh, {"dp": R}).norm()
        total = torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0, foreach=foreach)
        assert spmd.get_type(total) == {"dp": R}
        assert spmd.get_type(lin.weight.grad) == {"dp": R}
        torch.testing.assert_close(denote(total, mesh, {"dp": R}), want)
        clipped = denote(torch.cat([p.grad.flatten() for p in lin.parameters()]), mesh, {"dp": R}).norm()
    torch.testing.assert_close(clipped, torch.tensor(1.0), atol=1e-4, rtol=1e-4)


def test_fused_step_rejects_a_partial_state(mesh):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        w = spmd.assert_type(torch.nn.Parameter(torch.randn(3)), {"dp": R})
        g = spmd.assert_type(torch.randn(3), {"dp": R})
        exp_avg = spmd.assert_type(torch.zeros(3), {"dp": P})  # a moment that was never synced
        with pytest.raises(spmd.SpmdTypeError) as err:
            torch._fused_adam_([w], [g], [exp_avg], [torch.zeros(3)], [], [torch.tensor(1.0)], lr=0.1, beta1=0.9,
                               beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    assert err.value.rule == "torch._fused_adam_ is not linear in state, so state cannot be a pending sum (P)."
    assert err.value.notes == ("parameter 0 of 1",)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_types_are_checked_once_not_every_step(mesh, monkeypatch, impl):
    """The kernels' element types are one cache key: a second step runs no rule inference."""
    from spmd_types._checker import foreach as _foreach

    calls = []
    real = _foreach.infer
    monkeypatch.setattr(_foreach, "infer", lambda *a, **k: calls.append(1) or real(*a, **k))
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        lin, _ = _model_with_grads(mesh, sync=True)
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1, **IMPLS[impl])
        opt.step()
        first = len(calls)
        opt.step()
    assert first > 0 and len(calls) == first


@pytest.mark.parametrize("impl", list(IMPLS))
def test_maximizing_step_names_the_parameter_too(mesh, impl):
    """With maximize=True the first op sees -grad, not the gradient itself: the step still names it."""
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        lin, _ = _model_with_grads(mesh, sync=False)
        opt = torch.optim.Adam(lin.parameters(), lr=0.1, maximize=True, **IMPLS[impl])
        with pytest.raises(spmd.SpmdTypeError) as err:
            opt.step()
    assert err.value.rule.startswith("The gradient of parameter 'weight' f32[3,4] is a pending sum (P) on 'dp'")
    assert err.value.fixes == (FIX,)
