"""Custom autograd Functions: unregistered ones are refused, registered ones are typed by their claim.

The Functions here are written as Megatron's ``mappings.py`` writes them (the
group passed as an argument, an identity forward with an all-reduce backward
for copy-to, the reverse for reduce-from), on functional collectives so they
run on simulated ranks. A Megatron-style tensor-parallel MLP built from them
gives exactly the single-device gradient once registered.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import CommCounter, per_rank, rank_values, simulate, verify_registration

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
N = 4


def _all_reduce(x, group):
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _functions():
    """Fresh (unregistered) copy-to / reduce-from classes for each test."""

    class CopyToRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, g):
            return _all_reduce(g, ctx.group), None

    class ReduceFromRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return _all_reduce(x, group)

        @staticmethod
        def backward(ctx, g):
            return g, None

    return CopyToRegion, ReduceFromRegion


def _register(copy_cls, reduce_cls):
    group_arg = lambda args, kwargs: args[1]  # noqa: E731 - Megatron passes its group as the second argument
    spmd.register_autograd_function(copy_cls, op="reinterpret", axis=group_arg, src=I, dst=R)
    spmd.register_autograd_function(reduce_cls, op="all_reduce", axis=group_arg, src=V, dst=I)


@pytest.fixture
def tp4():
    return fake_mesh((N,), ("tp",))


# ---------------------------------------------------------------------------
# unregistered: refused inside typecheck, untouched outside


UNREGISTERED = """\
The custom autograd Function {name} is applied to typed tensors, but it is not registered: its backward is \
written by hand, so its forward ops do not say what its backward communicates, and typing it from the forward \
alone could hide a wrong gradient.
  function: test_autograd_functions._functions.<locals>.{name}
  at:       tests/test_autograd_functions.py:{line}: {code}
  fix:      spmd.register_autograd_function({name}, local=True)  # no communication in \
forward or backward
  or:       spmd.register_autograd_function({name}, op='all_reduce', axis='tp', \
src=spmd.P, dst=spmd.R)  # behaves like that spmd call
  or:       spmd.register_autograd_function({name}, rule=lambda *types: ...)  # output \
types from input types
  note:     check a registration in your tests with spmd.testing.verify_registration"""


def _line_of(code: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip() == code)


def test_unregistered_identity_forward_is_refused(tp4):
    # Its forward runs no op (it returns its input): refused at the output's first use, naming the apply line.
    copy_cls, _ = _functions()
    x = torch.randn(2, 8, requires_grad=True)
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        xt = spmd.assert_type(x, {"tp": I})
        y = copy_cls.apply(xt, tp4.get_group())
        with pytest.raises(spmd.SpmdTypeError) as err:
            y * 2
    code = "y = copy_cls.apply(xt, tp4.get_group())"
    want = UNREGISTERED.format(name="CopyToRegion", line=_line_of(code), code=code)
    assert err.value.plain == want


def test_unregistered_identity_forward_is_refused_at_the_end_of_typecheck(tp4):
    copy_cls, _ = _functions()
    with pytest.raises(spmd.SpmdTypeError, match="CopyToRegion is applied"):
        with spmd.set_current_mesh(tp4), spmd.typecheck():
            y = copy_cls.apply(spmd.assert_type(torch.randn(2, 8, requires_grad=True), {"tp": I}), tp4.get_group())
    assert y.grad_fn is not None  # kept alive to the end of the block, never used in it


def test_unregistered_forward_with_setup_context_is_refused(tp4):
    # No ctx argument: the class is found by its forward's code object.
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2

    with spmd.set_current_mesh(tp4), spmd.typecheck():
        xt = spmd.assert_type(torch.randn(2, 8, requires_grad=True), {"tp": I})
        with pytest.raises(spmd.SpmdTypeError, match="Scale is applied"):
            Scale.apply(xt)
        spmd.register_autograd_function(Scale, local=True)
        try:
            assert spmd.get_type(Scale.apply(xt)) == {"tp": I}
        finally:
            spmd.unregister_autograd_function(Scale)


def test_unregistered_communicating_forward_is_refused_before_communicating(tp4):
    _, reduce_cls = _functions()
    with LocalTensorMode(N), spmd.set_current_mesh(tp4), spmd.typecheck():
        xt = spmd.assert_type(per_rank(lambda r: torch.full((2,), float(r))), {"tp": V})
        with CommCounter() as comms, pytest.raises(spmd.SpmdTypeError, match="ReduceFromRegion is applied"):
            reduce_cls.apply(xt, tp4.get_group())
        assert comms.total == 0


def test_unregistered_is_refused_without_grad_too(tp4):
    """A Function's forward always runs with grad mode off, whether or not its inputs need a gradient."""
    _, reduce_cls = _functions()
    with LocalTensorMode(N), spmd.set_current_mesh(tp4), spmd.typecheck():
        xt = spmd.assert_type(per_rank(lambda r: torch.full((2,), float(r))), {"tp": V})
        with pytest.raises(spmd.SpmdTypeError, match="ReduceFromRegion is applied"):
            reduce_cls.apply(xt, tp4.get_group())


def test_unregistered_identity_without_grad_passes_its_input_through(tp4):
    # It runs no op and no backward will run: the input comes back as it was, type included (docs/choices.md).
    copy_cls, _ = _functions()
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        xt = spmd.assert_type(torch.randn(2, 8), {"tp": I})
        y = copy_cls.apply(xt, tp4.get_group())
        assert spmd.get_type(y * 2) == {"tp": I}


def test_unregistered_runs_untouched_outside_typecheck(tp4):
    copy_cls, _ = _functions()
    x = torch.randn(2, 8, requires_grad=True)
    y = copy_cls.apply(x, tp4.get_group())
    assert type(y) is torch.Tensor and torch.equal(y, x)


def test_no_grad_typed_ops_outside_functions_pass(tp4):
    """Grad mode off alone (an optimizer step, an eval loop) is not a custom Function."""
    with spmd.set_current_mesh(tp4), spmd.typecheck(), torch.no_grad():
        xt = spmd.assert_type(torch.randn(2, 8), {"tp": V})
        assert spmd.get_type(xt * 2 + xt) == {"tp": V}


# ---------------------------------------------------------------------------
# registered: a Megatron-style TP MLP equals one device


def _tp_mlp(copy_cls, reduce_cls, x, w1, w2, group):
    h = copy_cls.apply(x, group)  # I -> R: identity forward, all-reduce backward
    h = F.gelu(torch.matmul(h, w1))  # column parallel: w1 sharded on its output dim
    out = torch.matmul(h, w2)  # row parallel: per-rank partial products (V)
    return reduce_cls.apply(out, group)  # V -> I: all-reduce forward, identity backward


def test_registered_tp_mlp_gives_the_single_device_gradient(tp4):
    copy_cls, reduce_cls = _functions()
    _register(copy_cls, reduce_cls)
    torch.manual_seed(0)
    x0, w1_full, w2_full = (torch.randn(*s, dtype=torch.float64) for s in ((3, 8), (8, 16), (16, 8)))
    x_ref, w1_ref, w2_ref = (t.clone().requires_grad_() for t in (x0, w1_full, w2_full))
    loss_ref = (F.gelu(x_ref @ w1_ref) @ w2_ref).pow(2).sum()
    loss_ref.backward()
    with LocalTensorMode(N), spmd.set_current_mesh(tp4), spmd.typecheck():
        x = per_rank(lambda r: x0.clone()).requires_grad_()
        w1 = per_rank(lambda r: w1_full.chunk(N, 1)[r].clone()).requires_grad_()
        w2 = per_rank(lambda r: w2_full.chunk(N, 0)[r].clone()).requires_grad_()
        xt = spmd.assert_type(x, {"tp": I})
        out = _tp_mlp(copy_cls, reduce_cls, xt, spmd.assert_type(w1, {"tp": S(1)}),
                      spmd.assert_type(w2, {"tp": S(0)}), tp4.get_group())
        assert spmd.get_type(out) == {"tp": I}
        loss = out.pow(2).sum()
        with CommCounter() as comms:
            loss.backward()
        assert comms.counts == {"all_reduce": 1}  # copy-to's backward, once
        for r in range(N):
            torch.testing.assert_close(rank_values(loss)[r], loss_ref.detach())
            torch.testing.assert_close(rank_values(x.grad)[r], x_ref.grad)
            torch.testing.assert_close(rank_values(w1.grad)[r], w1_ref.grad.chunk(N, 1)[r])
            torch.testing.assert_close(rank_values(w2.grad)[r], w2_ref.grad.chunk(N, 0)[r])


def test_registered_claim_checks_the_input_type(tp4):
    copy_cls, reduce_cls = _functions()
    _register(copy_cls, reduce_cls)
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        xt = spmd.assert_type(torch.randn(2, 8), {"tp": R})
        with pytest.raises(spmd.SpmdTypeError, match=r"spmd.reinterpret's src= must be the input's type on the "
                           r"axis: src=I, but the tensor is R on axis 'tp'"):
            copy_cls.apply(xt, tp4.get_group())


def test_registered_runs_plain_outside_typecheck(tp4):
    copy_cls, reduce_cls = _functions()
    _register(copy_cls, reduce_cls)
    x = torch.randn(2, 8)
    y = copy_cls.apply(x, tp4.get_group())
    assert type(y) is torch.Tensor and torch.equal(y, x)


def test_axis_by_name_and_by_group(tp4):
    copy_cls, reduce_cls = _functions()
    spmd.register_autograd_function(copy_cls, op="reinterpret", axis="tp", src=I, dst=R)
    spmd.register_autograd_function(reduce_cls, op="all_reduce", axis=tp4.get_group(), src=V, dst=I)
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        xt = spmd.assert_type(torch.randn(2, 8), {"tp": I})
        assert spmd.get_type(copy_cls.apply(xt, tp4.get_group())) == {"tp": R}
        vt = spmd.assert_type(torch.randn(2, 8), {"tp": V})
        assert spmd.get_type(reduce_cls.apply(vt, tp4.get_group())) == {"tp": I}


def test_decorator_local_rule_and_reregistration(tp4):
    @spmd.register_autograd_function(local=True)
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    with spmd.set_current_mesh(tp4), spmd.typecheck():
        v = spmd.assert_type(torch.randn(4), {"tp": V})
        r = spmd.assert_type(torch.randn(4), {"tp": R})
        i = spmd.assert_type(torch.randn(4), {"tp": I})
        assert spmd.get_type(Square.apply(v)) == {"tp": V}
        assert spmd.get_type(Square.apply(r)) == {"tp": R}
        p = spmd.reinterpret(v, "tp", src=V, dst=P)
        with pytest.raises(spmd.SpmdTypeError, match=r"^Square.apply is not linear in input, so input cannot be a pending sum"):
            Square.apply(p)
        spmd.register_autograd_function(Square, rule=lambda t: {"tp": I} if t["tp"] is I else {"tp": V})
        assert spmd.get_type(Square.apply(i)) == {"tp": I}
        assert spmd.get_type(Square.apply(r)) == {"tp": V}
    spmd.unregister_autograd_function(Square)
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        with pytest.raises(spmd.SpmdTypeError, match="Square is applied to typed tensors"):
            Square.apply(spmd.assert_type(torch.randn(4), {"tp": V}))


def test_transparent_forward_is_checked_op_by_op(tp4):
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g, g

    spmd.register_autograd_function(Twice, transparent=True)
    with spmd.set_current_mesh(tp4), spmd.typecheck():
        v = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": V})
        assert spmd.get_type(Twice.apply(v, v)) == {"tp": V}
        i = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
        with pytest.raises(spmd.SpmdTypeError, match=r"Invariant \(I\) values only combine"):
            Twice.apply(v, i)


@pytest.mark.parametrize(
    "kwargs,err,message",
    [
        ({}, TypeError, "register_autograd_function takes exactly one of local=True, op=... (with axis, src, dst), "
                        "rule=... or transparent=True; got none; or give CopyToRegion a typecheck_forward staticmethod"),
        ({"local": True, "rule": len}, TypeError, "register_autograd_function takes exactly one of local=True, "
         "op=... (with axis, src, dst), rule=... or transparent=True; got local, rule"),
        ({"op": "all_reduce", "src": P, "dst": R}, TypeError, "register_autograd_function: op=... needs axis= (a mesh "
         "axis name, a ProcessGroup, or a callable (args, kwargs) -> axis)"),
        ({"op": "psum", "axis": "tp", "src": P, "dst": R}, ValueError, "register_autograd_function: op must be one of "
         "reinterpret, convert, all_reduce, all_gather, reduce_scatter, all_to_all; got 'psum'"),
        ({"op": "all_reduce", "axis": "tp", "src": "P", "dst": R}, TypeError, "register_autograd_function: src must "
         "be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or spmd.S(d)), got 'P' of type str"),
        ({"op": "all_gather", "axis": "tp", "src": P, "dst": R}, ValueError, "register_autograd_function: "
         "spmd.all_gather has no src=P -> dst=R (allowed: V -> R, V -> I)"),
        ({"local": True, "axis": "tp"}, TypeError, "register_autograd_function: axis go with op=..., not with local"),
        ({"rule": 3}, TypeError, "register_autograd_function: rule must be callable, got 3"),
    ],
)
def test_bad_registrations(kwargs, err, message):
    copy_cls, _ = _functions()
    with pytest.raises(err) as info:
        spmd.register_autograd_function(copy_cls, **kwargs)
    assert str(info.value) == message


def test_registering_a_non_function_is_refused():
    with pytest.raises(TypeError, match="takes a torch.autograd.Function subclass, got <class 'int'>"):
        spmd.register_autograd_function(int, local=True)


# ---------------------------------------------------------------------------
# verify_registration: right claims pass, wrong claims are caught


def test_verify_right_claims(tp4):
    copy_cls, reduce_cls = _functions()
    _register(copy_cls, reduce_cls)
    group = tp4.get_group()
    report = verify_registration(copy_cls, (torch.empty(3, 8), group), mesh=tp4, in_types=[{"tp": I}])
    assert (report.forward_comms, report.backward_comms, report.out_types) == ({}, {"all_reduce": 1}, {"tp": R})
    report = verify_registration(reduce_cls, (torch.empty(3, 8), group), mesh=tp4, in_types=[{"tp": V}])
    assert (report.forward_comms, report.backward_comms, report.out_types) == ({"all_reduce": 1}, {}, {"tp": I})


def test_verify_catches_a_backward_that_also_all_reduces(tp4):
    class ReduceFromTwice(torch.autograd.Function):  # the bug: backward all-reduces an already summed gradient
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return _all_reduce(x, group)

        @staticmethod
        def backward(ctx, g):
            return _all_reduce(g, ctx.group), None

    spmd.register_autograd_function(ReduceFromTwice, op="all_reduce", axis=lambda a, k: a[1], src=V, dst=I)
    with pytest.raises(AssertionError, match="ReduceFromTwice: input gradient differs from the backward of "
                       "spmd.all_reduce"):
        verify_registration(ReduceFromTwice, (torch.empty(3, 8), tp4.get_group()), mesh=tp4, in_types=[{"tp": V}])


def test_verify_catches_a_wrong_forward_claim(tp4):
    copy_cls, _ = _functions()  # identity forward, claimed to be an all-reduce
    spmd.register_autograd_function(copy_cls, op="all_reduce", axis="tp", src=V, dst=I)
    with pytest.raises(AssertionError, match="CopyToRegion: its output is not a value of type"):
        verify_registration(copy_cls, (torch.empty(3, 8), tp4.get_group()), mesh=tp4, in_types=[{"tp": V}])


def test_verify_catches_communication_in_a_local_claim(tp4):
    _, reduce_cls = _functions()
    spmd.register_autograd_function(reduce_cls, local=True)
    with pytest.raises(AssertionError, match="ReduceFromRegion is registered local=True"):
        verify_registration(reduce_cls, (torch.empty(3, 8), tp4.get_group()), mesh=tp4, in_types=[{"tp": R}])


def test_verify_a_backward_that_all_reduces_its_gradient_in_place(tp4):
    """Megatron's copy-to all-reduces the incoming gradient in place: the reference run gets its own copy."""
    import torch.distributed as dist

    class CopyToInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, g):
            dist.all_reduce(g, group=ctx.group)
            return g, None

    spmd.register_autograd_function(CopyToInPlace, op="reinterpret", axis=lambda a, k: a[1], src=I, dst=R)
    report = verify_registration(CopyToInPlace, (torch.empty(3, 8), tp4.get_group()), mesh=tp4, in_types=[{"tp": I}])
    assert report.backward_comms == {"all_reduce": 1}


def test_a_registered_functions_backward_gets_plain_gradients():
    """Found by the nightly fuzzer: a transparent Function's backward computes its input gradient from saved typed
    values, so it comes out typed (by the forward rules); the next registered Function's hand-written backward
    (a raw reduce-scatter) then met a typed I gradient and was refused. Its backward now gets plain gradients, as
    its forward got plain inputs."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import fuzz_functions as ff

    full = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with simulate((2,), ("tp",), ranks="local", device="cpu") as mesh, spmd.typecheck():
        x = spmd.assert_type(per_rank(lambda r: full.chunk(2, 0)[r].clone()).requires_grad_(), {"tp": V})
        y = ff.CheckpointedSilu.apply(ff.GatherFromRegion.apply(x, mesh.get_group("tp")))
        assert spmd.get_type(y) == {"tp": I}
        y.sum().backward()
        grads = rank_values(x.grad)
    ref = full.clone().requires_grad_()
    torch.nn.functional.silu(ref).sum().backward()
    torch.testing.assert_close(torch.cat([grads[0], grads[1]]), ref.grad)
