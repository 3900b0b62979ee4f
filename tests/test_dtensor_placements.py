"""Placements <-> types, the cotangent map, from_dtensor / to_dtensor, assert_type and bad DTensor inputs.

Every placement/type pair both ways, the duality with ``backward_type``,
the gradient placement each conversion gives, and every error text the
interop raises (pinned).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

import spmd_types as spmd
from spmd_types.testing import CommCounter, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V

# (placement, type): the whole table of CONTRACT section 7, both ways.
PAIRS = [
    (Shard(0), S(0)), (Shard(1), S(1)), (Shard(-1), S(-1)),
    (Replicate(), I), (spmd.Reduced(), R), (Partial(), P),
]
COTANGENT = [
    (Shard(0), Shard(0)), (Shard(2), Shard(2)), (Replicate(), Replicate()),
    (spmd.Reduced(), Partial()), (Partial(), spmd.Reduced()),
]


def strict(placements) -> tuple:
    return tuple((type(p).__name__, getattr(p, "dim", None)) for p in placements)


def _message(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    err = info.value
    return getattr(err, "plain", str(err))


@pytest.mark.parametrize("placement,t", PAIRS, ids=[repr(p) for p, _ in PAIRS])
def test_placement_and_type_map_both_ways(placement, t):
    assert spmd.placement_to_type(placement) is t
    back = spmd.type_to_placement(t)
    assert strict([back]) == strict([placement])


@pytest.mark.parametrize("placement,cot", COTANGENT, ids=[repr(p) for p, _ in COTANGENT])
def test_cotangent_is_the_backward_type_and_an_involution(placement, cot):
    got = spmd.placement_to_cotangent(placement)
    assert strict([got]) == strict([cot])
    assert spmd.placement_to_type(got) is spmd.backward_type(spmd.placement_to_type(placement))
    assert strict([spmd.placement_to_cotangent(got)]) == strict([placement])


def test_spec_to_cotangent_keeps_mesh_and_metadata():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    meta = TensorMeta(torch.Size([4, 4]), (4, 1), torch.float32)
    spec = DTensorSpec(mesh, (spmd.Reduced(), Shard(1)), tensor_meta=meta)
    cot = spmd.spec_to_cotangent(spec)
    assert cot.mesh is mesh and cot.tensor_meta == meta
    assert strict(cot.placements) == (("Partial", None), ("Shard", 1))
    assert strict(spmd.spec_to_cotangent([Partial(), Replicate()])) == (("Reduced", None), ("Replicate", None))


def test_reduced_is_a_replicate_but_not_equal_to_one():
    red, rep = spmd.Reduced(), Replicate()
    assert isinstance(red, Replicate) and red.is_replicate()
    assert red != rep and rep != red and not (red == rep) and not (rep == red)
    assert red == spmd.Reduced() and hash(red) == hash(spmd.Reduced()) and hash(red) != hash(rep)
    assert (repr(red), str(red)) == ("Reduced()", "Rd")
    assert spmd.is_reduced(red) and not spmd.is_reduced(rep)


def test_unsupported_placements_and_v_are_errors():
    assert _message(NotImplementedError, spmd.placement_to_type, Partial("avg")) == (
        "placement_to_type: Partial('avg') has no SPMD type (P is a pending sum); redistribute it to "
        "Replicate() or Shard(d) first")
    assert _message(NotImplementedError, spmd.placement_to_type, _StridedShard(0, split_factor=2)) == (
        "placement_to_type: the placement _StridedShard(dim=0, sf=2) (_StridedShard) has no SPMD type; "
        "supported are Shard(d), Replicate(), spmd.Reduced() and Partial('sum')")
    assert _message(ValueError, spmd.type_to_placement, V) == (
        "type_to_placement: V has no DTensor placement (it does not say how the shards reassemble); use S(d), "
        "which maps to Shard(d)")
    assert _message(TypeError, spmd.type_to_placement, "R").startswith("type_to_placement must be an SPMD type")


def test_import_spmd_types_does_not_import_dtensor():
    code = ("import sys, spmd_types as spmd; assert 'torch.distributed.tensor' not in sys.modules; "
            "assert 'spmd_types.integrations.dtensor' not in sys.modules; spmd.Reduced; "
            "assert 'spmd_types.integrations.dtensor' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------
# from_dtensor / to_dtensor


def _dt(local, mesh, placements, requires_grad=False):
    return spmd.to_dtensor(local, mesh, placements).detach().requires_grad_(requires_grad)


@pytest.mark.parametrize("placement,t", PAIRS[:1] + PAIRS[3:], ids=["Shard(0)", "Replicate", "Reduced", "Partial"])
def test_from_dtensor_types_and_gradient_placement(placement, t):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        local = random_value(mesh, {"dp": S(1), "tp": t}, (2, 4))
        dt = _dt(local, mesh, [Shard(1), placement], requires_grad=True)
        with spmd.typecheck():
            x = spmd.from_dtensor(dt)
            assert spmd.get_type(x) == {"dp": S(1), "tp": t}
            want = spmd.PartitionSpec("tp", "dp") if t is S(0) else spmd.PartitionSpec(None, "dp")
            assert spmd.get_partition_spec(x) == want
        for r, v in rank_values(x).items():
            assert torch.equal(v, rank_values(local)[r])
        g = random_value(mesh, {"dp": S(1), "tp": spmd.backward_type(t)}, (2, 4), seed=1)
        with CommCounter() as comms:
            x.backward(g)
        assert comms.counts == {}
        assert strict(dt.grad.placements) == strict([Shard(1), spmd.placement_to_cotangent(placement)])
        for r, v in rank_values(dt.grad._local_tensor).items():
            assert torch.equal(v, rank_values(g)[r])


def test_from_dtensor_outside_typecheck_is_plain_and_replicate_gradient_is_replicate():
    mesh = fake_mesh((2,), ("dp",))
    with LocalTensorMode(2):
        dt = _dt(random_value(mesh, {"dp": I}, (3,)), mesh, [Replicate()], requires_grad=True)
        x = spmd.from_dtensor(dt)
        assert spmd.get_type(x) is None and not isinstance(x, DTensor)
        (x * 2).sum().backward()
        assert strict(dt.grad.placements) == (("Replicate", None),)
        assert torch.equal(rank_values(dt.grad._local_tensor)[1], torch.full((3,), 2.0))


def test_to_dtensor_checks_types_against_placements():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh), spmd.typecheck():
        x = spmd.assert_type(random_value(mesh, {"dp": V, "tp": I}, (2, 4)), {"dp": V, "tp": I})
        out = spmd.to_dtensor(x, mesh, [Shard(0), Replicate()])  # V takes any Shard(d)
        assert strict(out.placements) == (("Shard", 0), ("Replicate", None)) and tuple(out.shape) == (4, 4)
        msg = _message(spmd.SpmdTypeError, spmd.to_dtensor, x, mesh, [Shard(0), spmd.Reduced()])
        assert msg.splitlines()[0] == "spmd.to_dtensor: the tensor is I on axis 'tp', and the placement Reduced() means R."
        assert "  fix:        spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)" in msg
        assert _message(ValueError, spmd.to_dtensor, x, mesh, [Shard(0)]) == (
            "spmd.to_dtensor: 1 placements for a mesh of 2 dims ('dp', 'tp')")
        s1 = spmd.assert_type(random_value(mesh, {"dp": V, "tp": I}, (2, 4)), {"dp": S(1), "tp": I})
        msg = _message(spmd.SpmdTypeError, spmd.to_dtensor, s1, mesh, [Shard(0), Replicate()])
        assert msg.splitlines()[0] == (
            "spmd.to_dtensor: the tensor is S(1) on axis 'dp', and the placement Shard(dim=0) means S(0).")


def test_from_dtensor_rejects_what_is_not_a_dtensor_and_unnamed_meshes():
    assert _message(TypeError, spmd.from_dtensor, torch.ones(2)) == "spmd.from_dtensor takes a DTensor, got Tensor"
    from torch.distributed.device_mesh import init_device_mesh

    fake_mesh((2,), ("dp",))
    unnamed = init_device_mesh("cpu", (2,))
    with LocalTensorMode(2):
        dt = DTensor.from_local(torch.ones(2), unnamed, [Replicate()])
        assert _message(ValueError, spmd.from_dtensor, dt) == (
            "a typed DTensor needs a DeviceMesh with mesh_dim_names (the axis names of the types)")


# ---------------------------------------------------------------------------
# assert_type on a DTensor


def test_assert_type_on_dtensor_checks_placements():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4):
        dt = _dt(random_value(mesh, {"dp": S(0), "tp": I}, (2, 4)), mesh, [Shard(0), Replicate()])
        assert spmd.assert_type(dt, {"dp": R}) is dt  # outside typecheck(): nothing is checked
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            assert spmd.assert_type(dt, {"dp": V, "tp": I}) is dt
            assert spmd.assert_type(dt, {"dp": S(0)}) is dt
            msg = _message(spmd.SpmdTypeError, spmd.assert_type, dt, {"tp": R})
            assert msg.splitlines()[:4] == [
                "Type assertion failed: the DTensor is Replicate() (I) on axis 'tp', and the assertion says R.",
                "  have:       {dp: S(0), tp: I}",
                "  placements: Shard(dim=0), Replicate()",
                "  axis:       'tp': I is not R",
            ]
            assert "  fix:        spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)" in msg
            assert _message(ValueError, spmd.assert_type, dt, {"ep": R}) == (
                "assert_type: axis 'ep' is not a dim of the DTensor's mesh, whose dims are ('dp', 'tp')")
            assert _message(TypeError, spmd.assert_type, dt, {"dp": V}, spmd.PartitionSpec("dp", None)) == (
                "assert_type on a DTensor takes no partition_spec: its Shard placements are its layout")


# ---------------------------------------------------------------------------
# typed ops: bad DTensor inputs


def test_typed_ops_on_dtensor_reject_bad_inputs_before_any_comm():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4), CommCounter() as comms:
        dt = _dt(random_value(mesh, {"dp": S(0), "tp": S(0)}, (2, 4)), mesh, [Shard(0), Shard(0)])
        assert _message(ValueError, spmd.all_gather, dt, "tp", src=V, dst=R) == (
            "spmd.all_gather on a DTensor: src=V does not say which tensor dim the shards live on, so the "
            "DTensor result would not mean the same tensor; pass src=spmd.S(0)")
        assert _message(NotImplementedError, spmd.all_gather, dt, "dp", src=S(0), dst=R) == (
            "spmd.all_gather on a DTensor: tensor dim 0 is also sharded by the later mesh dim 'tp', so only "
            "that (inner) mesh dim can gather or scatter it here; use DTensor.redistribute for this change")
        msg = _message(spmd.SpmdTypeError, spmd.all_gather, dt, "tp", src=S(1), dst=R)
        assert msg.splitlines()[0] == (
            "spmd.all_gather's src= must be the input's type on the axis: src=S(1), but the tensor is S(0) on "
            "axis 'tp'.")
        assert _message(ValueError, spmd.reduce_scatter, dt, "ep", src=P, dst=S(0)) == (
            "spmd.reduce_scatter: axis 'ep' is not a dim of the DTensor's mesh, whose dims are ('dp', 'tp')")
        assert _message(NotImplementedError, spmd.all_reduce, dt, ("dp", "tp"), src=P, dst=R) == (
            "spmd.all_reduce on a DTensor runs on one mesh axis, not ('dp', 'tp')")
        assert _message(NotImplementedError, spmd.redistribute, dt, spmd.PartitionSpec(("dp", "tp")),
                        spmd.PartitionSpec(None)) == (
            "spmd.redistribute on a DTensor takes one mesh axis with src= and dst=; for a change of whole layout "
            "use DTensor.redistribute")
        assert _message(ValueError, spmd.convert, dt, "tp", src=S(0), dst=V).endswith("pass dst=spmd.S(d)")
        uneven = DTensor.from_local(torch.ones(3, 2), mesh, [Shard(0), Replicate()], shape=torch.Size([5, 2]),
                                    stride=(2, 1))
        assert _message(NotImplementedError, spmd.all_gather, uneven, "dp", src=S(0), dst=R) == (
            "spmd.all_gather on a DTensor: tensor dim 0 (size 5) is split unevenly into 2 shards; typed ops on "
            "DTensors need even shards (pad it, or use DTensor.redistribute)")
    assert comms.counts == {}


def test_typed_op_gathers_the_inner_mesh_dim_of_a_doubly_sharded_dim():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4):
        dt = _dt(random_value(mesh, {"dp": S(0), "tp": S(0)}, (2, 4)), mesh, [Shard(0), Shard(0)])
        out = spmd.all_gather(dt, "tp", src=S(0), dst=R)
        assert strict(out.placements) == (("Shard", 0), ("Reduced", None))
        from spmd_types.integrations.dtensor.propagation import plain_dtensor

        full_in = rank_values(plain_dtensor(dt).full_tensor())[0]
        full_out = rank_values(plain_dtensor(out).full_tensor())[0]
        assert torch.equal(full_in, full_out)


def test_the_issue_repros_now_type_or_refuse():
    """Issue 8: reinterpret returned a DTensor untyped, convert(R -> S(0)) of a Replicate DTensor a wrong one."""
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        dt = _dt(random_value(mesh, {"tp": I}, (4,)), mesh, [Replicate()])
        out = spmd.reinterpret(dt, "tp", src=I, dst=R)
        assert strict(out.placements) == (("Reduced", None),)
        assert spmd.get_type(spmd.from_dtensor(out)) == {"tp": R}
        msg = _message(spmd.SpmdTypeError, spmd.convert, dt, "tp", src=R, dst=S(0))
        assert msg.splitlines()[0] == (
            "spmd.convert's src= must be the input's type on the axis: src=R, but the tensor is I on axis 'tp'.")
        ok = spmd.convert(dt, "tp", src=I, dst=S(0))
        assert strict(ok.placements) == (("Shard", 0),)
        assert torch.equal(rank_values(ok.full_tensor())[0], rank_values(dt._local_tensor)[0])


# ---------------------------------------------------------------------------
# issue 14, item 2: torchtitan's own defaults (async redistribute outputs, Shard(-1) input layouts)


def test_from_dtensor_of_an_async_redistribute_is_typed_and_differentiable():
    """RowwiseParallel's output hook redistributes with async_op=True: the local tensor is an AsyncCollectiveTensor."""
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh):
        a = random_value(mesh, {"tp": P}, (2, 8, 4)).requires_grad_()
        dt = DTensor.from_local(a, mesh, [Partial()]).redistribute(mesh, [Shard(1)], async_op=True)
        assert type(dt._local_tensor).__name__ == "AsyncCollectiveTensor"
        with spmd.typecheck():
            x = spmd.from_dtensor(dt)
            assert spmd.get_type(x) == {"tp": S(1)}
            as_typed = spmd.assert_type(dt.to_local(), {"tp": S(1)})  # use_local_output=True hands over the same
            assert spmd.get_type(as_typed) == {"tp": S(1)}
        full = sum(rank_values(a).values())  # the pending sum, reduce-scattered on dim 1
        for r, v in rank_values(x).items():
            assert torch.equal(v, full.chunk(2, 1)[r])
        (x.sum() + as_typed.sum()).backward()  # both reach the Partial input through DTensor's backward
        for v in rank_values(a.grad).values():
            assert torch.equal(v, torch.full((2, 8, 4), 2.0))


def test_negative_shard_dims_are_counted_from_the_front_where_they_enter():
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        x = spmd.assert_type(random_value(mesh, {"tp": V}, (2, 4, 4)), {"tp": S(-1)})
        assert spmd.get_type(x) == {"tp": S(2)}  # S(-1) and S(2) are one type on a 3-d tensor
        dt = spmd.to_dtensor(x, mesh, [Shard(-1)])  # RowwiseParallel's default input_layouts
        assert strict(dt.placements) == (("Shard", 2),)
        assert spmd.get_type(spmd.from_dtensor(dt)) == {"tp": S(2)}
        spmd.assert_type(dt, {"tp": S(-1)})  # passes: the DTensor is Shard(2)
        y = spmd.convert(spmd.assert_type(random_value(mesh, {"tp": I}, (2, 4, 4)), {"tp": I}), "tp", src=I,
                         dst=S(-1))
        assert spmd.get_type(y) == {"tp": S(2)}
        assert spmd.get_type(spmd.all_gather(y, "tp", src=S(2), dst=R)) == {"tp": R}
        assert spmd.get_type(spmd.redistribute(y, "tp", src=S(-1), dst=S(2))) == {"tp": S(2)}  # the same type
        msg = _message(ValueError, spmd.to_dtensor, x, mesh, [Shard(3)])
    assert msg == "spmd.to_dtensor: the placement Shard(dim=3) names tensor dim 3, but the tensor has 3 dims"


def test_dtensor_from_local_of_a_typed_tensor_is_checked_like_to_dtensor():
    """torch's parallel styles call DTensor.from_local on plain local inputs (torchtitan's use_local_output=True)."""
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        i = spmd.assert_type(random_value(mesh, {"tp": I}, (3, 4)).requires_grad_(), {"tp": I})
        dt = DTensor.from_local(i, mesh, [Replicate()])
        assert spmd.get_type(dt._local_tensor) is None  # the DTensor holds a plain alias, never a typed tensor
        (dt.redistribute(mesh, [Shard(0)]).to_local() * 3).sum().backward()
        assert spmd.get_type(i.grad) == {"tp": I}
        for v in rank_values(i.grad).values():
            assert torch.equal(v, torch.full((3, 4), 3.0))  # Replicate's gradient, summed by DTensor: I's
        r = spmd.assert_type(random_value(mesh, {"tp": R}, (3, 4)).requires_grad_(), {"tp": R})
        with pytest.raises(spmd.SpmdTypeError) as err:
            DTensor.from_local(r, mesh, [Replicate()])
        v = spmd.assert_type(random_value(mesh, {"tp": V}, (3, 4)), {"tp": V})
        assert strict(DTensor.from_local(v, mesh, [Shard(-1)]).placements) == (("Shard", 1),)
    assert err.value.rule == "DTensor.from_local: the tensor is R on axis 'tp', and the placement Replicate() means I."
    assert err.value.seen == (("tensor", "{tp: R}"), ("placements", "Replicate()"))
    assert err.value.fixes == ("spmd.convert(x, 'tp', src=spmd.R, dst=spmd.I)",)
