"""LTensor: repr, types kept through ordinary tensor plumbing, parameters typed in place, grads."""

import copy
import io
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F

import spmd_types as spmd

ACT = {"dp": spmd.V, "tp": spmd.R}
W = {"dp": spmd.I, "tp": spmd.I}


@pytest.fixture
def typed(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        yield


def test_repr_shows_dtype_shape_and_types(typed):
    x = spmd.assert_type(torch.randn(4, 16), ACT)
    assert repr(x) == "f32[4,16] {dp: V, tp: R}"
    assert repr(x.to(torch.bfloat16)) == "bf16[4,16] {dp: V, tp: R}"
    assert isinstance(x, spmd.LTensor) and isinstance(x, torch.Tensor)


@pytest.mark.parametrize(
    "plumbing",
    [
        lambda x: x.detach(),
        lambda x: x.clone(),
        lambda x: x.to(torch.float64),
        lambda x: x.to("cpu"),
        lambda x: x.t().contiguous(),
        lambda x: x.requires_grad_(),
        lambda x: x.float(),
        lambda x: x.data,
    ],
    ids=["detach", "clone", "to_dtype", "to_device", "contiguous", "requires_grad_", "float", "data"],
)
def test_types_survive_plumbing(typed, plumbing):
    x = spmd.assert_type(torch.randn(4, 4), ACT)
    y = plumbing(x)
    assert spmd.get_type(y) == ACT


def test_types_survive_pickle_and_torch_save(typed):
    x = spmd.assert_type(torch.randn(2, 3), ACT)
    y = pickle.loads(pickle.dumps(x))
    assert type(y) is spmd.LTensor and spmd.get_type(y) == ACT and torch.equal(y, x)
    buf = io.BytesIO()
    torch.save(x, buf)
    buf.seek(0)
    z = torch.load(buf, weights_only=False)
    assert spmd.get_type(z) == ACT


def test_deepcopy_keeps_types(typed):
    x = spmd.assert_type(torch.randn(2, 3), ACT)
    y = copy.deepcopy(x)
    assert spmd.get_type(y) == ACT and torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_parameter_is_typed_in_place(typed):
    lin = torch.nn.Linear(4, 4, bias=False)
    w = lin.weight
    out = spmd.assert_type(w, W)
    assert out is w and lin.weight is w and w.is_leaf
    assert isinstance(w, torch.nn.Parameter) and isinstance(w, spmd.LTensor)
    assert [p is w for p in lin.parameters()] == [True]
    sd = lin.state_dict()
    assert spmd.get_type(sd["weight"]) == W
    lin.load_state_dict({"weight": torch.ones(4, 4)})
    assert torch.equal(lin.weight.detach(), torch.ones(4, 4)) and spmd.get_type(lin.weight) == W


def test_typed_parameter_pickles_and_deepcopies_as_typed_parameter(typed):
    w = spmd.assert_type(torch.nn.Parameter(torch.randn(3)), W)
    for clone in (pickle.loads(pickle.dumps(w)), copy.deepcopy(w)):
        assert isinstance(clone, torch.nn.Parameter) and spmd.get_type(clone) == W
        assert clone.requires_grad and clone.is_leaf


def test_module_typing_types_every_parameter_and_buffer(typed):
    norm = torch.nn.BatchNorm1d(4)
    spmd.assert_type(norm, W)
    assert all(spmd.get_type(p) == W for p in norm.parameters())
    assert all(spmd.get_type(b) == W for b in norm.buffers())


def test_grad_carries_backward_type(typed):
    r = {"dp": spmd.V, "tp": spmd.R}
    w = spmd.assert_type(torch.nn.Parameter(torch.randn(4, 4)), r)
    x = spmd.assert_type(torch.randn(2, 4), {"dp": spmd.V, "tp": spmd.V})
    loss = F.linear(x, w).sum()
    assert spmd.get_type(loss) == {"dp": spmd.V, "tp": spmd.V}
    loss.backward()
    assert spmd.get_type(w.grad) == {"dp": spmd.V, "tp": spmd.P}
    loss2 = F.linear(x, w).sum()
    loss2.backward()  # accumulation keeps the type
    assert spmd.get_type(w.grad) == {"dp": spmd.V, "tp": spmd.P}


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_step_keeps_parameters_typed(typed, foreach):
    lin = torch.nn.Linear(4, 4)
    spmd.assert_type(lin, {"dp": spmd.V, "tp": spmd.V})
    spmd.assert_type(lin.bias, {"dp": spmd.V, "tp": spmd.V})
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, foreach=foreach)
    x = spmd.assert_type(torch.randn(2, 4), {"dp": spmd.V, "tp": spmd.V})
    before = lin.weight.detach().clone()
    lin(x).sum().backward()
    opt.step()
    assert not torch.equal(before, lin.weight.detach())
    assert spmd.get_type(lin.weight) == {"dp": spmd.V, "tp": spmd.V}


def test_leaf_requiring_grad_is_typed_in_place(typed):
    x = torch.randn(3, requires_grad=True)
    y = spmd.assert_type(x, {"tp": spmd.I})
    assert y is x and x.is_leaf
    (x * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert spmd.get_type(x.grad) == {"dp": spmd.V, "tp": spmd.I}


def test_plain_tensor_is_typed_in_place(typed):
    """As the published API does (torchtitan never reads assert_type's result): the object given carries the type."""
    x = torch.randn(3)
    h = torch.randn(3, requires_grad=True) * 2  # a non-leaf activation
    y = spmd.assert_type(x, ACT)
    assert y is x and spmd.get_type(x) == ACT
    spmd.assert_type(h, ACT)  # the result unused, as torchtitan writes it
    assert spmd.get_type(h) == ACT and h.grad_fn is not None


def test_ops_outside_typecheck_return_plain_tensors(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp):
        with spmd.typecheck():
            x = spmd.assert_type(torch.randn(3), ACT)
        y = x * 2
    assert type(y) is torch.Tensor


def test_two_threads_typecheck_different_meshes(mesh_dp_tp):
    groups = {"a": mesh_dp_tp.get_group("dp"), "b": mesh_dp_tp.get_group("tp")}
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(mesh, types, key):
        try:
            with spmd.set_current_mesh(mesh), spmd.typecheck():
                x = spmd.assert_type(torch.randn(2), types)
                barrier.wait(timeout=10)
                results[key] = spmd.get_type(x * 3)
        except Exception as err:  # surfaced by the assertion below
            results[key] = err

    t1 = threading.Thread(target=run, args=(mesh_dp_tp, {"tp": spmd.R}, "one"))
    t2 = threading.Thread(target=run, args=(groups, {"a": spmd.I}, "two"))
    t1.start(), t2.start()
    t1.join(), t2.join()
    assert results == {"one": {"dp": spmd.V, "tp": spmd.R}, "two": {"a": spmd.I, "b": spmd.V}}
    assert not spmd.is_checking()


def test_autograd_grad_on_typed_tensors_inside_typecheck(typed):
    w = spmd.assert_type(torch.randn(3, requires_grad=True), {"tp": spmd.I})
    x = spmd.assert_type(torch.randn(3), {"tp": spmd.V})
    y = (spmd.convert(w, "tp", src=spmd.I, dst=spmd.R) * x).sum()
    (g,) = torch.autograd.grad(y, w, torch.ones(()))
    assert g.shape == (3,)
