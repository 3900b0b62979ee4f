"""Every typed op of seed 003's table on DTensor inputs, on simulated ranks (LocalTensorMode over a fake PG).

For each row (V layouts spelled S(1): a DTensor's shards say their dim), on a
2-rank mesh and on the tp axis of a (dp=2, tp=2) mesh (dp: Shard(0)):
(a) the output's placements are the input's with ``type_to_placement(dst)`` on
    the op's mesh dim, and DTensor's own ``full_tensor()`` of input and output
    are the denotations of the local values (so placements and types agree);
(b) the local values equal the same op on plain local tensors;
(c) backward: the input's gradient has the cotangent placements and passes
    the adjoint identity <A x, g> = <x, A^T g>;
(d) forward and backward communication counts are exactly the plain op's
    (``EXPECTED_COMMS`` of tests/test_collectives.py): no extra redistribution.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from test_collectives import EXPECTED_COMMS
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_types as spmd
from spmd_types._comm import collectives as coll
from spmd_types._comm import reinterpret_convert as local
from spmd_types._local.transitions import TRANSITIONS
from spmd_types.integrations.dtensor.propagation import plain_dtensor
from spmd_types.testing import CommCounter, denote, pair, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V

MESHES = {"world2": ((2,), ("tp",)), "2x2": ((2, 2), ("dp", "tp"))}


def strict(placements) -> tuple:
    """Placements as (class name, dim): ``Reduced() != Replicate()`` however ``==`` is defined."""
    return tuple((type(p).__name__, getattr(p, "dim", None)) for p in placements)


def full(dt) -> torch.Tensor:
    """DTensor's own reassembly of ``dt`` (``full_tensor()``), as one plain tensor (equal on every rank)."""
    values = list(rank_values(plain_dtensor(dt).full_tensor()).values())
    for v in values[1:]:
        assert torch.equal(v, values[0])
    return values[0]


def _as_shard(t):
    return S(1) if t is V else t


def _rows():
    return [pytest.param(row, id=f"{row.op}-{row.src}-{row.dst}") for row in TRANSITIONS]


def _types(mesh, t):
    return {"dp": S(0), "tp": t} if mesh.ndim == 2 else {"tp": t}


def _op(row):
    return getattr(local, row.op, None) or getattr(coll, row.op)


def _call(row, x, src, dst):
    if row.op == "all_to_all":
        return _op(row)(x, "tp", src=S(0), dst=S(1))
    return _op(row)(x, "tp", src=src, dst=dst)


def _dt(x, mesh, types, requires_grad=False):
    out = spmd.to_dtensor(x, mesh, [spmd.type_to_placement(types[n]) for n in mesh.mesh_dim_names])
    return out.detach().requires_grad_(requires_grad)


@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("row", _rows())
def test_row_on_dtensor(row, shape):
    mesh = fake_mesh(*MESHES[shape])
    src, dst = _as_shard(row.src), _as_shard(row.dst)
    if row.op == "all_to_all":
        src, dst = S(0), S(1)
    if shape == "2x2" and row.op == "all_to_all":
        src, dst = S(1), S(2)  # dp shards dim 0
    n = 2
    with LocalTensorMode(mesh.size()), spmd.set_current_mesh(mesh):
        x = random_value(mesh, _types(mesh, src), (n * 2, 2 * n, 2) if mesh.ndim == 2 else (n, 2 * n))
        dt = _dt(x, mesh, _types(mesh, src), requires_grad=True)
        with CommCounter() as comms:
            out = _op(row)(dt, "tp", src=src, dst=dst)
        fwd = comms.counts
        want = [spmd.type_to_placement(t) for t in _types(mesh, dst).values()]
        assert strict(out.placements) == strict(want)
        plain = _op(row)(x, "tp", src=src, dst=dst)
        for r, v in rank_values(plain).items():
            assert torch.equal(rank_values(out._local_tensor)[r], v)
        torch.testing.assert_close(full(dt), denote(x, mesh, _types(mesh, src)))
        torch.testing.assert_close(full(out), denote(plain, mesh, _types(mesh, dst)))
        back = {a: spmd.backward_type(t) for a, t in _types(mesh, dst).items()}
        g = random_value(mesh, back, tuple(plain.shape), seed=1)
        g_dt = _dt(g, mesh, back)
        with CommCounter() as comms:
            out.backward(g_dt)
        assert (fwd, comms.counts) == EXPECTED_COMMS[(row.op, row.src, row.dst)]
        assert strict(dt.grad.placements) == strict(spmd.spec_to_cotangent(dt.placements))
        lhs = pair(plain, g, mesh, _types(mesh, dst))
        rhs = pair(x, dt.grad._local_tensor, mesh, _types(mesh, src))
        torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)


def test_fsdp_gather_is_reduced_and_its_backward_one_reduce_scatter():
    """Seed 001's FSDP case: Shard(0) -> Reduced(); backward: one reduce-scatter of N bytes, no all-reduce."""
    mesh = fake_mesh((4,), ("dp",))
    with LocalTensorMode(4):
        w = _dt(random_value(mesh, {"dp": S(0)}, (2, 8)), mesh, {"dp": S(0)}, requires_grad=True)
        x = _dt(random_value(mesh, {"dp": S(0)}, (3, 8), seed=1), mesh, {"dp": S(0)})
        with CommCounter() as comms:
            w_full = spmd.all_gather(w, "dp", src=S(0), dst=R)
            assert repr(w_full.placements) == "(Reduced(),)" and tuple(w_full.shape) == (8, 8)
            assert comms.counts == {"all_gather": 1}
            loss = (x @ w_full.T).sum()
            comms.reset()
            loss.backward()
        assert comms.counts == {"reduce_scatter": 1}
        assert strict(w.grad.placements) == (("Shard", 0),)
        torch.testing.assert_close(full(w.grad),
                                   full(x).sum(0).expand(8, 8).contiguous())


def test_gather_to_replicate_backward_is_a_local_slice():
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        w = _dt(random_value(mesh, {"dp": S(0)}, (2, 4)), mesh, {"dp": S(0)}, requires_grad=True)
        w_full = spmd.all_gather(w, "dp", src=S(0), dst=I)
        assert strict(w_full.placements) == (("Replicate", None),)
        with CommCounter() as comms:
            (w_full * 3).sum().backward()
        assert comms.counts == {}
        torch.testing.assert_close(full(w.grad), torch.full((4, 4), 3.0))


def test_redistribute_per_axis_on_dtensor_routes_to_the_collective():
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2):
        x = _dt(random_value(mesh, {"tp": P}, (2, 4)), mesh, {"tp": P})
        with CommCounter() as comms:
            y = spmd.redistribute(x, "tp", src=P, dst=S(1))
        assert comms.counts == {"reduce_scatter": 1}
        assert strict(y.placements) == (("Shard", 1),)
        torch.testing.assert_close(full(y), full(x))


def test_partial_to_reduced_all_reduce_and_back():
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2):
        x = _dt(random_value(mesh, {"tp": P}, (4,)), mesh, {"tp": P}, requires_grad=True)
        y = spmd.all_reduce(x, "tp", src=P, dst=R)
        assert strict(y.placements) == (("Reduced", None),)
        with CommCounter() as comms:
            y.backward(_dt(random_value(mesh, {"tp": P}, (4,), seed=3), mesh, {"tp": P}))
        assert comms.counts == {"all_reduce": 1}
        assert strict(x.grad.placements) == (("Reduced", None),)


def test_to_dtensor_gradient_is_redistributed_to_the_cotangent():
    """A Replicate gradient reaching a Reduced output becomes Partial locally (no comm) before the local op."""
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        local_x = random_value(mesh, {"dp": R}, (4,)).requires_grad_()
        out = spmd.to_dtensor(local_x, mesh, [spmd.Reduced()])
        g = _dt(random_value(mesh, {"dp": I}, (4,), seed=2), mesh, {"dp": I})
        with CommCounter() as comms:
            out.backward(g)
        assert comms.counts == {}
        assert torch.equal(denote(local_x.grad, mesh, {"dp": P}), denote(g._local_tensor, mesh, {"dp": I}))
        assert strict([Shard(0), Replicate(), Partial()]) != strict([Shard(0), spmd.Reduced(), Partial()])


def test_all_reduce_max_on_a_sharded_dtensor():
    """op="max" (not in seed 003's table): Shard(0) -> Reduced(), the gradient goes to the rank holding the max."""
    from spmd_types.testing import per_rank

    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2):
        x = per_rank(lambda r: torch.tensor([1.0, 5.0]) if r == 0 else torch.tensor([3.0, 2.0]))
        dt = _dt(x, mesh, {"tp": S(0)}, requires_grad=True)
        with CommCounter() as comms:
            out = spmd.all_reduce(dt, "tp", src=S(0), dst=R, op="max")
        assert comms.counts == {"all_reduce": 1} and strict(out.placements) == (("Reduced", None),)
        assert torch.equal(rank_values(out._local_tensor)[1], torch.tensor([3.0, 5.0]))
        out.backward(_dt(per_rank(lambda r: torch.ones(2)), mesh, {"tp": P}))  # P: each rank adds 1
        assert strict(dt.grad.placements) == (("Shard", 0),)
        grads = rank_values(dt.grad._local_tensor)
        assert torch.equal(grads[0], torch.tensor([0.0, 2.0])) and torch.equal(grads[1], torch.tensor([2.0, 0.0]))
