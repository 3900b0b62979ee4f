"""typecheck(), assert_type, get_type, module boundaries, and erasure."""

import pytest
import torch
import torch.nn.functional as F

import spmd_types as spmd

ACT = {"dp": spmd.V, "tp": spmd.R}


def test_assert_type_outside_typecheck_returns_input_untouched(mesh_dp_tp):
    x = torch.randn(3)
    assert spmd.assert_type(x, ACT) is x
    assert spmd.assert_type(x, "not even a type spec") is x  # erased: nothing is looked at
    lin = torch.nn.Linear(2, 2)
    spmd.assert_type(lin, ACT)
    assert type(lin.weight) is torch.nn.Parameter


def test_omitted_axes_default_to_varying(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        x = spmd.assert_type(torch.randn(3), {"tp": spmd.I})
        assert spmd.get_type(x) == {"dp": spmd.V, "tp": spmd.I}


def test_axes_may_be_given_as_groups_or_meshes(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        x = spmd.assert_type(torch.randn(3), {mesh_dp_tp.get_group("tp"): spmd.P, mesh_dp_tp["dp"]: spmd.R})
        assert spmd.get_type(x) == {"dp": spmd.R, "tp": spmd.P}


def test_assert_on_typed_tensor_checks(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        x = spmd.assert_type(torch.randn(4), {"tp": spmd.S(0)})
        assert spmd.assert_type(x, {"tp": spmd.V}) is x  # S(d) refines V
        assert spmd.assert_type(x, {"tp": spmd.S(0)}) is x
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.assert_type(x, {"tp": spmd.R})
    assert info.value.plain.splitlines()[0] == (
        "Type assertion failed: the tensor is S(0) on axis 'tp', and the assertion says R."
    )
    assert info.value.fixes == ("spmd.all_gather(x, 'tp', src=spmd.S(0), dst=spmd.R)",)


def test_assert_failure_message_is_pinned(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        x = spmd.assert_type(torch.randn(4), {"dp": spmd.V, "tp": spmd.P})
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.assert_type(x, {"tp": spmd.R})
    assert str(info.value) == (
        "Type assertion failed: the tensor is P on axis 'tp', and the assertion says R.\n"
        "  have: {dp: V, tp: P}\n"
        "  want: {dp: V, tp: R}\n"
        "  axis: 'tp': P is not R\n"
        "  at:   tests/test_asserts.py:50: spmd.assert_type(x, {\"tp\": spmd.R})\n"
        "  fix:  spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)"
    )


def test_bad_type_specs_are_clear_errors(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        with pytest.raises(TypeError, match=r"the type for axis 'tp' must be an SPMD type .* got 'R' of type str"):
            spmd.assert_type(torch.randn(2), {"tp": "R"})
        with pytest.raises(ValueError, match="unknown mesh axis 'pp'"):
            spmd.assert_type(torch.randn(2), {"pp": spmd.R})
        with pytest.raises(TypeError, match="takes types as a dict"):
            spmd.assert_type(torch.randn(2), "R")
        with pytest.raises(TypeError, match="takes a tensor .or a list or tuple of tensors. or an nn.Module"):
            spmd.assert_type([1, 2], ACT)
    with spmd.typecheck():
        with pytest.raises(RuntimeError, match="needs a current mesh"):
            spmd.assert_type(torch.randn(2), ACT)


def test_get_type_of_untyped_is_none():
    assert spmd.get_type(torch.randn(2)) is None and spmd.get_type(3) is None


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    @spmd.typed_boundary(in_types=[{"tp": spmd.R}], out_types={"tp": spmd.R})
    def forward(self, x):
        return F.linear(x, self.w)


def test_typed_boundary_asserts_inputs_and_outputs(mesh_dp_tp):
    block = Block()
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        spmd.assert_type(block, {"tp": spmd.R})
        out = block(torch.randn(2, 4))  # a plain input is typed at the boundary
        assert spmd.get_type(out) == {"dp": spmd.V, "tp": spmd.R}
        v = spmd.assert_type(torch.randn(2, 4), {"tp": spmd.V})
        with pytest.raises(spmd.SpmdTypeError, match="the tensor is V on axis 'tp', and the assertion says R"):
            block(v)
    assert type(block(torch.randn(2, 4))) is torch.Tensor  # erased outside typecheck


def test_attach_boundary_checks_module_outputs(mesh_dp_tp):
    lin = torch.nn.Linear(4, 4, bias=False)
    spmd.attach_boundary(lin, in_types=[{"tp": spmd.R}], out_types={"tp": spmd.P})
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        spmd.assert_type(lin, {"tp": spmd.R})
        with pytest.raises(spmd.SpmdTypeError, match="the tensor is R on axis 'tp', and the assertion says P"):
            lin(torch.randn(2, 4))


def _tp_mlp_loss(model, x):
    """A tensor-parallel-style MLP written once, with spmd calls that erase outside typecheck."""
    spmd.assert_type(model, {"tp": spmd.I})
    h = spmd.assert_type(x, {"tp": spmd.R})
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            w = spmd.convert(layer.weight, "tp", src=spmd.I, dst=spmd.R)
            b = spmd.convert(layer.bias, "tp", src=spmd.I, dst=spmd.R)
            h = F.linear(h, w, b)
        else:
            h = layer(h)
    loss = (h.float() ** 2).mean()
    return spmd.convert(loss, "tp", src=spmd.R, dst=spmd.I)


def test_erasure_gives_bit_identical_loss_and_grads(mesh_dp_tp):
    if not hasattr(spmd, "convert"):
        pytest.skip("needs spmd.convert (typed communication)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    with spmd.set_current_mesh(mesh_dp_tp):
        erased = _tp_mlp_loss(model, x)
        erased.backward()
        assert type(erased) is torch.Tensor and type(model[0].weight) is torch.nn.Parameter
        erased_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        with spmd.typecheck():
            typed = _tp_mlp_loss(model, x)
            assert spmd.get_type(typed) == {"dp": spmd.V, "tp": spmd.I}
        typed.backward()
    assert torch.equal(erased, typed.detach().as_subclass(torch.Tensor))
    for g, p in zip(erased_grads, model.parameters()):
        assert torch.equal(g, p.grad)
