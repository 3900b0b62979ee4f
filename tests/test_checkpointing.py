"""Activation checkpointing and in-place ops with autograd on simulated ranks (issue 11, item 4).

``torch.utils.checkpoint`` (both ``use_reentrant`` settings) gives the
gradients of the same program without it, with the same types, and the
recomputation in backward is checked like any code. In-place ops on typed
tensors that autograd records work on ``LocalTensorMode`` and give the
one-device gradient.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.checkpoint as cp
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types import I, P, R, V
from spmd_types.testing import denote, random_value

REENTRANT = [False, True]


@pytest.fixture
def mesh():
    return fake_mesh((2, 2), ("dp", "tp"))


def _block(x, w1, w2):
    """A tensor-parallel MLP: x is I on tp, w1 a column shard, w2 a row shard."""
    h = torch.relu(spmd.reinterpret(x, "tp", src=I, dst=R) @ w1)
    return spmd.all_reduce(h @ w2, "tp", src=V, dst=I)


def _inputs(mesh):
    x = random_value(mesh, {"dp": V, "tp": R}, (3, 4), seed=1).requires_grad_(True)
    w1 = random_value(mesh, {"dp": R, "tp": V}, (4, 6), seed=2).requires_grad_(True)
    w2 = random_value(mesh, {"dp": R, "tp": V}, (6, 4), seed=3).requires_grad_(True)
    return (spmd.assert_type(x, {"dp": V, "tp": I}), spmd.assert_type(w1, {"dp": R, "tp": V}),
            spmd.assert_type(w2, {"dp": R, "tp": V}))


def _grads(mesh, use_checkpoint: bool, reentrant: bool):
    x, w1, w2 = _inputs(mesh)
    if use_checkpoint:
        out = cp.checkpoint(_block, x, w1, w2, use_reentrant=reentrant)
    else:
        out = _block(x, w1, w2)
    assert spmd.get_type(out) == {"dp": V, "tp": I}
    spmd.all_reduce(out.sum(), "dp", src=V, dst=I).backward()
    return [(spmd.get_type(t.grad), t.grad) for t in (x, w1, w2)]


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_checkpointed_block_matches_the_plain_block(mesh, reentrant):
    with LocalTensorMode(4), spmd.set_current_mesh(mesh), spmd.typecheck():
        want = _grads(mesh, False, reentrant)
        got = _grads(mesh, True, reentrant)
        assert [t for t, _ in got] == [{"dp": V, "tp": I}, {"dp": P, "tp": V}, {"dp": P, "tp": V}]
        assert [t for t, _ in got] == [t for t, _ in want]
        for (types, g), (_, h) in zip(got, want):
            torch.testing.assert_close(denote(g, mesh, types), denote(h, mesh, types))


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_checkpointed_block_matches_one_device(mesh, reentrant):
    with LocalTensorMode(4), spmd.set_current_mesh(mesh), spmd.typecheck():
        (gx_t, gx), (gw1_t, gw1), _ = _grads(mesh, True, reentrant)
        x, w1, w2 = _inputs(mesh)
        xs = denote(x, mesh, {"dp": V, "tp": I})
        w1s = denote(w1, mesh, {"dp": R, "tp": S1})
        w2s = denote(w2, mesh, {"dp": R, "tp": S0})
        got_x, got_w1 = denote(gx, mesh, gx_t), denote(gw1, mesh, {"dp": P, "tp": S1})
    xs, w1s, w2s = (t.detach().requires_grad_(True) for t in (xs, w1s, w2s))
    (torch.relu(xs @ w1s) @ w2s).sum().backward()
    torch.testing.assert_close(got_x, xs.grad)
    torch.testing.assert_close(got_w1, w1s.grad)


S0, S1 = spmd.S(0), spmd.S(1)


@pytest.mark.parametrize("simulated", [False, True])
@pytest.mark.parametrize("reentrant", REENTRANT)
def test_recomputation_is_checked(mesh, reentrant, simulated):
    """A recomputation that differs from the forward (here: ill typed) is caught in backward."""
    calls = []

    def fn(a, b):
        calls.append(1)
        if len(calls) == 1:
            return a * b
        return spmd.reinterpret(a, "tp", src=V, dst=P) + b  # P + V: rejected

    with LocalTensorMode(4) if simulated else contextlib.nullcontext(), spmd.set_current_mesh(mesh), spmd.typecheck():
        def value(types, seed):
            return random_value(mesh, types, (4,), seed=seed) if simulated else torch.randn(4)

        a = spmd.assert_type(value({"dp": V, "tp": V}, 0).requires_grad_(True), {"dp": V, "tp": V})
        b = spmd.assert_type(value({"dp": R, "tp": R}, 1).requires_grad_(True), {"dp": R, "tp": R})
        out = cp.checkpoint(fn, a, b, use_reentrant=reentrant)
        loss = spmd.all_reduce(spmd.all_reduce(out.sum(), "tp", src=V, dst=I), "dp", src=V, dst=I)
        with pytest.raises(spmd.SpmdTypeError) as err:
            loss.backward()
    assert len(calls) == 2
    assert err.value.rule == (
        "A pending sum (P) can only be added to another pending sum: Tensor.__add__ (+) adds P to R, and the R "
        "value would be added once on every rank."
    )


# ---------------------------------------------------------------------------
# in-place ops with autograd


def _in_place_program(x, w):
    h = x @ w
    h.mul_(2)
    h[0].mul_(3)  # in place on a view: autograd replays the view on its base
    h.view(-1)[1:3].add_(1.0)
    h.add_(x)
    h.sub_(h[1].detach().clone())
    h.relu_()
    return h


def test_in_place_ops_with_autograd_match_one_device():
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        w = spmd.assert_type(torch.nn.Parameter(random_value(mesh, {"tp": R}, (4, 4))), {"tp": R})
        x = spmd.assert_type(random_value(mesh, {"tp": V}, (3, 4), seed=1), {"tp": V})
        h = _in_place_program(x, w)
        assert spmd.get_type(h) == {"tp": V}
        spmd.reinterpret(h.sum(), "tp", src=V, dst=P).backward()
        assert spmd.get_type(w.grad) == {"tp": P}
        got = denote(w.grad, mesh, {"tp": P})
        xs, w0 = denote(x, mesh, {"tp": V}), denote(w, mesh, {"tp": R})
    w0 = w0.detach().requires_grad_(True)
    sum(_in_place_program(xs[r], w0).sum() for r in range(2)).backward()
    torch.testing.assert_close(got, w0.grad)


def test_in_place_type_change_is_still_rejected_on_simulated_ranks():
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        w = spmd.assert_type(torch.nn.Parameter(random_value(mesh, {"tp": R}, (4, 4))), {"tp": R})
        r = w * 2
        with pytest.raises(spmd.SpmdTypeError) as err:
            r.add_(spmd.assert_type(random_value(mesh, {"tp": V}, (4, 4)), {"tp": V}))
    assert err.value.rule == (
        "An in-place op cannot change its tensor's type: Tensor.add_ would change its first operand from R to V "
        "on axis 'tp'."
    )


def test_backward_from_a_plain_value_reaches_checked_ops():
    """A loss computed from typed values with checking off is plain; its backward still runs on simulated ranks."""
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        w = spmd.assert_type(torch.nn.Parameter(random_value(mesh, {"tp": R}, (4, 4))), {"tp": R})
        x = spmd.assert_type(random_value(mesh, {"tp": V}, (3, 4), seed=1), {"tp": V})
        h = torch.relu(x @ w.t())  # checked: autograd saves the typed x and w
        with spmd.no_typecheck():
            loss = h.square().sum()
        assert spmd.get_type(loss) is None
        loss.backward()
        assert spmd.get_type(w) == {"tp": R} and spmd.get_type(x) == {"tp": V}  # classes given back
        assert spmd.get_type(w.grad) == {"tp": P}
        got = denote(w.grad, mesh, {"tp": P})
        xs, w0 = denote(x, mesh, {"tp": V}), denote(w, mesh, {"tp": R})
        assert spmd.get_type(x @ w) == {"tp": V}  # still typed and checked after the pass
    w0 = w0.detach().requires_grad_(True)
    sum(torch.relu(xs[r] @ w0.t()).square().sum() for r in range(2)).backward()
    torch.testing.assert_close(got, w0.grad)
