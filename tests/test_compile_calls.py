"""Every spmd call traces into one torch.compile graph, typed or erased (issue 23, item 3).

Each program below is compiled with ``fullgraph=True`` (a graph break would raise) inside ``typecheck()``
on typed inputs and outside it on plain ones; it must give eager's values, and typed, eager's types.
Collectives reach the compiled graph as functional collectives (forward and backward).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import fake_mesh

import spmd_types as spmd
from spmd_types import P, R, S, V


@spmd.local_map(in_types=[{"tp": V}], out_types={"tp": P})
def _partial_sums(h):
    return spmd.reinterpret(h * 2, "tp", src=V, dst=P)


PROGRAMS = {
    "reinterpret": ({"tp": V}, (4, 3), lambda x, m: spmd.reinterpret(x, "tp", src=V, dst=P)),
    "convert": ({"tp": R}, (4, 3), lambda x, m: spmd.convert(x, "tp", src=R, dst=S(0))),
    "all_reduce": ({"tp": P}, (4, 3), lambda x, m: spmd.all_reduce(x, "tp", src=P, dst=R)),
    "all_gather": ({"tp": S(0)}, (4, 3), lambda x, m: spmd.all_gather(x, "tp", src=S(0), dst=R)),
    "reduce_scatter": ({"tp": P}, (4, 3), lambda x, m: spmd.reduce_scatter(x, "tp", src=P, dst=S(0))),
    "all_to_all": ({"tp": S(0)}, (4, 4), lambda x, m: spmd.all_to_all(x, "tp", src=S(0), dst=S(1))),
    "redistribute": ({"tp": S(0)}, (4, 3), lambda x, m: spmd.redistribute(x, "tp", src=S(0), dst=R)),
    "redistribute specs": ({"dp": R, "tp": S(0)}, (4, 3),
                           lambda x, m: spmd.redistribute(x, spmd.PartitionSpec("tp"), spmd.PartitionSpec(None))),
    "local_map": ({"tp": V}, (4, 3), lambda x, m: _partial_sums(x)),
    "reinterpret_mesh": ({"tp": V}, (4, 3), lambda x, m: spmd.reinterpret_mesh(x, m) * 2),
    "axis_index": ({"tp": V}, (4, 3), lambda x, m: x * spmd.axis_index("tp")),
    "spmd.linear": ({"tp": V}, (4, 3), lambda x, m: spmd.linear(x, x, out_partial_axes="tp")),
}


@pytest.fixture
def mesh():
    m = fake_mesh((2, 2), ("dp", "tp"))
    with spmd.set_current_mesh(m):
        yield m


def _compiled(fn):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=counter, fullgraph=True), counter


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_spmd_call_compiles_into_one_graph_typed(mesh, name):
    types, shape, program = PROGRAMS[name]
    fn = lambda x: program(x, mesh)  # noqa: E731
    torch.manual_seed(0)
    with spmd.typecheck():
        x = spmd.assert_type(torch.randn(*shape, requires_grad=True), types)
        want = fn(x)
        compiled, counter = _compiled(fn)
        got = compiled(x)
        got.backward(torch.ones_like(got))  # the gradient's type: by duality, as eager gives it
    assert counter.frame_count == 1
    assert spmd.get_type(got) == spmd.get_type(want)
    torch.testing.assert_close(got.detach(), want.detach())
    assert spmd.get_type(x.grad) == {a: spmd.backward_type(t) for a, t in spmd.get_type(x).items()}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_spmd_call_compiles_into_one_graph_erased(mesh, name):
    _, shape, program = PROGRAMS[name]
    fn = lambda x: program(x, mesh)  # noqa: E731
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    want = fn(x)
    compiled, counter = _compiled(fn)
    got = compiled(x)
    assert counter.frame_count == 1 and spmd.get_type(got) is None
    torch.testing.assert_close(got, want)


def test_collectives_reach_the_compiled_graphs_as_functional_collectives(mesh):
    """What a graph trainer sees: the forward's all-gather and the backward's reduce-scatter, as c10d functional ops."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: list = []

    def keep(gm, _):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    fn = torch.compile(lambda x, w: F.linear(spmd.all_gather(x, "tp", src=S(0), dst=R), w),
                       backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    torch._dynamo.reset()
    with spmd.typecheck():
        x = spmd.assert_type(torch.randn(2, 4, requires_grad=True), {"tp": S(0)})
        w = spmd.assert_type(torch.randn(3, 4, requires_grad=True), {"tp": R})
        out = fn(x, w)
        out.backward(torch.ones_like(out))
    forward, backward = graphs
    assert "_c10d_functional.all_gather_into_tensor" in forward
    assert "_c10d_functional.reduce_scatter_tensor" in backward
