"""Seed 002's examples 1-5 with their exact comm counts; flattened axes; uneven shards; averages; redistribute."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types._comm.collectives import all_gather, all_reduce, redistribute, reduce_scatter
from spmd_types._comm.reinterpret_convert import convert
from spmd_types._local.transitions import ROUTE
from spmd_types.testing import CommCounter, denote, pair, per_rank, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
N = 4


@pytest.fixture(scope="module")
def mesh4():
    return fake_mesh((N,), ("tp",))


def _stack(t: torch.Tensor) -> torch.Tensor:
    vals = rank_values(t)
    return torch.stack([vals[r] for r in sorted(vals)])


def _run(fn, x, typed: bool, types):
    """Forward and backward of ``fn`` from ``x``, counting comms in each; the loss cotangent is all ones."""
    with spmd.typecheck() if typed else _null():
        if typed:
            x = spmd.assert_type(x, types)
        with CommCounter() as fwd:
            y = fn(x)
        seed = torch.ones_like(y)
    # torch.autograd.grad on typed tensors is called outside typecheck(): the core rules table treats it
    # as an ordinary op today (reported to the core owner).
    with CommCounter() as bwd:
        (gx,) = torch.autograd.grad(y, x, seed)
    return y, gx, fwd.counts, bwd.counts


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("typed", [False, True], ids=["erased", "typed"])
def test_seed002_examples(mesh4, typed):
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4):
        x = random_value(mesh4, {"tp": V}, (3,)).requires_grad_()
        y = random_value(mesh4, {"tp": V}, (), seed=7)
        X, Y = _stack(x), _stack(y)

        # Example 1: psum(g(x)) to an unmapped (invariant) output: backward does no communication.
        out, gx, fwd, bwd = _run(lambda t: all_reduce(t.sin().sum(), "tp", src=V, dst=I), x, typed, {"tp": V})
        assert (fwd, bwd) == ({"all_reduce": 1}, {})
        torch.testing.assert_close(_stack(gx), X.cos())
        # Example 2: psum(g(x)) * y to a mapped output: backward all-reduces once.
        out, gx, fwd, bwd = _run(lambda t: all_reduce(t.sin().sum(), "tp", src=V, dst=R) * y, x, typed, {"tp": V})
        assert (fwd, bwd) == ({"all_reduce": 1}, {"all_reduce": 1})
        torch.testing.assert_close(_stack(gx), X.cos() * Y.sum())
        # Example 4: all_gather to an unmapped output: backward is a local slice.
        out, gx, fwd, bwd = _run(lambda t: all_gather(t, "tp", src=V, dst=I), x, typed, {"tp": V})
        assert (fwd, bwd) == ({"all_gather": 1}, {})
        torch.testing.assert_close(_stack(gx), torch.ones(N, 3))
        # Example 5: all_gather(x) * y to a mapped output: backward reduce-scatters once.
        out, gx, fwd, bwd = _run(lambda t: all_gather(t, "tp", src=V, dst=R) * y, x, typed, {"tp": V})
        assert (fwd, bwd) == ({"all_gather": 1}, {"reduce_scatter": 1})
        torch.testing.assert_close(_stack(gx), Y.sum() * torch.ones(N, 3))


def test_seed002_example3_cursed_identity(mesh4):
    """An invariant value through an identity: no communication forward, backward or double backward."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4), spmd.typecheck():
        x = spmd.assert_type(random_value(mesh4, {"tp": I}, (3,)).requires_grad_(), {"tp": I})
        with CommCounter() as comms:
            out = x * 1.0
        assert comms.total == 0 and spmd.get_type(out) == {"tp": I}
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4):
        x = random_value(mesh4, {"tp": I}, (3,)).requires_grad_()
        with CommCounter() as comms:
            out = x * 1.0
            (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
        assert comms.total == 0
        assert all(torch.equal(v, torch.ones(3)) for v in rank_values(g).values())


def test_flattened_axes():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    both = {"dp": P, "tp": P}
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        x = random_value(mesh, both, (4, 2)).requires_grad_()
        with CommCounter() as comms:
            y = all_reduce(x, ("dp", "tp"), src=P, dst=R)
            s = reduce_scatter(x, ("dp", "tp"), src=P, dst=S(0))
            a = all_gather(s, ("dp", "tp"), src=S(0), dst=R)
        assert comms.counts == {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 1}
        total = denote(x, mesh, both)
        torch.testing.assert_close(denote(y, mesh, {"dp": R, "tp": R}), total)
        torch.testing.assert_close(denote(s, mesh, {"dp": S(0), "tp": S(0)}), total)
        torch.testing.assert_close(denote(a, mesh, {"dp": R, "tp": R}), total)
        g = random_value(mesh, both, (4, 2), seed=3)
        with CommCounter() as comms:
            (gx,) = torch.autograd.grad(y, x, g)
        assert comms.counts == {"all_reduce": 1}
        torch.testing.assert_close(pair(y, g, mesh, {"dp": R, "tp": R}), pair(x, gx, mesh, both), rtol=1e-5, atol=1e-5)
        with spmd.typecheck():
            t = all_reduce(spmd.assert_type(x.detach(), both), ("dp", "tp"), src=P, dst=I)
            assert spmd.get_type(t) == {"dp": I, "tp": I}
            u = all_reduce(spmd.assert_type(x.detach(), {"dp": V, "tp": P}), "tp", src=P, dst=R)
            assert spmd.get_type(u) == {"dp": V, "tp": R}  # the other axis keeps its type


SIZES = [1, 3, 0, 2]


def test_uneven_shards(mesh4):
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4):
        full = torch.randn(sum(SIZES), 2)
        rep = per_rank(lambda r: full.clone())
        shard = convert(rep, "tp", src=R, dst=S(0), sizes=SIZES)
        assert [v.shape[0] for _, v in sorted(rank_values(shard).items())] == SIZES
        shard.requires_grad_()
        with CommCounter() as comms:
            gathered = all_gather(shard, "tp", src=S(0), dst=R, sizes=SIZES)
        assert comms.counts == {"all_gather": 1}
        torch.testing.assert_close(denote(gathered, mesh4, {"tp": R}), full)
        g = random_value(mesh4, {"tp": P}, tuple(full.shape), seed=5)
        with CommCounter() as comms:
            (gs,) = torch.autograd.grad(gathered, shard, g)
        assert comms.counts == {"reduce_scatter": 1}
        torch.testing.assert_close(denote(gs, mesh4, {"tp": S(0)}), denote(g, mesh4, {"tp": P}))
        placed = convert(shard.detach(), "tp", src=S(0), dst=P, sizes=SIZES)
        torch.testing.assert_close(denote(placed, mesh4, {"tp": P}), full)


@pytest.mark.parametrize("dst", [R, I])
def test_all_reduce_avg(mesh4, dst):
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4):
        x = random_value(mesh4, {"tp": P}, (3,)).requires_grad_()
        y = all_reduce(x, "tp", src=P, dst=dst, op="avg")
        torch.testing.assert_close(denote(y, mesh4, {"tp": dst}), denote(x, mesh4, {"tp": P}) / N)
        g = random_value(mesh4, {"tp": spmd.backward_type(dst)}, (3,), seed=2)
        with CommCounter() as comms:
            (gx,) = torch.autograd.grad(y, x, g)
        assert comms.counts == ({"all_reduce": 1} if dst is R else {})
        torch.testing.assert_close(pair(y, g, mesh4, {"tp": dst}), pair(x, gx, mesh4, {"tp": P}), rtol=1e-5, atol=1e-5)


def test_reduce_scatter_avg(mesh4):
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4):
        x = random_value(mesh4, {"tp": P}, (8,)).requires_grad_()
        y = reduce_scatter(x, "tp", src=P, dst=S(0), op="avg")
        torch.testing.assert_close(denote(y, mesh4, {"tp": S(0)}), denote(x, mesh4, {"tp": P}) / N)
        g = random_value(mesh4, {"tp": S(0)}, (2,), seed=2)
        (gx,) = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(pair(y, g, mesh4, {"tp": S(0)}), pair(x, gx, mesh4, {"tp": P}), rtol=1e-5, atol=1e-5)


_ROUTE_CASES = [(s if s is not V else S(0), d if d is not V else S(1 if s is V else 0)) for s, d in ROUTE]


@pytest.mark.parametrize("src,dst", _ROUTE_CASES, ids=[f"{s}-{d}" for s, d in _ROUTE_CASES])
def test_redistribute_keeps_meaning(mesh4, src, dst):
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4):
        x = random_value(mesh4, {"tp": src}, (4, 4))
        y = redistribute(x, "tp", src=src, dst=dst)
        torch.testing.assert_close(denote(y, mesh4, {"tp": dst}), denote(x, mesh4, {"tp": src}))


def test_every_backward_the_table_names_can_be_looked_up():
    from spmd_types._local.transitions import TRANSITIONS, backward_of

    for row in TRANSITIONS:
        back = backward_of(row.op, row.src, row.dst)
        # Transposing twice gives a forward of the same types (convert and reinterpret coincide on R <-> I).
        again = backward_of(*back)
        assert (again[1], again[2]) == (row.src, row.dst), (row, back, again)
        assert again[0] == row.op or {again[0], row.op} == {"convert", "reinterpret"}, (row, back, again)


@pytest.mark.parametrize("typed", [False, True], ids=["erased", "typed"])
@pytest.mark.parametrize("dst", [S(0), S(1), V], ids=["S(0)", "S(1)", "V"])
def test_a_local_slice_owns_contiguous_storage(mesh4, typed, dst):
    # torchtitan shards parameters with spmd.shard(w, group, src=I, dst=S(d)) before fully_shard; FSDP refuses a
    # non-contiguous parameter ("FSDP does not support non-contiguous parameters yet"), and a view would keep the
    # whole weight alive. As the published package: a new contiguous tensor, whatever the dim.
    w = torch.arange(32.0).reshape(N, 8)
    with spmd.set_current_mesh(mesh4), (spmd.typecheck() if typed else contextlib.nullcontext()):
        if typed:
            spmd.assert_type(w, {"tp": I})
        out = spmd.convert(w, "tp", src=I, dst=dst)
    assert out.is_contiguous()
    assert out.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    expected = w[0] if dst is V else w.chunk(N, dst.dim)[0]  # rank 0's part (the fake group is rank 0)
    assert torch.equal(out.as_subclass(torch.Tensor), expected)


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "erased"])
def test_convert_to_a_shard_of_an_inner_dim_is_contiguous(mesh4, typed):
    # torchtitan's MoE layer takes its input as S(1) on tp and calls .view(T, D) on it, as the published API's
    # convert (a copy of the chunk) allows; a narrow view of dim 1 could not be viewed so.
    with LocalTensorMode(N), spmd.set_current_mesh(mesh4):
        x = per_rank(lambda r: torch.arange(2 * 8 * 3.0).view(2, 8, 3))
        with spmd.typecheck() if typed else spmd.no_typecheck():
            x = spmd.assert_type(x, {"tp": R}) if typed else x
            y = convert(x, "tp", src=R, dst=S(1))
            assert y.is_contiguous() and tuple(y.view(4, 3).shape) == (4, 3)
        assert torch.equal(rank_values(y)[1], torch.arange(48.0).view(2, 8, 3)[:, 2:4])
