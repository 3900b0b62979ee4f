"""Typed code under torch.compile (issue 23): checked once per graph when it compiles, run at erased speed.

A tensor-parallel MLP on a fake process group (rank 0's program): compiled inside ``spmd.typecheck()``
at both fullgraph settings it compiles and runs with typed outputs and gradients; an ill-typed one raises
the eager checker's own error, at the user's line, when it compiles; and the graphs the backend compiles
are the erased program's, node for node.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import fake_mesh
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import spmd_types as spmd
from spmd_types import I, P, R, S, V

HERE = pathlib.Path(__file__)


def _at(code: str) -> str:
    """``tests/test_compile_typed.py:N: code`` for the one line of this file that is ``code``."""
    lines = [i for i, text in enumerate(HERE.read_text().splitlines(), 1) if text.strip() == code]
    assert len(lines) == 1, code
    return f"tests/{HERE.name}:{lines[0]}: {code}"


@pytest.fixture
def mesh():
    m = fake_mesh((2,), ("tp",))
    with spmd.set_current_mesh(m):
        yield m


def _compile(fn, backend="aot_eager", fullgraph=True):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=fullgraph)


def tp_mlp(x, w1, w2):
    h = F.gelu(F.linear(spmd.convert(x, "tp", src=I, dst=R), w1))
    return spmd.all_reduce(F.linear(h, w2), "tp", src=V, dst=I)


def tp_mlp_missing_convert(x, w1, w2):
    h = F.gelu(F.linear(x, w1))
    return spmd.all_reduce(F.linear(h, w2), "tp", src=V, dst=I)


def _inputs():
    torch.manual_seed(0)
    x = spmd.assert_type(torch.randn(4, 4, requires_grad=True), {"tp": I})
    w1 = spmd.assert_type(torch.nn.Parameter(torch.randn(8, 4)), {"tp": V})
    w2 = spmd.assert_type(torch.nn.Parameter(torch.randn(4, 8)), {"tp": V})
    return x, w1, w2


def _step(fn):
    """Forward and backward of ``fn`` on fresh typed inputs: output, its type, and the gradients' types."""
    with spmd.typecheck():
        x, w1, w2 = _inputs()
        out = fn(x, w1, w2)
        out.sum().backward()
        return out.detach(), spmd.get_type(out), [spmd.get_type(t.grad) for t in (x, w1, w2)], \
            [t.grad.detach() for t in (x, w1, w2)]


@pytest.mark.parametrize("fullgraph", [True, False])
def test_typed_mlp_compiles_and_runs_typed(mesh, fullgraph):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    out, out_type, grad_types, grads = _step(_compile(tp_mlp, counter, fullgraph))
    assert counter.frame_count == 1  # one graph: no graph break on the spmd calls
    assert out_type == {"tp": I}
    assert grad_types == [{"tp": I}, {"tp": V}, {"tp": V}]  # by duality, as eager gives them
    want, want_type, want_grad_types, want_grads = _step(tp_mlp)
    assert (out_type, grad_types) == (want_type, want_grad_types)
    torch.testing.assert_close(out, want)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp)


MISSING_CONVERT = f"""\
Invariant (I) values only combine with other I values: F.linear combines input (I) with weight (V). \
Convert the I operand to R, so that its gradient is all-reduced in backward.
  op:       F.linear
  operands: input (x): {{tp: I}}
            weight (w1): {{tp: V}}
  axis:     'tp': input is I and weight is V
  at:       {_at("h = F.gelu(F.linear(x, w1))")}
  fix:      spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)"""


@pytest.mark.parametrize("fullgraph", [True, False])
def test_ill_typed_mlp_is_refused_when_it_compiles(mesh, fullgraph):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with spmd.typecheck():
        x, w1, w2 = _inputs()
        with pytest.raises(spmd.SpmdTypeError) as compiled:
            _compile(tp_mlp_missing_convert, counter, fullgraph)(x, w1, w2)
        with pytest.raises(spmd.SpmdTypeError) as eager:
            tp_mlp_missing_convert(x, w1, w2)
    assert compiled.value.plain == MISSING_CONVERT
    assert str(compiled.value) == str(eager.value)  # the eager checker's own message
    assert counter.frame_count == 0  # refused before the backend compiled anything


def _capturing_backend(graphs: list):
    def keep(gm, _):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def test_compiled_graphs_are_the_erased_programs(mesh):
    """No type bookkeeping reaches the compiled code: forward and backward graphs equal the erased ones."""
    typed: list = []
    _step(_compile(tp_mlp, _capturing_backend(typed)))
    erased: list = []
    x, w1, w2 = (t.detach().clone().requires_grad_() for t in _inputs())
    _compile(tp_mlp, _capturing_backend(erased))(x, w1, w2).sum().backward()
    assert len(typed) == 2 and typed == erased
    assert "all_reduce" in typed[0] and "all_reduce" in typed[1]  # forward P -> I, backward I -> R's dual


# ---------------------------------------------------------------------------
# torch.compile(module): typed parameters, gradients typed by duality, the optimizer's check


class DataParallelMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).square().sum()


def _dp_model():
    torch.manual_seed(0)
    model = DataParallelMLP()
    spmd.assert_type(model, {"dp": R})
    return model


@pytest.fixture
def dp_mesh():
    m = fake_mesh((2,), ("dp",))
    with spmd.set_current_mesh(m):
        yield m


@pytest.mark.parametrize("how", ["torch.compile(module)", "module.compile()"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_module_gradients_are_typed_and_the_optimizer_checks_them(dp_mesh, how, fullgraph):
    with spmd.typecheck():
        model = _dp_model()
        torch._dynamo.reset()
        if how == "module.compile()":
            model.compile(backend="aot_eager", fullgraph=fullgraph)
            step = model
        else:
            step = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
        loss = step(spmd.assert_type(torch.randn(3, 4), {"dp": V}))
        assert spmd.get_type(loss) == {"dp": V}
        spmd.all_reduce(loss, "dp", src=V, dst=I).backward()
        assert {n: spmd.get_type(p.grad) for n, p in model.named_parameters()} == {
            "up.weight": {"dp": P}, "up.bias": {"dp": P}, "down.weight": {"dp": P}, "down.bias": {"dp": P}}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(spmd.SpmdTypeError) as err:
            opt.step()  # the gradient sync is missing: as in eager, named by parameter
    assert err.value.rule.startswith("The gradient of parameter 'up.weight' f32[8,4] is a pending sum (P) on 'dp'")


def test_a_compiled_graph_is_checked_again_for_new_types(mesh):
    """Dynamo does not recompile for new types (it guards on the tensor class): the graph is checked again."""
    fn = _compile(lambda a, b: a + b)
    with spmd.typecheck():
        v = spmd.assert_type(torch.randn(3), {"tp": V})
        assert spmd.get_type(fn(v, v)) == {"tp": V}
        p = spmd.assert_type(torch.randn(3), {"tp": P})
        assert spmd.get_type(fn(p, p)) == {"tp": P}
        r = spmd.assert_type(torch.randn(3), {"tp": R})
        with pytest.raises(spmd.SpmdTypeError) as err:
            fn(p, r)  # P + R: the R would be added once per rank
    assert err.value.rule.startswith("A pending sum (P) can only be added to another pending sum: Tensor.__add__ (+)")
    assert err.value.source == _at("fn = _compile(lambda a, b: a + b)")


def with_a_graph_break(x, w):
    h = x @ w
    torch._dynamo.graph_break()
    return spmd.all_reduce(h, "tp", src=P, dst=R)


def with_a_graph_break_bug(x, w):
    h = x @ w
    torch._dynamo.graph_break()
    return spmd.all_reduce(h, "tp", src=V, dst=R)


def test_graph_breaks_hand_typed_values_on(mesh):
    """fullgraph=False: each graph is checked; the values between graphs are typed, so eager code checks too."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = _compile(with_a_graph_break, counter, fullgraph=False)
    with spmd.typecheck():
        x = spmd.assert_type(torch.randn(3, 4), {"tp": R})
        w = spmd.assert_type(torch.randn(4, 4), {"tp": P})
        out = fn(x, w)
        assert counter.frame_count == 2 and spmd.get_type(out) == {"tp": R}
        with pytest.raises(spmd.SpmdTypeError) as err:
            _compile(with_a_graph_break_bug, fullgraph=False)(x, w)
    assert err.value.rule.startswith("spmd.all_reduce's src= must be the input's type on the axis: src=V, but the "
                                     "tensor is P on axis 'tp'.")
    assert err.value.source == _at('return spmd.all_reduce(h, "tp", src=V, dst=R)')


# ---------------------------------------------------------------------------
# global SPMD


def colwise(x, w):
    h = torch.relu(x @ w)
    return spmd.all_gather(h, "tp", src=S(1), dst=R)


def rowwise(h, w):
    return spmd.all_reduce(spmd.linear(h, w, out_partial_axes="tp"), "tp", src=P, dst=R)


def unclaimed_sum(x, w):
    return (x @ w).sum(1) + 1.0


UNCLAIMED = f"""\
Global SPMD: input sums over a sharded dim (a contraction or a reduction): it is a pending sum (P) on 'tp', used \
by Tensor.__add__ (+) before anything claimed it. Claim it (an assert, a declared output type) or ask for it with \
out_partial_axes.
  op:      Tensor.__add__ (+)
  operand: input: {{dp: R, tp: P}} (P on 'tp' not yet claimed)
  at:      {_at("return (x @ w).sum(1) + 1.0")}
  fix:     spmd.assert_type((x @ w).sum(1), {{'tp': spmd.P}}) right after it
  or:      spmd.sum / spmd.linear / spmd.matmul / spmd.einsum(..., out_partial_axes='tp')"""


@pytest.mark.parametrize("fullgraph", [True, False])
def test_global_spmd_compiles_with_partition_specs(mesh_dp_tp, fullgraph):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=False):
        x = spmd.assert_type(torch.randn(3, 8), {})
        w = spmd.assert_type(torch.randn(8, 4), {"tp": S(1)})
        h = spmd.assert_type(torch.randn(3, 2), {"tp": S(1)})
        w2 = spmd.assert_type(torch.randn(5, 2), {"tp": S(1)})
        out = _compile(colwise, fullgraph=fullgraph)(x, w)
        assert repr(out) == "f32[3,16] {dp: R, tp: R}"
        assert spmd.get_partition_spec(out) == spmd.PartitionSpec(None, None)
        y = _compile(rowwise, fullgraph=fullgraph)(h, w2)
        assert repr(y) == "f32[3,5] {dp: R, tp: R}"
        with pytest.raises(spmd.SpmdTypeError) as compiled:
            _compile(unclaimed_sum, fullgraph=fullgraph)(x, w)
        with pytest.raises(spmd.SpmdTypeError) as eager:
            unclaimed_sum(x, w)
    assert compiled.value.plain == UNCLAIMED == eager.value.plain


# ---------------------------------------------------------------------------
# types read inside a compiled function


def kernel_typed_like_its_input(q, k):
    with spmd.no_typecheck():
        out = (q * k).exp()  # a kernel the checker does not see into
    spmd.assert_type(out, spmd.get_local_type(q), spmd.get_partition_spec(q))
    return out


def branching_on_a_type(x):
    if spmd.get_local_type(x)["tp"] is P:
        x = spmd.all_reduce(x, "tp", src=P, dst=R)
    return x


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_type_read_in_a_trace_types_a_kernels_output(mesh, fullgraph):
    with spmd.typecheck():
        q = spmd.assert_type(torch.randn(4, 3), {"tp": V})
        out = _compile(kernel_typed_like_its_input, fullgraph=fullgraph)(q, q)
        assert spmd.get_type(out) == {"tp": V}
        r = spmd.assert_type(torch.randn(4, 3), {"tp": R})
        assert spmd.get_type(_compile(kernel_typed_like_its_input, fullgraph=fullgraph)(r, r)) == {"tp": R}


def test_branching_on_a_type_in_a_trace_is_refused(mesh):
    with spmd.typecheck():
        p = spmd.assert_type(torch.randn(4, 3), {"tp": P})
        with pytest.raises(torch._dynamo.exc.Unsupported) as err:  # dynamo's wrapper around the error raised
            _compile(branching_on_a_type)(p)
    assert ("spmd.get_local_type(x)[...]: a type read inside torch.compile is known only when the graph is checked, "
            "after dynamo traced it: hand it to an spmd call (spmd.assert_type(y, spmd.get_local_type(x))), or read "
            "it outside the compiled function") in str(err.value)


def test_the_compile_pages_example_prints_the_real_message(tmp_path, monkeypatch):
    """docs/compile.md's first example, saved as model.py and run, prints what the page shows."""
    import contextlib
    import io
    import linecache
    import re
    import runpy

    page = (HERE.parents[1] / "docs" / "compile.md").read_text()
    (lang, code), (lang2, output) = re.findall(r"^```(\w*)\n(.*?)^```", page, flags=re.S | re.M)[:2]
    assert (lang, lang2) == ("python", "text")
    monkeypatch.setenv("SPMD_TYPES_ERRORS", "plain")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(code)
    linecache.clearcache()
    torch._dynamo.reset()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path("model.py", run_name="__main__")
    assert printed.getvalue() == output


@pytest.mark.parametrize("how", ["default", "spmd.compile_backend"])
def test_inductor_compiles_the_checked_graph(mesh, how):
    """torch.compile's default backend (inductor's CPU code) on the checked graph; the explicit backend alike."""
    backend = spmd.compile_backend("inductor") if how == "spmd.compile_backend" else "inductor"
    out, out_type, grad_types, grads = _step(_compile(tp_mlp, backend))
    want, want_type, want_grad_types, want_grads = _step(tp_mlp)
    assert (out_type, grad_types) == (want_type, want_grad_types) == ({"tp": I}, [{"tp": I}, {"tp": V}, {"tp": V}])
    torch.testing.assert_close(out, want)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp)
    with spmd.typecheck():
        with pytest.raises(spmd.SpmdTypeError) as err:
            _compile(tp_mlp_missing_convert, backend)(*_inputs())
    assert err.value.plain == MISSING_CONVERT


def test_a_recompile_for_new_shapes_is_checked_too(mesh):
    """Dynamo recompiles a graph with dynamic sizes for a second shape; that graph is checked as it compiles."""
    from spmd_types._compile.backend import CHECKS

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = _compile(lambda a, b: (a * b).relu(), counter)
    with spmd.typecheck():
        before = len(CHECKS)
        for rows in (4, 6, 8):
            a = spmd.assert_type(torch.randn(rows, 3), {"tp": V})
            b = spmd.assert_type(torch.randn(rows, 3), {"tp": R})
            assert spmd.get_type(fn(a, b)) == {"tp": V}
        assert counter.frame_count == 2 and len(CHECKS) - before == 2  # static, then one dynamic graph
        p = spmd.assert_type(torch.randn(10, 3), {"tp": P})
        with pytest.raises(spmd.SpmdTypeError) as err:
            fn(p, p)
    assert err.value.rule == ("Partial * Partial: Tensor.__mul__ (*) is linear in each factor separately, not in both, "
                              "so at most one factor may be a pending sum (P).")


@spmd.local_map(in_types=[{"tp": S(1)}, {"tp": S(1)}], out_types={"tp": P})
def row_parallel(h, w):
    return spmd.reinterpret(F.linear(h, w), "tp", src=V, dst=P)


def global_with_regions(h, w):
    with spmd.local():
        h = h * 2
    return spmd.all_reduce(row_parallel(h, w), "tp", src=P, dst=R)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_global_spmd_regions_compile(mesh_dp_tp, fullgraph):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=False):
        h = spmd.assert_type(torch.randn(4, 8), {"tp": S(1)})
        w = spmd.assert_type(torch.randn(6, 8), {"tp": S(1)})
        want = global_with_regions(h, w)
        got = _compile(global_with_regions, fullgraph=fullgraph)(h, w)
        assert repr(got) == repr(want) == "f32[4,6] {dp: R, tp: R}"
        with pytest.raises(spmd.SpmdTypeError) as err:
            _compile(global_with_regions, fullgraph=fullgraph)(spmd.assert_type(torch.randn(4, 8), {}), w)
    assert err.value.rule == "Type assertion failed: the tensor is R on axis 'tp', and the assertion says S(1)."
