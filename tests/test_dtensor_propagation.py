"""Reduced propagation on ordinary DTensor ops, per op family (spmd_types/integrations/dtensor/propagation.py).

The rule: on each mesh dim, an output that DTensor computes as ``Replicate()``
is ``Reduced()`` when every DTensor input is ``Reduced()`` there (seed 001's
intersection rule; docs/dtensor.md says why not seed 000's "must agree").
Values are DTensor's own: each op gives the same local values as on
``Replicate()`` inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_types as spmd
from spmd_types.integrations.dtensor.propagation import plain_dtensor
from spmd_types.testing import CommCounter, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
Rd, Rep = spmd.Reduced(), Replicate()


def strict(placements) -> tuple:
    return tuple((type(p).__name__, getattr(p, "dim", None)) for p in placements)


def _dt(mesh, placements, shape=(4, 4), seed=0):
    types = {n: spmd.placement_to_type(p) for n, p in zip(mesh.mesh_dim_names, placements)}
    return spmd.to_dtensor(random_value(mesh, types, shape, seed), mesh, placements)


UNARY = {
    "sin": torch.sin, "exp": torch.exp, "neg": torch.neg, "relu": F.relu, "silu": F.silu,
    "to_double": lambda x: x.double(), "clone": torch.clone, "detach": torch.Tensor.detach,
    "mul_scalar": lambda x: x * 3.0, "pow": lambda x: x**2, "softmax": lambda x: F.softmax(x, -1),
}
SHAPE = {
    "view": lambda x: x.view(16), "reshape": lambda x: x.reshape(2, 8), "transpose": lambda x: x.t(),
    "getitem": lambda x: x[1:3], "unsqueeze": lambda x: x.unsqueeze(0), "permute": lambda x: x.permute(1, 0),
}
REDUCTION = {"sum": lambda x: x.sum(), "mean_dim": lambda x: x.mean(0), "amax": lambda x: x.amax(-1)}


@pytest.mark.parametrize("name", list(UNARY) + list(SHAPE) + list(REDUCTION))
def test_one_input_ops_keep_reduced_with_replicate_values(name):
    fn = {**UNARY, **SHAPE, **REDUCTION}[name]
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        x = _dt(mesh, [Rd])
        with CommCounter() as comms:
            y = fn(x)
        assert strict(y.placements) == (("Reduced", None),)
        assert comms.counts == {}
        plain = fn(plain_dtensor(x))
        assert strict(plain.placements) == (("Replicate", None),)
        for r, v in rank_values(y._local_tensor).items():
            torch.testing.assert_close(v, rank_values(plain._local_tensor)[r])


BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "div": torch.div, "matmul": torch.matmul,
          "cat": lambda a, b: torch.cat([a, b]), "where": lambda a, b: torch.where(a > 0, a, b),
          "maximum": torch.maximum}


@pytest.mark.parametrize("name", list(BINARY))
def test_n_ary_ops_intersection_rule(name):
    fn = BINARY[name]
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        a, b = _dt(mesh, [Rd]), _dt(mesh, [Rd], seed=1)
        assert strict(fn(a, b).placements) == (("Reduced", None),)  # all Reduced: Reduced (R op R -> R)
        rep = plain_dtensor(b)
        assert strict(fn(a, rep).placements) == (("Replicate", None),)  # Reduced with Replicate: Replicate
        assert strict(fn(rep, a).placements) == (("Replicate", None),)


def test_reduced_with_shard_gives_what_dtensor_gives():
    """op(R, V) -> V: the FSDP case, weight Reduced, activation batch-sharded."""
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        w, x = _dt(mesh, [Rd]), _dt(mesh, [Shard(0)], shape=(3, 4), seed=1)
        assert strict((x @ w).placements) == (("Shard", 0),)
        assert strict((x + w[0]).placements) == (("Shard", 0),)
        assert strict(F.linear(x, w).placements) == (("Shard", 0),)


def test_reduced_times_partial_stays_partial():
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        w, p = _dt(mesh, [Rd]), _dt(mesh, [Partial()], seed=1)
        assert strict((p * w).placements) == (("Partial", None),)


def test_two_dim_mesh_intersects_per_mesh_dim():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4):
        a = _dt(mesh, [Rd, Rd])
        b = _dt(mesh, [Rd, Rep], seed=1)
        c = _dt(mesh, [Shard(0), Rd], shape=(2, 4), seed=2)
        assert strict((a + b).placements) == (("Reduced", None), ("Replicate", None))
        assert strict((a * c).placements) == (("Shard", 0), ("Reduced", None))
        assert strict(a.sin().placements) == (("Reduced", None), ("Reduced", None))


def test_in_place_ops_keep_their_tensor_placements():
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        a, rep = _dt(mesh, [Rd]), plain_dtensor(_dt(mesh, [Rd], seed=1))
        before = rank_values(a._local_tensor)[0].clone()
        out = a.add_(rep)
        assert out is a and strict(a.placements) == (("Reduced", None),)
        assert torch.equal(rank_values(a._local_tensor)[0], before + rank_values(rep._local_tensor)[0])
        rep.mul_(a)
        assert strict(rep.placements) == (("Replicate", None),) and type(rep).__name__ == "DTensor"


def test_leaf_gradient_and_detach_keep_reduced_and_backward_values_are_dtensors():
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        w = _dt(mesh, [Rd]).detach().requires_grad_()
        assert strict(w.placements) == (("Reduced", None),)
        x = _dt(mesh, [Shard(0)], shape=(3, 4), seed=1)
        (x @ w).sum().backward()
        assert strict(w.grad.placements) == (("Partial", None),)  # DTensor's own backward: a pending sum
        # The global gradient is what it would be for a Replicate weight.
        w2 = plain_dtensor(w).detach().requires_grad_()
        (x @ w2).sum().backward()
        full = rank_values(plain_dtensor(w.grad).full_tensor())[0]
        torch.testing.assert_close(full, rank_values(plain_dtensor(w2.grad).full_tensor())[0])


def test_leaving_reduced_and_what_dtensor_itself_refuses():
    """docs/dtensor.md, "not supported": convert R -> I is the way back to Replicate()."""
    from torch.distributed.tensor import DTensor

    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        x = _dt(mesh, [Rd])
        y = spmd.convert(x, "dp", src=R, dst=I)
        assert strict(y.placements) == (("Replicate", None),) and type(y) is DTensor
        with pytest.raises(RuntimeError, match="redistribute from Rd to R not supported yet"):
            x.redistribute(mesh, [Rep])
        by_hand = DTensor.from_local(torch.ones(3), mesh, [Rd])
        with pytest.raises(RuntimeError, match="redistribute from Rd to R not supported yet"):
            by_hand + 1
