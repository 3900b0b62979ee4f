"""``spmd.local_map`` with DTensor arguments, and examples/dtensor_local_map.py run as a test."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Shard

import spmd_types as spmd
from spmd_types.integrations.dtensor.propagation import plain_dtensor
from spmd_types.testing import CommCounter, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dtensor_local_map.py"


def strict(placements) -> tuple:
    return tuple((type(p).__name__, getattr(p, "dim", None)) for p in placements)


def _mm(h, w):
    return h @ w


def _pair(h, w):
    return h * 2, w


def _inputs(mesh):
    h = spmd.to_dtensor(random_value(mesh, {"dp": S(0), "tp": S(1)}, (2, 4)), mesh, [Shard(0), Shard(1)])
    w = spmd.to_dtensor(random_value(mesh, {"dp": R, "tp": S(0)}, (4, 3), seed=1), mesh, [spmd.Reduced(), Shard(0)])
    return h.detach().requires_grad_(), w.detach().requires_grad_()


def test_local_map_on_dtensors_gives_dtensors_with_the_declared_placements():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    seen = []

    @spmd.local_map(in_types=[{"dp": S(0), "tp": S(1)}, {"tp": S(0)}], out_types={"dp": S(0), "tp": P})
    def body(h, w):
        seen.append((spmd.get_type(h), spmd.get_type(w)))
        return spmd.reinterpret(h @ w, "tp", src=V, dst=P)

    with LocalTensorMode(4):
        h, w = _inputs(mesh)
        with spmd.typecheck():
            out = body(h, w)
        assert isinstance(out, DTensor) and strict(out.placements) == (("Shard", 0), ("Partial", None))
        full = lambda t: rank_values(plain_dtensor(t).full_tensor())[0]  # noqa: E731
        h1, w1 = full(h).requires_grad_(), full(w).requires_grad_()
        (h1 @ w1).sum().backward()
        torch.testing.assert_close(full(out), (h1 @ w1).detach())
        with CommCounter() as comms:
            out.sum().backward()
        assert comms.counts == {}  # the gradients enter and leave the region with no communication
        assert strict(w.grad.placements) == (("Partial", None), ("Shard", 0))  # R on dp: a pending sum
        torch.testing.assert_close(full(w.grad), w1.grad)
        torch.testing.assert_close(full(h.grad), h1.grad)
    assert seen == [({"dp": S(0), "tp": S(1)}, {"dp": R, "tp": S(0)})]


@pytest.mark.parametrize("in_types", ["declared", "Infer"])
def test_outside_typecheck_local_map_passes_dtensors_through(in_types):
    """Erased, local_map is the function itself: DTensors in, DTensor ops inside (torchtitan's partial_dtensor and
    full_dtensor backends run its spmd.local_map regions so, with this package installed)."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    seen = []

    def body(h, w):
        seen.append((isinstance(h, DTensor), isinstance(w, DTensor)))
        return h @ w

    kwargs = {"in_types": [{"dp": S(0), "tp": S(1)}, {"tp": S(0)}]} if in_types == "declared" else {}
    mapped = spmd.local_map(body, out_types={"dp": S(0), "tp": P}, **kwargs)
    with LocalTensorMode(4):
        h, w = _inputs(mesh)
        out = mapped(h, w)
        assert isinstance(out, DTensor) and strict(out.placements) == (("Shard", 0), ("Partial", None))
        full = lambda t: rank_values(plain_dtensor(t).full_tensor())[0]  # noqa: E731
        torch.testing.assert_close(full(out), full(h) @ full(w))
    assert seen == [(True, True)]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_local_map_on_dtensors_checks_in_and_out_types():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4):
        h, w = _inputs(mesh)
        bad_in = spmd.local_map(_mm, in_types=[{"tp": R}, None], out_types={"dp": S(0), "tp": P})
        with spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as info:
            bad_in(h, w)
        assert info.value.rule == (
            "Type assertion failed: the DTensor is Shard(dim=1) (S(1)) on axis 'tp', and the assertion says R.")
        partial_out = spmd.local_map(_mm, in_types=[None, None], out_types={"tp": P})
        with spmd.typecheck(), pytest.raises(ValueError) as err:
            partial_out(h, w)
        assert str(err.value) == (
            "local_map(_mm): output 0 becomes a DTensor, so its out_types must give a type for every mesh dim "
            "('dp', 'tp'); missing ('dp',)")
        # A body's V output declared P: each rank's value is its piece of the pending sum (reinterpret(V, P),
        # no communication either way), as the local matmul over the sharded contraction dim is.
        declared = spmd.local_map(_mm, in_types=[None, None], out_types={"dp": S(0), "tp": P})
        with spmd.typecheck():
            out = declared(h, w)
        assert strict(out.placements) == (("Shard", 0), ("Partial", None))
        replicated = spmd.local_map(_mm, in_types=[None, None], out_types={"dp": S(0), "tp": R})
        with spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as info:
            replicated(h, w)  # per-rank values are not one replicated value
        assert info.value.rule == "local_map: output 0 of _mm is V on axis 'tp', and out_types declares R."
        stacked = spmd.local_map(lambda h: h, in_types=[None], out_types={"dp": V, "tp": V})
        with spmd.typecheck(), pytest.raises(ValueError) as err:
            stacked(h)
        assert str(err.value).startswith("type_to_placement: V has no DTensor placement")


def test_local_map_tuple_outputs_and_mixed_meshes():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4):
        h, w = _inputs(mesh)
        pair = spmd.local_map(_pair, in_types=[None, None],
                              out_types=[{"dp": S(0), "tp": S(1)}, None])
        with spmd.typecheck():
            a, b = pair(h, w)
        assert isinstance(a, DTensor) and strict(a.placements) == (("Shard", 0), ("Shard", 1))
        assert not isinstance(b, DTensor)
        other = spmd.to_dtensor(torch.ones(2), mesh["dp"], [Partial()])
        with spmd.typecheck(), pytest.raises(ValueError) as err:
            pair(h, other)
        assert str(err.value) == "local_map(_pair): its DTensor arguments live on different meshes"


def test_example_runs():
    out = runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert out["RESULT"]["forward"] == {"all_gather": 2, "all_reduce": 1}
    assert out["RESULT"]["backward"] == {"reduce_scatter": 2, "all_reduce": 1}
    assert out["RESULT"]["gathered"] == "(Reduced(), Shard(dim=0))"
