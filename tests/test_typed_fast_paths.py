"""The typed step's fast paths answer exactly what the full paths answer.

* A typed tensor's metadata (``_checker/metadata_reads.py``): read without ``__torch_function__``,
  the same values; setting and deleting still go through it; compiling and the rank simulator read
  through it.
* The unregistered-Function guard (``_guards/function_guard.py``): the second op of one running frame
  reuses the first op's answer; a transparent Function inside an unregistered one is still refused;
  the frame held is dropped when ``typecheck()`` ends.
* A registered Function's forward and backward run with subclass dispatch off
  (``_boundaries/autograd_functions.py``): its body sees plain tensors (what it saved of its typed
  inputs included), its output is typed by its registration, gradients are the plain run's.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from conftest import fake_mesh

import spmd_types as spmd
from spmd_types._checker import tensor as _tensor
from spmd_types._checker.metadata_reads import FAST_ATTRIBUTES, FAST_SETS
from spmd_types._guards import function_guard
from spmd_types.testing import simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@contextlib.contextmanager
def _registered(cls: type, **claim):
    """``cls`` registered with ``claim`` for the block, unregistered after it."""
    spmd.register_autograd_function(cls, **claim)
    try:
        yield cls
    finally:
        spmd.unregister_autograd_function(cls)


@pytest.fixture
def tp4():
    return fake_mesh((4,), ("tp",))


@pytest.fixture
def torch_function_calls(monkeypatch):
    """The names of the functions LTensor's ``__torch_function__`` is called with."""
    seen: list[str] = []
    full = _tensor.LTensor.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return full(cls, func, types, args, kwargs)

    monkeypatch.setattr(_tensor.LTensor, "__torch_function__", classmethod(counting))
    return seen


def _reads(t: torch.Tensor) -> dict:
    return {name: getattr(t, name) for name in FAST_ATTRIBUTES}


def test_metadata_reads_skip_torch_function_and_answer_as_a_plain_tensor(tp4, torch_function_calls):
    x = torch.randn(4, 6, requires_grad=True)
    (x * 2).sum().backward()
    plain = _reads(x)
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        t = spmd.assert_type(x, {"tp": R})
        del torch_function_calls[:]  # assert_type's own (the gradient's typing hook)
        typed = _reads(t)
    assert torch_function_calls == []
    assert typed.keys() == plain.keys()
    for name, value in plain.items():
        assert (typed[name] is value) if name == "grad" else (typed[name] == value), name


def test_setting_grad_and_requires_grad_skips_torch_function_other_sets_and_deletes_do_not(tp4, torch_function_calls):
    # the sets answered without __torch_function__ are rows that check nothing
    assert all(getattr(torch.Tensor, name).__set__ in _tensor._UNCHECKED for name in FAST_SETS)
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        t = spmd.assert_type(torch.randn(4, 6, requires_grad=True), {"tp": R})
        g = spmd.assert_type(torch.ones(4, 6), {"tp": P})
        del torch_function_calls[:]
        t.grad = g
        assert t.grad is g
        t.grad = None  # what zero_grad() does to every parameter
        assert t.grad is None
        t.requires_grad = False
        assert not t.requires_grad
        t.grad = g
        assert torch_function_calls == []
        del t.grad
        assert t.grad is None
        with pytest.raises(AttributeError):
            t.dtype = torch.float64  # torch refuses it before any dispatch
    assert torch_function_calls == ["__delete__"]


def test_metadata_of_a_non_leaf_and_of_a_view(tp4):
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        t = spmd.assert_type(torch.randn(4, 6, requires_grad=True), {"tp": R})
        y = (t * 2).view(24)
        assert (y.is_leaf, y.requires_grad, y.shape, y.ndim) == (False, True, torch.Size([24]), 1)
        assert spmd.get_type(y) == {"tp": R}


def test_metadata_reads_on_simulated_ranks():
    with simulate((2,), ("tp",)), spmd.typecheck():
        t = spmd.assert_type(torch.randn(4, 6, requires_grad=True), {"tp": V})
        y = t * 2
        assert (y.shape, y.dtype, y.requires_grad, y.is_leaf, t.is_leaf) == (torch.Size([4, 6]), torch.float32, True,
                                                                              False, True)
        assert spmd.get_type(y) == {"tp": V}


def test_dynamo_sees_torch_s_own_attributes():
    # torch.compile's tracer compares a subclass's attribute with torch.Tensor's to decide whether it is overridden
    from spmd_types._checker.tensor import LTensor

    for name in FAST_ATTRIBUTES:
        assert not (inspect.getattr_static(LTensor, name) != getattr(torch.Tensor, name)), name


def test_metadata_read_under_compile_tells_the_compile_room(tp4):
    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x * x.shape[0] + x.size(1)

    with spmd.set_current_mesh(tp4), spmd.typecheck():
        t = spmd.assert_type(torch.randn(4, 6), {"tp": V})
        out = f(t)
    assert spmd.get_type(out) == {"tp": V}
    torch.testing.assert_close(out, t.detach().as_subclass(torch.Tensor) * 4 + 6)


# ---------------------------------------------------------------------------
# the unregistered-Function guard


def test_guard_reuses_its_answer_within_one_running_frame(tp4, monkeypatch):
    searches = []
    full = function_guard._search
    monkeypatch.setattr(function_guard, "_search", lambda frame: searches.append(1) or full(frame))

    class Three(torch.autograd.Function):  # a transparent forward: three checked ops, one search
        @staticmethod
        def forward(ctx, x):
            return (x * 2 + 1).relu()

        @staticmethod
        def backward(ctx, g):
            return g

    with _registered(Three, transparent=True):
        with spmd.set_current_mesh(tp4), spmd.typecheck():
            x = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": V})
            assert spmd.get_type(Three.apply(x)) == {"tp": V}
            assert function_guard._LAST.frame is not None
        assert function_guard._LAST.frame is None  # dropped with typecheck()
    assert len(searches) == 1


def test_guard_still_refuses_a_transparent_function_inside_an_unregistered_one(tp4):
    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Outer(torch.autograd.Function):  # unregistered: its backward is hand-written
        @staticmethod
        def forward(ctx, x):
            y = x + 1
            return Inner.apply(y)

        @staticmethod
        def backward(ctx, g):
            return g

    with _registered(Inner, transparent=True):
        with spmd.set_current_mesh(tp4), spmd.typecheck():
            x = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": V})
            with pytest.raises(spmd.SpmdTypeError, match="The custom autograd Function Outer is applied to typed"):
                Inner.apply(x)  # the guard's answer for this frame: no Function forward on the stack
                Outer.apply(x)


def test_guard_searches_a_generator_frame_every_time(tp4):
    # A generator's frame resumes under whoever calls next(): first inside a registered Function's forward,
    # then inside an unregistered one's, where its op must be refused (a reused answer would let it through).
    def ops(x):
        yield x * 2
        yield x * 3

    class Allowed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gen):
            return next(gen)

        @staticmethod
        def backward(ctx, g):
            return None

    class Unregistered(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gen):
            return next(gen)

        @staticmethod
        def backward(ctx, g):
            return None

    with _registered(Allowed, transparent=True):
        with spmd.set_current_mesh(tp4), spmd.typecheck():
            gen = ops(spmd.assert_type(torch.randn(4), {"tp": V}))
            assert spmd.get_type(Allowed.apply(gen)) == {"tp": V}
            with pytest.raises(spmd.SpmdTypeError, match="The custom autograd Function Unregistered is applied"):
                Unregistered.apply(gen)


# ---------------------------------------------------------------------------
# a registered Function runs as written


def test_registered_function_sees_plain_tensors_forward_and_backward(tp4):
    seen = {}

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            seen["forward"] = (type(x), type(w))
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            seen["backward"] = (type(g), type(g * w), type(g * x))
            return g * w, g * x

    def rule(x, w):
        return x

    with _registered(Scale, rule=rule):
        x0, w0 = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        (x0 * w0).sum().backward()
        x, w = x0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
        with spmd.set_current_mesh(tp4), spmd.typecheck():
            xt = spmd.assert_type(x, {"tp": V})
            wt = spmd.assert_type(w, {"tp": V})
            out = Scale.apply(xt, wt)
            assert spmd.get_type(out) == {"tp": V}
            out.sum().backward()
    typed = type(xt)
    assert seen["forward"] == (typed, typed)  # the typed objects themselves, seen as plain by their ops
    assert seen["backward"] == (torch.Tensor, torch.Tensor, torch.Tensor)  # every op in backward ran plain
    assert torch.equal(x.grad, x0.grad) and torch.equal(w.grad, w0.grad)


def test_registered_identity_forward_output_is_a_new_typed_tensor(tp4):
    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g * 4  # an all-reduce over tp's 4 ranks, on a fake group

    with _registered(Copy, op="reinterpret", axis="tp", src=I, dst=R):
        with spmd.set_current_mesh(tp4), spmd.typecheck():
            x = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
            y = Copy.apply(x)
            assert y is not x and spmd.get_type(x) == {"tp": I} and spmd.get_type(y) == {"tp": R}


def test_an_op_s_numbers_and_an_in_place_op_s_destination_come_back_as_the_full_path_gives_them(tp4, monkeypatch):
    """tolist() gives numbers: the list comes back as it is, not rebuilt number by number; an in-place op gives
    its typed destination, without _wrap's call."""
    wrapped = []
    wrap = _tensor._wrap
    monkeypatch.setattr(_tensor, "_wrap", lambda out, types: wrapped.append(type(out).__name__) or wrap(out, types))
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        x = spmd.assert_type(torch.arange(6.0).view(2, 3), {"tp": R})
        row = x[0].tolist()
        assert row == [0.0, 1.0, 2.0] and (x[0] > 1).tolist() == [False, False, True]
        assert wrapped == ["list", "list"]  # one call each, none per number
        wrapped.clear()
        assert x.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and wrapped == ["list"] * 3  # the rows, as rows
        wrapped.clear()
        y = x.clone()
        assert y.mul_(2) is y and spmd.get_type(y) == {"tp": R} and wrapped == []
        parts = x.split(1)  # a tuple of tensors: typed in place by _wrap
        assert [spmd.get_type(p) for p in parts] == [{"tp": R}] * 2 and wrapped == ["tuple"]
