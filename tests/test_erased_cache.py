"""The erased path's cache (issue 15 item 7): a call seen before runs the call the full path made, unchecked.

Outside ``typecheck()`` a typed op on a plain tensor remembers the call its full path built, keyed by
everything that path reads (the arguments, the input's shape and dtype, the current mesh); the next call
with that key runs it directly. A hit must be the full path exactly: the same values, gradients, autograd
node, and the same errors. Each case below runs with the cache emptied before every call (the full path)
and warm (a hit), on a fake process group (deterministic collectives), and the two are compared.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import fake_world

import spmd_types as spmd
from spmd_types._comm import collectives, reinterpret_convert
from spmd_types._comm import erased as comm_call

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
N = 2
F32 = {"op_dtype": torch.float32}

# name: (call, input shape); every call names the axis "tp" (the group object is a case of its own below)
CASES = {
    "all_reduce P->I": (lambda x, a: spmd.all_reduce(x, a, src=P, dst=I), (4, 6)),
    "all_reduce P->R": (lambda x, a: spmd.all_reduce(x, a, src=P, dst=R), (4, 6)),
    "all_reduce P->R avg": (lambda x, a: spmd.all_reduce(x, a, src=P, dst=R, op="avg"), (4, 6)),
    "all_reduce V->I (two calls)": (lambda x, a: spmd.all_reduce(x, a, src=V, dst=I), (4, 6)),
    "reinterpret I->R": (lambda x, a: spmd.reinterpret(x, a, src=I, dst=R), (4, 6)),
    "reinterpret R->P": (lambda x, a: spmd.reinterpret(x, a, src=R, dst=P), (4, 6)),
    "reinterpret V->P": (lambda x, a: spmd.reinterpret(x, a, src=V, dst=P), (4, 6)),
    "convert I->R": (lambda x, a: spmd.convert(x, a, src=I, dst=R), (4, 6)),
    "convert R->I": (lambda x, a: spmd.convert(x, a, src=R, dst=I), (4, 6)),
    "convert R->S(0)": (lambda x, a: spmd.convert(x, a, src=R, dst=S(0)), (4, 6)),
    "convert I->S(-1)": (lambda x, a: spmd.convert(x, a, src=I, dst=S(-1)), (4, 6)),
    "convert R->V": (lambda x, a: spmd.convert(x, a, src=R, dst=V), (N, 6)),
    "convert R->P": (lambda x, a: spmd.convert(x, a, src=R, dst=P), (4, 6)),
    "convert S(1)->P": (lambda x, a: spmd.convert(x, a, src=S(1), dst=P), (4, 6)),
    "all_gather S(0)->R": (lambda x, a: spmd.all_gather(x, a, src=S(0), dst=R), (4, 6)),
    "all_gather S(-1)->I": (lambda x, a: spmd.all_gather(x, a, src=S(-1), dst=I), (4, 6)),
    "all_gather V->R": (lambda x, a: spmd.all_gather(x, a, src=V, dst=R), (4, 6)),
    "all_gather V->R gather_dim=1, stacked by an unsqueeze (two calls)": (
        lambda x, a: spmd.all_gather(x, a, src=V, dst=R, gather_dim=1), (4, 6)),
    "reduce_scatter P->S(0)": (lambda x, a: spmd.reduce_scatter(x, a, src=P, dst=S(0)), (4, 6)),
    "reduce_scatter P->S(1) avg": (lambda x, a: spmd.reduce_scatter(x, a, src=P, dst=S(1), op="avg"), (4, 6)),
    "reduce_scatter P->V": (lambda x, a: spmd.reduce_scatter(x, a, src=P, dst=V), (N, 6)),
    "reduce_scatter V->S(0) (two calls)": (lambda x, a: spmd.reduce_scatter(x, a, src=V, dst=S(0)), (4, 6)),
    "all_to_all S(0)->S(1)": (lambda x, a: spmd.all_to_all(x, a, src=S(0), dst=S(1)), (4, 6)),
    "all_to_all S(1)->S(1)": (lambda x, a: spmd.all_to_all(x, a, src=S(1), dst=S(1)), (4, 6)),
    "all_to_all V->V": (lambda x, a: spmd.all_to_all(x, a, src=V, dst=V), (4, 6)),
    "redistribute S(0)->R, backward op_dtype": (
        lambda x, a: spmd.redistribute(x, a, src=S(0), dst=R, backward_options=F32), (4, 6)),
    "redistribute P->S(0), backward op_dtype": (
        lambda x, a: spmd.redistribute(x, a, src=P, dst=S(0), backward_options=F32), (4, 6)),
    "redistribute I->R, backward op_dtype": (
        lambda x, a: spmd.redistribute(x, a, src=I, dst=R, backward_options=F32), (4, 6)),
}


@pytest.fixture
def tp():
    """A {"tp": group} mesh of N fake ranks, and an empty cache before and after."""
    fake_world(N)
    group = dist.new_group(list(range(N)))
    comm_call._ERASED.clear()
    with spmd.set_current_mesh({"tp": group}):
        yield group
    comm_call._ERASED.clear()


def _step(fn, axis, shape, cold: bool, dtype=torch.float32, create_graph: bool = False):
    """Forward and backward; ``cold`` empties the cache first, so the full path runs."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    if cold:
        comm_call._ERASED.clear()
    y = fn(x, axis)
    g = torch.randn(y.shape, dtype=y.dtype, requires_grad=create_graph)
    (gx,) = torch.autograd.grad(y, x, g, create_graph=create_graph)
    return (x, y, gx, g) if create_graph else (x, y, gx)


def _same(a, b) -> None:
    (xa, ya, ga), (xb, yb, gb) = a[:3], b[:3]
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    assert type(ya) is type(yb) is torch.Tensor
    assert ya.dtype == yb.dtype and ya.requires_grad == yb.requires_grad
    assert type(ya.grad_fn).__name__ == type(yb.grad_fn).__name__
    assert ya._is_view() == yb._is_view()
    assert (ya._base is xa) == (yb._base is xb)  # an alias of the input stays one


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("by", ["name", "group"])
def test_a_hit_is_the_full_path(tp, name, by):
    fn, shape = CASES[name]
    axis = "tp" if by == "name" else tp
    full = _step(fn, axis, shape, cold=True)
    _step(fn, axis, shape, cold=False)  # fills the cache
    assert comm_call._ERASED or "(two calls)" in name
    _same(full, _step(fn, axis, shape, cold=False))


@pytest.mark.parametrize("name, by_shape", [("all_reduce P->I", False), ("reinterpret I->R", False),
                                            ("convert I->R", False), ("all_gather S(0)->R", True),
                                            ("reduce_scatter P->S(0)", True), ("convert R->S(0)", True)])
def test_a_hit_runs_no_check(tp, name, by_shape, monkeypatch):
    """A hit runs no check; a call whose checks read the shape is keyed by it too."""
    fn, shape = CASES[name]
    _step(fn, "tp", shape, cold=True)

    def refuse(*args, **kwargs):
        raise AssertionError("the full path ran")

    for module in (collectives, reinterpret_convert):
        monkeypatch.setattr(module, "begin", refuse)
    _step(fn, "tp", shape, cold=False)
    if by_shape:
        with pytest.raises(AssertionError, match="the full path ran"):
            _step(fn, "tp", (8, 6), cold=False)
    else:
        _step(fn, "tp", (8, 6), cold=False)
        _step(fn, "tp", (3,), cold=False)


@pytest.mark.parametrize("name", ["all_reduce P->R", "reinterpret I->R", "all_gather S(0)->R", "all_to_all S(0)->S(1)"])
def test_double_backward_through_a_hit(tp, name):
    fn, shape = CASES[name]
    full = _step(fn, "tp", shape, cold=True, create_graph=True)
    _step(fn, "tp", shape, cold=False)
    hit = _step(fn, "tp", shape, cold=False, create_graph=True)
    _same(full, hit)
    assert full[2].requires_grad and hit[2].requires_grad  # the gradient g -> gx is itself differentiable
    (a,) = torch.autograd.grad(full[2], full[3], torch.ones_like(full[2]))
    (b,) = torch.autograd.grad(hit[2], hit[3], torch.ones_like(hit[2]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_options_on_a_narrow_input(tp):
    """bf16 with backward_options={"op_dtype": float32}: the dual casts, so the gradient runs the full dual."""
    fn, shape = CASES["redistribute S(0)->R, backward op_dtype"]
    full = _step(fn, "tp", shape, cold=True, dtype=torch.bfloat16)
    _step(fn, "tp", shape, cold=False, dtype=torch.bfloat16)
    hit = _step(fn, "tp", shape, cold=False, dtype=torch.bfloat16)
    _same(full, hit)
    assert hit[2].dtype == torch.bfloat16


def test_a_narrow_input_needing_a_gradient_is_still_refused(tp):
    """A bf16 all_reduce(P -> R) without no gradient runs; with one it needs backward_options, cached or not."""
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    for _ in range(2):
        spmd.all_reduce(x, "tp", src=P, dst=R)
    with pytest.raises(ValueError, match="backward_options=\\{'op_dtype': ...\\}"):
        spmd.all_reduce(x.requires_grad_(), "tp", src=P, dst=R)


def test_errors_that_depend_on_the_input_stay(tp):
    x = torch.randn(4, 6)
    for _ in range(2):
        spmd.reduce_scatter(x, "tp", src=P, dst=S(0))
    with pytest.raises(ValueError, match="not divisible by 2"):
        spmd.reduce_scatter(torch.randn(3, 6), "tp", src=P, dst=S(0))
    for _ in range(2):
        spmd.all_reduce(x, "tp", src=P, dst=R, op="avg")
    with pytest.raises(TypeError, match="op='avg' divides by the axis size"):
        spmd.all_reduce(torch.ones(4, 6, dtype=torch.int64), "tp", src=P, dst=R, op="avg")
    for _ in range(2):
        spmd.all_gather(x, "tp", src=S(1), dst=R)
    with pytest.raises(ValueError, match="names tensor dim 1, but the tensor has 1 dims"):
        spmd.all_gather(torch.randn(4), "tp", src=S(1), dst=R)


def test_bad_arguments_are_refused_as_before(tp):
    x = torch.randn(4, 6)
    with pytest.raises(TypeError, match="src must be an SPMD type"):
        spmd.all_reduce(x, "tp", src="P", dst=R)
    with pytest.raises(TypeError, match="src must be an SPMD type"):
        spmd.reinterpret(x, "tp", src=[P], dst=R)  # unhashable: no key, the full path
    with pytest.raises(spmd.SpmdTypeError):
        spmd.all_reduce(x, "tp", src=R, dst=I)
    with pytest.raises(ValueError):
        spmd.all_reduce(x, "nope", src=P, dst=I)


def test_another_mesh_is_another_key(tp):
    """The same axis name on another mesh (a group of another size) resolves again."""
    x = torch.randn(4, 6)
    assert spmd.all_gather(x, "tp", src=S(0), dst=R).shape == (8, 6)
    assert spmd.all_gather(x, "tp", src=S(0), dst=R).shape == (8, 6)
    fake_world(4)
    group4 = dist.new_group([0, 1, 2, 3])
    with spmd.set_current_mesh({"tp": group4}):
        assert spmd.all_gather(x, "tp", src=S(0), dst=R).shape == (16, 6)
        assert spmd.all_gather(x, "tp", src=S(0), dst=R).shape == (16, 6)


def test_checking_on_takes_the_full_path(tp):
    x = torch.randn(4, 6)
    for _ in range(2):
        assert spmd.get_type(spmd.reinterpret(x, "tp", src=I, dst=R)) is None
    with spmd.typecheck():
        typed = spmd.assert_type(torch.randn(4, 6), {"tp": I})
        assert spmd.get_type(spmd.reinterpret(typed, "tp", src=I, dst=R)) == {"tp": R}
        with pytest.raises(spmd.SpmdTypeError):
            spmd.reinterpret(spmd.assert_type(torch.randn(4, 6), {"tp": V}), "tp", src=I, dst=R)
        with pytest.raises(spmd.SpmdTypeError):  # strict: a plain input is refused under checking
            with spmd.typecheck(strict=True):
                spmd.reinterpret(x, "tp", src=I, dst=R)


def test_no_grad_and_parameters(tp):
    """A parameter, and calls under no_grad (the kernel runs without the Function), hit as the full path runs."""
    w = torch.nn.Parameter(torch.randn(4, 6))
    for fn in (lambda: spmd.all_gather(w, "tp", src=S(0), dst=R), lambda: spmd.reinterpret(w, "tp", src=I, dst=R)):
        for grad in (True, False):
            seen = []
            for cold in (True, False, False):
                if cold:
                    comm_call._ERASED.clear()
                with torch.set_grad_enabled(grad):
                    y = fn()
                seen.append((type(y), y.shape, y.requires_grad, y._is_view(), y._base is w, y is w,
                             type(y.grad_fn).__name__))
                torch.testing.assert_close(y, fn())
            assert seen[0] == seen[1] == seen[2]
