"""Refining asserts: on a typed tensor, ``assert_type`` checks only the axes it names; S(d) refines V."""

from __future__ import annotations

import pytest
import torch

import spmd_types as spmd

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def local(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        yield mesh_dp_tp


def test_named_axes_only(local):
    w = spmd.assert_type(torch.randn(4, 4), {"dp": R, "tp": V})
    assert spmd.assert_type(w, {"tp": V}) is w  # dp is not compared (it used to be, as V)
    assert spmd.assert_type(w, {"dp": R}) is w
    assert spmd.assert_type(w, {}) is w
    assert spmd.get_type(w) == {"dp": R, "tp": V}


def test_the_docstring_example(local):
    w = spmd.assert_type(torch.randn(16, 16), {"dp": I, "tp": I})
    assert spmd.assert_type(w, {"tp": I}) is w


def test_a_named_axis_still_fails_with_the_whole_type_shown(local):
    w = spmd.assert_type(torch.randn(4), {"dp": R, "tp": V})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(w, {"tp": R})
    assert info.value.plain.splitlines()[:4] == [
        "Type assertion failed: the tensor is V on axis 'tp', and the assertion says R.",
        "  have: {dp: R, tp: V}",
        "  want: {dp: R, tp: R}",
        "  axis: 'tp': V is not R",
    ]


def test_untyped_tensors_still_get_defaults(local):
    x = spmd.assert_type(torch.randn(4), {"tp": R})
    assert spmd.get_type(x) == {"dp": V, "tp": R}  # local SPMD: an omitted axis is V


def test_modules_refine_typed_parameters(local):
    lin = torch.nn.Linear(4, 4)
    spmd.assert_type(lin, {"dp": R, "tp": V})
    assert spmd.assert_type(lin, {"tp": V}) is lin
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(lin, {"dp": I})
    assert info.value.rule == "Type assertion failed: the tensor is R on axis 'dp', and the assertion says I."


def test_v_refines_to_shard(local):
    w = spmd.assert_type(torch.randn(4, 8), {"dp": R, "tp": V})
    assert spmd.assert_type(w, {"tp": S(1)}) is w
    assert spmd.get_type(w) == {"dp": R, "tp": S(1)}
    assert spmd.assert_type(w, {"tp": V}) is w  # S(1) still passes as V, and stays S(1)
    assert spmd.get_type(w) == {"dp": R, "tp": S(1)}
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(w, {"tp": S(0)})
    assert info.value.rule == "Type assertion failed: the tensor is S(1) on axis 'tp', and the assertion says S(0)."
    with pytest.raises(ValueError) as info:
        spmd.assert_type(w, {"dp": R, "tp": S(2)})
    assert str(info.value) == "S(2) on axis 'tp' is out of range for a 2-d tensor"


def test_a_refined_parameter_is_still_the_modules(local):
    lin = torch.nn.Linear(8, 4)
    spmd.assert_type(lin, {"dp": R, "tp": V})
    spmd.assert_type(lin.weight, {"tp": S(0)})
    assert lin.weight is dict(lin.named_parameters())["weight"]
    assert spmd.get_type(lin.weight)["tp"] is S(0) and spmd.get_type(lin.bias)["tp"] is V


def test_global_spmd_checks_only_the_named_axes(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=False):
        x = spmd.assert_type(torch.randn(4, 8), {"dp": S(0), "tp": R})
        assert spmd.assert_type(x, {"tp": R}) is x  # dp is not asserted R by default any more
        assert spmd.assert_type(x, {}, partition_spec=spmd.PartitionSpec("dp", None)) is x
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.assert_type(x, {}, partition_spec=spmd.PartitionSpec(None, "dp"))
    assert info.value.rule == "Type assertion failed: the tensor's partition spec differs from the asserted one."
    assert info.value.fixes == ("spmd.redistribute(x, PartitionSpec('dp', None), PartitionSpec(None, 'dp'))",)


def test_refining_sets_the_partition_spec_in_global_spmd(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=["tp"]):
        x = spmd.assert_type(torch.randn(4, 8), {"dp": S(0), "tp": V})
        assert spmd.get_partition_spec(x) == spmd.PartitionSpec("dp", None)
        spmd.assert_type(x, {"tp": S(1)})
        assert spmd.get_type(x) == {"dp": S(0), "tp": S(1)}
        assert spmd.get_partition_spec(x) == spmd.PartitionSpec("dp", "tp")


def test_a_partition_spec_asserted_in_local_spmd_is_the_layout_a_global_region_reads():
    # torchtitan's QKV head split: a view in spmd.local() (its types V, the layout forgotten), re-declared with
    # assert_type(x, V, PartitionSpec(...)); the global code after it (a norm of the heads) reads that layout, as
    # with the published package. Size-1 axes (cp, tp here) drop out of the spec.
    from conftest import fake_mesh

    from spmd_types.runtime import get_partition_spec

    mesh = fake_mesh((2, 1, 1), ("dp", "cp", "tp"))
    with spmd.set_current_mesh(mesh), spmd.typecheck(local=False):
        x = torch.ones(2, 4, 6)
        spmd.assert_type(x, {"dp": spmd.S(0)})
        with spmd.local():
            y = x.view(2, 4, -1, 3)
            assert get_partition_spec(y) is None
            spmd.assert_type(y, spmd.V, spmd.PartitionSpec("dp", "cp", "tp", None))
        assert get_partition_spec(y) == spmd.PartitionSpec("dp", None, None, None)
        out = torch.nn.functional.rms_norm(y, (3,))  # global SPMD: refused for a V tensor with no layout
        assert get_partition_spec(out) == spmd.PartitionSpec("dp", None, None, None)
