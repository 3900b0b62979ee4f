"""Module hooks, torch.vmap and torch.compile meeting typed tensors (issue 11, item 4; issue 23).

Hooks are ordinary code: what they do to typed tensors is checked. vmap cannot
carry types, so it refuses typed tensors with one clear error whose fix
(``spmd.no_typecheck`` around vmap) is tested too. torch.compile checks the
graphs it compiles (tests/test_compile_typed.py has the rest).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types import I, P, R, S, V
from spmd_types.testing import denote, random_value


@pytest.fixture
def mesh():
    m = fake_mesh((2,), ("tp",))
    with spmd.set_current_mesh(m):
        yield m


def _linear(types):
    lin = torch.nn.Linear(4, 4, bias=False)
    spmd.assert_type(lin, types)
    return lin


# ---------------------------------------------------------------------------
# module hooks


def test_forward_hook_is_checked(mesh):
    with spmd.typecheck():
        lin = _linear({"tp": R})
        bias = spmd.assert_type(torch.ones(4), {"tp": R})
        lin.register_forward_hook(lambda mod, args, out: out + bias)  # out is P: the bias would be added twice
        x = spmd.assert_type(torch.randn(2, 4), {"tp": P})
        with pytest.raises(spmd.SpmdTypeError) as err:
            lin(x)
    assert err.value.rule.startswith("A pending sum (P) can only be added to another pending sum: Tensor.__add__ (+)")


def test_forward_pre_hook_is_checked(mesh):
    with spmd.typecheck():
        lin = _linear({"tp": R})
        lin.register_forward_pre_hook(lambda mod, args: (args[0].exp(),))
        with pytest.raises(spmd.SpmdTypeError) as err:
            lin(spmd.assert_type(torch.randn(2, 4), {"tp": P}))
    assert err.value.rule == "Tensor.exp is not linear in input, so input cannot be a pending sum (P)."


def test_well_typed_hooks_type_their_results(mesh):
    seen = {}
    with spmd.typecheck():
        lin = _linear({"tp": R})
        lin.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
        lin.register_forward_hook(lambda mod, args, out: torch.relu(out))
        lin.register_full_backward_hook(lambda mod, gin, gout: seen.update(gout=gout[0]))
        lin.weight.register_hook(lambda g: seen.update(weight_grad=spmd.get_type(g)))  # gets the typed gradient
        x = spmd.assert_type(torch.randn(2, 4, requires_grad=True), {"tp": V})
        out = lin(x)
        assert spmd.get_type(out) == {"tp": V}
        out.sum().backward()
    assert spmd.get_type(lin.weight.grad) == {"tp": P}
    assert seen["gout"].shape == (2, 4)
    assert seen["weight_grad"] == {"tp": P}


def test_backward_hook_that_misuses_a_gradient_is_checked(mesh):
    with spmd.typecheck():
        lin = _linear({"tp": R})
        bad = spmd.assert_type(torch.ones(4), {"tp": R})
        lin.weight.register_hook(lambda g: g + bad)  # the weight's gradient is P
        x = spmd.assert_type(torch.randn(2, 4), {"tp": V})
        loss = lin(x).sum()
        with pytest.raises(spmd.SpmdTypeError) as err:
            loss.backward()
    assert err.value.rule.startswith("A pending sum (P) can only be added to another pending sum: Tensor.__add__ (+)")


# ---------------------------------------------------------------------------
# torch.vmap

VMAP_RULE = (
    "torch.vmap and the other torch.func transforms cannot carry SPMD types: they hand their function plain "
    "wrapped tensors and return plain tensors, so the types would be silently dropped."
)


def test_vmap_over_a_typed_tensor_is_refused(mesh):
    with spmd.typecheck():
        x = spmd.assert_type(torch.randn(3, 4), {"tp": V})
        with pytest.raises(spmd.SpmdTypeError) as err:
            torch.vmap(lambda a: a * 2)(x)
    assert err.value.rule == VMAP_RULE
    assert err.value.seen == (("operand", "f32[3,4] {tp: V}"),)
    assert err.value.fixes == ("spmd.no_typecheck(torch.vmap(f), in_types=[...], out_types=...)(x)",)
    assert err.value.notes == ("the batch dim is local: declare the types f gives one slice, for the whole batch",)


def test_vmap_closing_over_a_typed_tensor_is_refused(mesh):
    with spmd.typecheck():
        w = spmd.assert_type(torch.randn(4), {"tp": R})
        with pytest.raises(spmd.SpmdTypeError) as err:
            torch.vmap(lambda a: a * w)(torch.randn(3, 4))
    assert err.value.rule == VMAP_RULE
    assert err.value.seen == (("operand", "f32[4] {tp: R}"),)


def test_vmap_inside_no_typecheck_gives_typed_results(mesh):
    """The fix the error names: the batch dim is local, so f's per-slice types are the batch's."""
    with LocalTensorMode(2), spmd.typecheck():
        x = spmd.assert_type(random_value(mesh, {"tp": V}, (3, 4)), {"tp": V})
        w = spmd.assert_type(random_value(mesh, {"tp": R}, (4,), seed=1), {"tp": R})
        f = spmd.no_typecheck(torch.vmap(lambda a, b: a * b, in_dims=(0, None)),
                              in_types=[{"tp": V}, {"tp": R}], out_types={"tp": V})
        out = f(x, w)
        assert spmd.get_type(out) == {"tp": V}
        got = denote(out, mesh, {"tp": V})
        want = denote(x, mesh, {"tp": V}) * denote(w, mesh, {"tp": R})
    torch.testing.assert_close(got, want)


def test_vmap_on_plain_tensors_inside_typecheck_is_untouched(mesh):
    with spmd.typecheck():
        out = torch.vmap(lambda a: a * 2)(torch.ones(3, 4))
    assert spmd.get_type(out) is None and torch.equal(out, torch.full((3, 4), 2.0))


# ---------------------------------------------------------------------------
# torch.compile

def _compile(fn, backend, fullgraph=True):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=fullgraph)


IV_RULE = (
    "Invariant (I) values only combine with other I values: Tensor.__add__ (+) combines other (I) with input (V). "
    "Convert the I operand to R, so that its gradient is all-reduced in backward."
)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_of_typed_inputs(mesh, backend, fullgraph):
    """Issue 23: typed inputs compile, checked when the graph compiles; an ill-typed program never runs."""
    with spmd.typecheck():
        x = spmd.assert_type(torch.randn(3, 4), {"tp": V})
        i = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
        out = _compile(lambda a, b: a * b, backend, fullgraph)(x, x)  # well typed
        assert spmd.get_type(out) == {"tp": V}
        torch.testing.assert_close(out, (x * x).detach())
        with pytest.raises(spmd.SpmdTypeError) as err:
            _compile(lambda a, b: a + b, backend, fullgraph)(x, i)  # an I + V bug: never run unchecked
        assert err.value.rule == IV_RULE


def _tp_mlp(x, w1, w2):
    h = F.gelu(F.linear(spmd.convert(x, "tp", src=I, dst=R), w1))
    return spmd.all_reduce(F.linear(h, w2), "tp", src=V, dst=I)


def _sp_mlp(x, w1, w2):
    """Sequence parallel: gather the sequence in, reduce-scatter it out (the typed collectives' Functions)."""
    h = F.gelu(F.linear(spmd.all_gather(x, "tp", src=S(0), dst=R), w1))
    return spmd.reduce_scatter(F.linear(h, w2), "tp", src=V, dst=S(0))


_MLPS = {"tp": (_tp_mlp, I, (4, 4)), "sp": (_sp_mlp, S(0), (2, 4))}


def _run_mlp(m, name, fn):
    """Run ``fn`` (the MLP or its compiled form) on 2 simulated ranks: output and gradients, denoted."""
    program, x_type, x_shape = _MLPS[name]
    with LocalTensorMode(2), spmd.typecheck():
        x = spmd.assert_type(random_value(m, {"tp": x_type}, x_shape).requires_grad_(), {"tp": x_type})
        w1 = spmd.assert_type(torch.nn.Parameter(random_value(m, {"tp": V}, (8, 4), seed=1)), {"tp": V})
        w2 = spmd.assert_type(torch.nn.Parameter(random_value(m, {"tp": V}, (4, 8), seed=2)), {"tp": V})
        out = fn(x, w1, w2)
        out_type = spmd.get_type(out)
        out.sum().backward()
        return out_type, [denote(t, m, {"tp": ty}) for t, ty in
                          ((out, out_type["tp"]), (x.grad, x_type), (w1.grad, V), (w2.grad, V))]


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", ["tp", "sp"])
def test_compile_of_a_typed_mlp(mesh, name, backend, fullgraph):
    """Compiled on simulated ranks, the step's values and gradients are eager's (issue 23; issue 14 item 1: the
    package's own Functions never trip the unregistered-Function guard while dynamo converts frames)."""
    program = _MLPS[name][0]
    want_type, want = _run_mlp(mesh, name, program)
    got_type, got = _run_mlp(mesh, name, _compile(program, backend, fullgraph))
    assert got_type == want_type
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_erased_program_compiles_whole_after_a_typed_call(mesh):
    """The eager fallback of a typed call is not remembered past typecheck(): the erased program compiles."""

    def program(x, w):
        h = F.linear(x, w)
        torch._dynamo.graph_break()
        return torch.relu(h) * 2

    fn = _compile(program, "eager", fullgraph=False)
    with spmd.typecheck():
        out = fn(spmd.assert_type(torch.randn(3, 4), {"tp": R}), spmd.assert_type(torch.randn(8, 4), {"tp": V}))
        assert spmd.get_type(out) == {"tp": V}
    torch._dynamo.utils.counters.clear()
    fn(torch.randn(3, 4), torch.randn(8, 4))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # both sides of the graph break


@pytest.mark.parametrize("fullgraph", [True, False])
def test_typing_inside_the_compiled_function(mesh, fullgraph):
    """assert_type inside a compiled function types its tensor, as in eager (checked when it compiles)."""
    with spmd.typecheck():
        fn = _compile(lambda a: spmd.assert_type(a, {"tp": V}) * 2, "eager", fullgraph)
        out = fn(torch.randn(3))
    assert spmd.get_type(out) == {"tp": V}


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compile_of_a_module_with_typed_parameters_outside_typecheck(mesh, fullgraph):
    """Outside typecheck() nothing is checked (choice 4): the module compiles and gives a plain result."""
    with spmd.typecheck():
        lin = _linear({"tp": R})
    x = torch.randn(2, 4)
    out = _compile(lin, "aot_eager", fullgraph)(x)
    assert spmd.get_type(out) is None
    torch.testing.assert_close(out, x @ lin.weight.detach().T)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_erased_program_compiles_and_matches_the_checked_run(mesh, backend, fullgraph):
    """The fix: check eagerly, compile the same code on plain tensors."""

    def program(x, w):
        h = spmd.reinterpret(x, "tp", src=I, dst=R) @ w
        return spmd.all_reduce(torch.relu(h), "tp", src=V, dst=I)

    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    with spmd.typecheck():  # assert_type types in place: the checked run types copies, the compiled one the originals
        checked = program(spmd.assert_type(x.clone(), {"tp": I}), spmd.assert_type(w.clone(), {"tp": V}))
        assert spmd.get_type(checked) == {"tp": I}
    compiled = _compile(program, backend, fullgraph)(x, w)
    assert spmd.get_type(compiled) is None
    torch.testing.assert_close(compiled, checked.detach())
