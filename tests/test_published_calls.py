"""The published API's call shapes on the typed ops, each called as the peer's docs or torchtitan call it.

Stacking: ``all_gather(src=V, gather_dim=d)`` stacks the ranks' values on a new dim d,
``reduce_scatter(dst=V, scatter_dim=d)`` takes this rank's entry of dim d, ``all_to_all`` V -> V on two dims
unbinds and stacks (values checked on simulated ranks, gradients by the adjoint identity). Split sizes with S(0)
or one side given; ``async_op=``; ``expert_mode=``; the published keyword names; ``reinterpret_no_grad``;
``register_no_typecheck``; ``set_dist``; ``spmd_redistribute``; the error classes; types given outside
``typecheck()`` read and changed by ``get_axis_local_type`` / ``mutate_type``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

import spmd_types as spmd
from spmd_types.testing import per_rank, rank_values, simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
PS = spmd.PartitionSpec
N = 4


@pytest.fixture
def ranks():
    """tp=4 on simulated ranks (every rank's values computed), current, local SPMD checking."""
    with simulate((N,), ("tp",), ranks="local", device="cpu") as mesh, spmd.typecheck():
        yield mesh


def _values(t: torch.Tensor) -> list[torch.Tensor]:
    return [v for _, v in sorted(rank_values(t).items())]


def _pair(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(sum((x * y).sum() for x, y in zip(_values(a), _values(b))))


def test_all_gather_of_v_stacks_on_gather_dim(ranks):
    x = spmd.assert_type(per_rank(lambda r: torch.arange(6.0).reshape(2, 3) + 10 * r), {"tp": V})
    y = spmd.all_gather(x, "tp", src=V, dst=R, gather_dim=1)
    want = torch.stack([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(N)], dim=1)
    assert y.shape == (2, N, 3) and spmd.get_type(y) == {"tp": R}
    assert all(torch.equal(v, want) for v in _values(y))
    last = spmd.all_gather(x, "tp", src=V, dst=I, gather_dim=-1)  # a new last dim
    assert last.shape == (2, 3, N) and torch.equal(_values(last)[0], torch.stack(_values(x), dim=-1))


def test_reduce_scatter_to_v_unstacks_scatter_dim(ranks):
    x = spmd.assert_type(per_rank(lambda r: torch.arange(2.0 * N * 3).reshape(2, N, 3) * (r + 1)), {"tp": P})
    y = spmd.reduce_scatter(x, "tp", src=P, dst=V, scatter_dim=1)
    total = torch.arange(2.0 * N * 3).reshape(2, N, 3) * sum(r + 1 for r in range(N))
    assert y.shape == (2, 3) and spmd.get_type(y) == {"tp": V}
    assert all(torch.equal(v, total[:, r]) for r, v in enumerate(_values(y)))
    with pytest.raises(ValueError) as info:
        spmd.reduce_scatter(spmd.assert_type(torch.randn(2, 3), {"tp": P}), "tp", src=P, dst=V, scatter_dim=1)
    assert str(info.value) == ("spmd.reduce_scatter: a V side stacks the ranks' values on scatter_dim=1, so dim 1 "
                               "must have one entry per rank of axis 'tp' (4); got shape [2, 3]")


def test_stacking_gather_and_unstacking_scatter_are_adjoint(ranks):
    """``<all_gather(dx), g>_R == <dx, grad>_V``: the backward of the stacking gather is the unstacking scatter."""
    x = spmd.assert_type(per_rank(lambda r: torch.randn(2, 3, generator=torch.Generator().manual_seed(r))), {"tp": V})
    x.requires_grad_(True)
    y = spmd.all_gather(x, "tp", src=V, dst=R, gather_dim=1)
    g = spmd.assert_type(per_rank(lambda r: torch.randn(2, N, 3, generator=torch.Generator().manual_seed(9 + r))),
                         {"tp": P})
    y.backward(g)
    lhs = _pair(x.grad, x.detach())
    with torch.no_grad():
        rhs = float((sum(_values(g)) * _values(y)[0]).sum())  # <g (pending sum), y (one value)>
    assert lhs == pytest.approx(rhs, rel=1e-5)


def test_all_to_all_v_on_two_dims_unbinds_and_stacks(ranks):
    x = spmd.assert_type(per_rank(lambda r: torch.arange(N * 3.0).reshape(N, 3) + 100 * r), {"tp": V})
    y = spmd.all_to_all(x, "tp", src=V, dst=V, split_dim=0, concat_dim=1)
    assert y.shape == (3, N)
    for r, v in enumerate(_values(y)):
        assert torch.equal(v, torch.stack([_values(x)[j][r] for j in range(N)], dim=1))


def test_all_to_all_split_sizes_with_s0_or_one_side(ranks):
    x = spmd.assert_type(per_rank(lambda r: torch.arange(8.0) + 10 * r), {"tp": S(0)})
    out = spmd.all_to_all(x, "tp", src=S(0), dst=S(0), input_split_sizes=[1, 3, 2, 2], output_split_sizes=[1, 1, 1, 1])
    assert [v.tolist() for v in _values(out)][0] == [0.0, 10.0, 20.0, 30.0]
    even = spmd.all_to_all(x, "tp", src=V, dst=V, output_split_sizes=[2, 2, 2, 2])  # input side: even pieces
    assert _values(even)[1].tolist() == [2.0, 3.0, 12.0, 13.0, 22.0, 23.0, 32.0, 33.0]


def test_async_op_defers_the_wait_outside_checking_and_types_inside():
    with simulate((N,), ("tp",), ranks="local", device="cpu"):
        x = per_rank(lambda r: torch.full((3,), float(r)))
        y = spmd.all_reduce(x, "tp", src=P, dst=R, async_op=True)
        assert isinstance(y, AsyncCollectiveTensor) and _values(y + 0)[2].tolist() == [6.0, 6.0, 6.0]
        g = spmd.all_gather(x, "tp", src=V, dst=R, async_op=True)
        assert isinstance(g, AsyncCollectiveTensor) and (g + 0).shape == (N, 3)
        with spmd.typecheck():
            spmd.assert_type(x, {"tp": P})
            z = spmd.all_reduce(x, "tp", src=P, dst=R, async_op=True)
            assert spmd.get_type(z) == {"tp": R} and _values(z)[0].tolist() == [6.0, 6.0, 6.0]
            for op in (spmd.reinterpret, spmd.convert):
                assert spmd.get_type(op(z, "tp", src=R, dst=I, async_op=True)) == {"tp": I}
        with pytest.raises(TypeError) as info:
            spmd.all_reduce(x, "tp", src=P, dst=R, async_op="yes")
    assert str(info.value) == "spmd.all_reduce: async_op= takes True or False, got 'yes'"


def test_expert_mode_is_accepted(ranks):
    """The published API gates R->I, R->P, I->R and R->V behind expert_mode=True; seed 003 allows them (choice 49)."""
    x = spmd.assert_type(torch.randn(N, 2), {"tp": R})
    assert spmd.get_type(spmd.reinterpret(x, "tp", src=R, dst=P, expert_mode=True)) == {"tp": P}
    assert spmd.get_type(spmd.reinterpret(x, "tp", src=R, dst=P)) == {"tp": P}
    assert spmd.get_type(spmd.convert(x, "tp", src=R, dst=V, expert_mode=True)) == {"tp": V}


def test_the_published_keyword_names(ranks):
    x = spmd.assert_type(tensor=torch.randn(N, 2), type={"tp": R})
    assert spmd.get_local_type(value=x) == {spmd.normalize_axis("tp"): R}
    assert spmd.get_axis_local_type(tensor=x, axis="tp") is R and spmd.maybe_get_axis_local_type(tensor=x, axis="tp")
    assert spmd.has_local_type(tensor=x) and spmd.get_partition_spec(tensor=x) is None
    y = spmd.assert_local_type(tensor=torch.randn(2), type={"tp": I})
    spmd.assert_type_like(tensor=torch.randn(2), source=y)
    spmd.assert_local_type_like(tensor=torch.randn(2), source=y, overrides={"tp": R})
    assert spmd.reinterpret_mesh(tensor=x, type=spmd.current_mesh(), inplace=True) is x
    with spmd.set_current_mesh(axes=ranks):
        assert spmd.types.to_local_type(typ=S(0)) is V
    with pytest.raises(TypeError) as info:
        spmd.assert_type(x, {"tp": R}, type={"tp": R})
    assert str(info.value) == "assert_type: the type is given twice, by position and as type="


def test_assert_type_like_overrides_by_any_key(ranks):
    src = spmd.assert_type(torch.randn(4), {"tp": V})
    out = spmd.assert_type_like(torch.randn(4), src, {ranks.get_group("tp"): R})  # a group replaces the name's V
    assert spmd.get_type(out) == {"tp": R}


def test_reinterpret_no_grad(ranks):
    mask = spmd.assert_type(torch.ones(4), {"tp": R})
    assert spmd.reinterpret_no_grad(mask, "tp", dst=I) is mask and spmd.get_type(mask) == {"tp": I}
    cases = [
        (lambda: spmd.reinterpret_no_grad(spmd.assert_type(torch.ones(2, requires_grad=True), {"tp": R}), "tp", dst=I),
         ValueError, "reinterpret_no_grad needs a tensor that does not require grad (R and I differ only in their "
         "gradient); use spmd.convert(x, axis, src=..., dst=...) for one that does"),
        (lambda: spmd.reinterpret_no_grad(mask, "tp", dst=P), ValueError,
         "reinterpret_no_grad changes R to I or I to R; got dst=P"),
        (lambda: spmd.reinterpret_no_grad(spmd.assert_type(torch.ones(2), {"tp": V}), "tp", dst=R), spmd.SpmdTypeError,
         "reinterpret_no_grad changes R to I or I to R, and the tensor is V on axis tp"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc) as info:
            call()
        assert str(info.value) == text


def _stats(x):
    return (x * x).sum()


def test_register_no_typecheck_leaves_a_function_unchecked_however_reached(ranks):
    alias = _stats
    x = spmd.assert_type(torch.randn(4), {"tp": P})
    with pytest.raises(spmd.SpmdTypeError):
        alias(x)  # P * P is not linear
    assert spmd.register_no_typecheck(_stats) is _stats
    try:
        out = alias(x)  # through another name: unchecked, the result plain
        assert spmd.get_type(out) is None
        assert spmd.get_type(x * 2) == {"tp": P}  # outside it, checked as before
    finally:
        from spmd_types._guards.unchecked_code import UNCHECKED_CODES

        UNCHECKED_CODES.discard(_stats.__code__)
    with pytest.raises(TypeError) as info:
        spmd.register_no_typecheck(len)
    assert str(info.value) == "register_no_typecheck takes a Python function, got <built-in function len>"


def test_set_dist():
    spmd.set_dist(None)
    spmd.set_dist(dist)
    with pytest.raises(NotImplementedError) as info:
        spmd.set_dist(object())
    assert str(info.value) == ("spmd_types.set_dist(module) is not built: this package's collectives are functional "
                               "collectives (torch.ops._c10d_functional), not torch.distributed calls that another "
                               "module could replace")


def test_spmd_redistribute_moves_a_dtensor_between_shardings():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from spmd_types.types import TensorSharding

    with simulate((N,), ("tp",), ranks="local", device="cpu") as mesh:
        full = torch.arange(8.0 * 2).reshape(8, 2)
        x = DTensor.from_local(per_rank(lambda r: full[2 * r:2 * r + 2]), mesh, (Shard(0),))
        y = spmd.spmd_redistribute(x, TensorSharding("tp"), TensorSharding())
        assert y.placements == (Replicate(),) and torch.equal(_values(y.to_local())[3], full)
        assert spmd.spmd_redistribute(y, TensorSharding(), TensorSharding()) is y
        with pytest.raises(NotImplementedError):
            spmd.spmd_redistribute(x, TensorSharding(("tp", "tp")), TensorSharding())


def test_error_classes(ranks):
    err = spmd.SpmdTypeError("base msg", context="  In bar()")
    assert isinstance(err, RuntimeError) and isinstance(err, TypeError) and str(err) == "base msg\n\n  In bar()"
    assert err.context == "  In bar()" and spmd.SpmdTypeError(msg="m").context is None
    assert issubclass(spmd.RedistributeError, spmd.SpmdTypeError)
    assert issubclass(spmd.DTensorPropagationError, spmd.SpmdTypeError)


def test_context_given_after_the_error_is_made_is_shown():
    """The published API lets a caller set ``err.context`` on a raised error; the message then shows it."""
    err = spmd.SpmdTypeError("a rule was broken")
    assert str(err) == "a rule was broken"
    err.context = "  In step()"
    assert str(err) == "a rule was broken\n\n  In step()"
    given = spmd.SpmdTypeError("a rule was broken", context="  In step()")
    assert str(given) == "a rule was broken\n\n  In step()"  # shown once, not twice


def test_redistribute_error_for_an_axis_that_is_not_the_minor_most():
    with simulate((2, 2), ("dp", "tp")), spmd.typecheck(local=False):
        x = spmd.assert_type(torch.randn(4, 3), {"dp": V, "tp": V}, partition_spec=PS(("tp", "dp"), None))
        with pytest.raises(spmd.RedistributeError) as info:
            spmd.redistribute(x, "tp", src=S(0), dst=R)
    assert info.value.rule == ("spmd.all_gather can only gather the minor-most mesh axes of a dim: dim 0 is sharded on "
                               "('tp', 'dp'), and this gathers ('tp',).")


def test_types_given_outside_typecheck_are_read_and_changed():
    with simulate((2, 2), ("dp", "tp")) as mesh:
        w = spmd.assert_type(torch.randn(4, 4), {"dp": R, "tp": S(0)})  # not checking: a record on a plain tensor
        assert spmd.get_axis_local_type(w, "tp") is V and spmd.get_axis_local_type(w, mesh.get_group("dp")) is R
        assert spmd.maybe_get_axis_local_type(w, "dp") is R
        spmd.mutate_type(w, "dp", src=R, dst=I)
        assert spmd.get_axis_local_type(w, "dp") is I and spmd.get_partition_spec(w) == PS("tp", None)
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.mutate_type(w, "dp", src=R, dst=P)
        assert str(info.value) == "spmd.mutate_type's src= must be the tensor's type: src=R, but the tensor is I on axis dp."
        with spmd.typecheck():
            assert spmd.get_type(w) == {"dp": I, "tp": S(0)}


def test_register_local_backward_hook_declares_and_returns_the_hook(ranks):
    """The published API refuses unregistered module backward hooks; here a hook is ordinary code (choice 25), and
    registering one (as code written for the published API does) records it and keeps the module's types."""
    from spmd_types._boundaries.hooks import is_local_backward_hook

    seen = []

    @spmd.register_local_backward_hook
    def hook(module, grad_input, grad_output):
        seen.append(grad_output[0].shape)

    assert is_local_backward_hook(hook) and not is_local_backward_hook(print)
    lin = torch.nn.Linear(2, 2, bias=False)
    spmd.assert_type(lin, {"tp": R})
    lin.register_full_backward_hook(hook)
    x = spmd.assert_type(torch.randn(3, 2, requires_grad=True), {"tp": V})
    y = lin(x)
    assert spmd.get_type(y) == {"tp": V}
    y.sum().backward()
    assert seen == [torch.Size([3, 2])] and spmd.get_type(x.grad) == {"tp": V}
    with pytest.raises(TypeError) as info:
        spmd.register_local_backward_hook(3)
    assert str(info.value) == "register_local_backward_hook takes a hook function, got 3"


def test_all_to_all_with_one_shard_side_uses_the_published_dims(ranks):
    """``src=S(i), dst=V`` splits dim i and joins on dim 0; ``src=V, dst=S(j)`` splits dim 0 and joins on dim j."""
    x = spmd.assert_type(per_rank(lambda r: torch.arange(2.0 * 8).reshape(2, 8) + 100 * r), {"tp": S(1)})
    y = spmd.all_to_all(x, "tp", src=S(1), dst=V)
    assert y.shape == (2 * N, 2) and spmd.get_type(y) == {"tp": V}
    assert torch.equal(_values(y)[1], torch.cat([_values(x)[j][:, 2:4] for j in range(N)], 0))
    back = spmd.all_to_all(y, "tp", src=V, dst=S(1))
    assert back.shape == (2, 8) and all(torch.equal(a, b) for a, b in zip(_values(back), _values(x)))


def test_a_second_assert_outside_typecheck_adds_its_axes():
    """As on a typed tensor, an assert names some axes and leaves the others: outside ``typecheck()`` the record of a
    second assert joins the first's (the published API merges them)."""
    with simulate((2, 2), ("dp", "tp")) as mesh:
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    x = torch.randn(4)
    spmd.assert_type(x, {dp: R})
    spmd.assert_type(x, {tp: I})
    assert spmd.get_local_type(x) == {spmd.MeshAxis.of(dp): R, spmd.MeshAxis.of(tp): I}
    y = torch.randn(3, 4)
    spmd.assert_type(y, {}, PS(None, tp))  # a spec alone: its axis is V
    assert spmd.get_axis_local_type(y, tp) is V


def test_reinterpret_and_convert_to_the_same_type_return_the_tensor(ranks):
    """The published API's no-op: ``src == dst`` gives ``x`` back (its type still checked against ``src``)."""
    x = spmd.assert_type(torch.randn(4), {"tp": R})
    assert spmd.reinterpret(x, "tp", src=R, dst=R) is x and spmd.convert(x, "tp", src=R, dst=R) is x
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.convert(x, "tp", src=I, dst=I)
    assert info.value.rule == "spmd.convert's src= must be the input's type on the axis: src=I, but the tensor is R on axis 'tp'."
