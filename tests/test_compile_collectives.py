"""Erased typed-communication calls trace into one graph under torch.compile(fullgraph=True).

A tensor-parallel MLP (column-parallel then row-parallel linear) forward and
backward. Comms are counted on the eager path (a dispatch mode cannot be
active around a compiled call).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from conftest import fake_mesh

import spmd_types as spmd
from spmd_types._comm.collectives import all_reduce
from spmd_types._comm.reinterpret_convert import reinterpret
from spmd_types.testing import CommCounter


def tp_mlp(x, w1, w2):
    x = reinterpret(x, "tp", src=spmd.I, dst=spmd.R)  # backward: all-reduce of the input gradient
    h = torch.relu(x @ w1)  # w1: a column shard, h: V
    return all_reduce(h @ w2, "tp", src=spmd.V, dst=spmd.I)  # w2: a row shard; V -> P -> summed


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_tp_mlp_compiles_without_graph_breaks(backend):
    mesh = fake_mesh((4,), ("tp",))
    torch.manual_seed(0)
    x = torch.randn(3, 8, requires_grad=True)
    w1 = torch.randn(8, 4, requires_grad=True)
    w2 = torch.randn(4, 8, requires_grad=True)
    with spmd.set_current_mesh(mesh):
        with CommCounter() as comms:
            eager = tp_mlp(x, w1, w2)
            eager_grads = torch.autograd.grad(eager.sum(), (x, w1, w2))
        assert comms.counts == {"all_reduce": 2}
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        compiled = torch.compile(tp_mlp, fullgraph=True, backend=counter)
        out = compiled(x, w1, w2)
        grads = torch.autograd.grad(out.sum(), (x, w1, w2))
        assert counter.frame_count == 1
        explained = torch._dynamo.explain(tp_mlp)(x, w1, w2)
        assert explained.graph_break_count == 0
    torch.testing.assert_close(out, eager)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want)
