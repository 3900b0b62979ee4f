"""The published API's type values beside ours: the whole-tensor ``SpmdType(local_type, partition_spec)``,
``merge_types``, ``assert_type(t, *types, partition_spec=)``, the ``types`` helpers, ``MeshAxis.names`` and
``MeshAxis.layout``; and two keys for one axis.

``spmd.SpmdType`` is the class of every SPMD type: R, I, V, P and S(d) are its per-axis instances
(``spmd.types.AxisType``), and called as the published API calls it, it builds a whole tensor's type.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import fake_mesh, fake_world

import spmd_types as spmd
from spmd_types.testing import simulate
from spmd_types.types import (
    AxisType,
    PerMeshAxisSpmdTypesArg,
    TensorSpmdType,
    normalize_dim_sharding,
    normalize_local_type,
    to_local_type,
)

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
PS = spmd.PartitionSpec


@pytest.fixture
def dp_cp_tp():
    with simulate((2, 2, 2), ("dp", "cp", "tp")) as mesh, spmd.typecheck():
        yield mesh


def test_spmd_type_is_every_types_class_and_builds_a_whole_type():
    assert all(isinstance(t, spmd.SpmdType) and isinstance(t, AxisType) for t in (R, I, V, P, S(0)))
    whole = spmd.SpmdType({"dp": S(0), "tp": R})
    assert isinstance(whole, spmd.SpmdType) and type(whole) is TensorSpmdType and not isinstance(whole, AxisType)
    assert whole.local_type == {"dp": S(0), "tp": R} and whole.partition_spec is None  # S(d) kept as written
    laid = spmd.SpmdType({"tp": R}, partition_spec=PS("dp", None))
    assert laid.partition_spec == PS("dp", None) and laid == spmd.SpmdType({"tp": R}, PS("dp", None))
    assert repr(laid) == "SpmdType(local_type={'tp': R}, partition_spec=PartitionSpec('dp', None))"


def test_a_whole_type_is_checked_when_built():
    cases = [
        (lambda: spmd.SpmdType({"dp": S(0)}, partition_spec=PS("dp", None)), spmd.SpmdTypeError,
         "SpmdType: S(d) on 'dp' and a partition_spec both say where shards lie; give one of them"),
        (lambda: spmd.SpmdType({"dp": R}, partition_spec=PS("dp", None)), spmd.SpmdTypeError,
         "SpmdType: the partition spec places axis 'dp' on dim 0, which makes it V, but local_type says R"),
        (lambda: spmd.SpmdType({"dp": "R"}), TypeError,
         "SpmdType: the type on axis 'dp' must be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or spmd.S(d)), got "
         "'R' of type str"),
        (lambda: spmd.SpmdType({"dp": S}), TypeError, "SpmdType: the type on axis 'dp': spmd.S needs a dim: spmd.S(0)"),
        (lambda: spmd.SpmdType([("dp", R)]), TypeError,
         "SpmdType(local_type, partition_spec=None): local_type is a dict {axis: type}, got [('dp', R)]"),
    ]
    for make, exc, text in cases:
        with pytest.raises(exc) as info:
            make()
        assert str(info.value) == text


def test_assert_type_takes_a_whole_type(dp_cp_tp):
    """The published call shape ``assert_type(x, SpmdType(...))``: S(d) resolved against the tensor's rank."""
    x = spmd.assert_type(torch.randn(4, 3, 2), spmd.SpmdType({"dp": S(0), "tp": S(-1), "cp": R}))
    assert spmd.get_type(x) == {"dp": S(0), "cp": R, "tp": S(2)}
    assert spmd.get_partition_spec(x) == PS("dp", None, "tp")
    y = spmd.assert_type(torch.randn(4, 2), spmd.SpmdType({"cp": R, "tp": R}, PS("dp", None)))
    assert spmd.get_type(y) == {"dp": V, "cp": R, "tp": R} and spmd.get_partition_spec(y) == PS("dp", None)
    both = spmd.assert_type(torch.randn(4, 3), spmd.SpmdType({"tp": S(0), "dp": S(0)}))  # ordered by the mesh
    assert spmd.get_partition_spec(both) == PS(("dp", "tp"), None)  # choice 37 (the published API refuses it)


def test_assert_type_takes_the_type_in_parts(dp_cp_tp):
    """``assert_type(x, R, {cp: V})``: a bare type fills the axes nothing else names (the published 0.3.1 form)."""
    x = spmd.assert_type(torch.randn(4), R, {"cp": V})
    assert spmd.get_type(x) == {"dp": R, "cp": V, "tp": R}
    y = spmd.assert_type(torch.randn(4, 2), {"dp": R}, {"cp": I}, PS("tp", None))
    assert spmd.get_type(y) == {"dp": R, "cp": I, "tp": V} and spmd.get_partition_spec(y) == PS("tp", None)
    z = spmd.assert_type(torch.randn(4, 2), R, partition_spec=PS(("dp", "cp"), None))  # the spec's axes are V
    assert spmd.get_type(z) == {"dp": V, "cp": V, "tp": R} and spmd.get_partition_spec(z) == PS(("dp", "cp"), None)
    w = spmd.assert_type(torch.randn(4, 2), {"dp": R, "cp": R, "tp": V}, (None, "tp"))  # ours: the spec by position
    assert spmd.get_partition_spec(w) == PS(None, "tp")
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(torch.randn(4), {"cp": V}, {"cp": I})
    assert str(info.value) == "axis 'cp' is given two types, V and I; an axis has one type"
    with pytest.raises(TypeError) as info:
        spmd.assert_type(torch.randn(4), R, V)
    assert str(info.value) == ("assert_type takes at most one bare type (it fills the axes nothing else names); got R "
                               "and V")


def test_merge_types(dp_cp_tp):
    merged = spmd.merge_types(R, {"cp": V}, None)
    assert merged == spmd.SpmdType({"cp": V, "dp": R, "tp": R})
    assert spmd.merge_types({"dp": V}, spmd.SpmdType({"tp": R}, PS("dp")), PS("dp")).partition_spec == PS("dp")
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.merge_types(PS("dp"), PS("tp"))
    assert str(info.value) == "two partition specs disagree: PartitionSpec('dp') and PartitionSpec('tp')"
    with pytest.raises(TypeError) as info:
        spmd.merge_types(S(0))
    assert str(info.value) == "a bare S(0) names no axis: give it in a dict, {axis: S(0)}"


def test_merge_types_with_a_bare_type_needs_a_mesh():
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.merge_types(R, {"cp": V})
    assert str(info.value) == ("a bare R stands for every axis of the current mesh, and no mesh is current: give a "
                               "dict {axis: type}, or set one with spmd.set_current_mesh(mesh)")


def test_one_axis_named_twice_with_two_types(dp_cp_tp):
    """Issue 21: ``{"tp": R, <tp's ProcessGroup>: V}`` raises naming the axis (it passed silently)."""
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(torch.randn(4), {"tp": R, dp_cp_tp.get_group("tp"): V})
    assert str(info.value) == ("assert_type: axis 'tp' is given two types, R (key 'tp') and V (key ProcessGroup); an "
                               "axis has one type")


def test_the_shard_class_needs_a_dim(dp_cp_tp):
    """Issue 21: ``src=spmd.S`` (the class) says how to write it."""
    x = spmd.assert_type(torch.randn(4), {"tp": V})
    with pytest.raises(TypeError) as info:
        spmd.all_gather(x, "tp", src=spmd.S, dst=R)
    assert str(info.value) == "spmd.all_gather: src: spmd.S needs a dim: spmd.S(0)"
    with pytest.raises(TypeError) as info:
        spmd.convert(torch.randn(4), "tp", src=R, dst=spmd.Shard)
    assert str(info.value) == "spmd.convert: dst: spmd.S needs a dim: spmd.S(0)"


def test_the_types_helpers(dp_cp_tp):
    assert [to_local_type(t) for t in (R, I, V, P, S(3))] == [R, I, V, P, V]
    tp = dp_cp_tp.get_group("tp")
    assert normalize_local_type({"dp": V, tp: R}) == {spmd.normalize_axis("dp"): V, spmd.MeshAxis.of(tp): R}
    with pytest.raises(TypeError) as info:
        normalize_local_type({"dp": S(0)})
    assert str(info.value) == "normalize_local_type: the type on axis 'dp' is R, I, V or P, got S(0)"
    assert [normalize_dim_sharding(d) for d in (None, "tp", ("dp", "cp"))] == [(), ("tp",), ("dp", "cp")]

    def annotate(x: torch.Tensor, types: PerMeshAxisSpmdTypesArg) -> torch.Tensor:
        return spmd.assert_type(x, types)

    assert spmd.get_type(annotate(torch.randn(2), {"dp": R, "cp": R, "tp": R})) == {"dp": R, "cp": R, "tp": R}


def test_mesh_axis_names_come_from_group_desc_and_layout_is_torchs():
    fake_world(8)
    pg = dist.new_group(ranks=[0, 1, 2, 3], group_desc="TENSOR_PAR")
    axis = spmd.MeshAxis.of(pg)
    assert "TENSOR_PAR" in axis.names and axis.layout() == "4:1"
    layout = axis.layout
    assert (layout.shape, layout.stride, list(layout.all_ranks_from_zero()), layout.numel()) == ((4,), (1,),
                                                                                                 [0, 1, 2, 3], 4)
    strided = spmd.MeshAxis.of(2, 4).layout
    assert (strided.shape, strided.stride, list(strided.all_ranks_from_zero())) == ((2,), (4,), [0, 4])
    other = dist.new_group(ranks=[0, 2], group_desc="TENSOR_PAR")  # the same name for other ranks
    assert "TENSOR_PAR[2:2]" in spmd.MeshAxis.of(other).names and "TENSOR_PAR[4:1]" in axis.names


def test_a_device_mesh_names_its_axes_by_group_desc():
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    names = spmd.MeshAxis.of(mesh.get_group("dp")).names
    assert any(n.startswith("mesh_dp") for n in names)


def test_enum_members_and_empty_spec_entries(dp_cp_tp):
    assert spmd.PerMeshAxisLocalSpmdType.R is R and spmd.PerMeshAxisLocalSpmdType.P is P
    with pytest.raises(ValueError) as info:
        spmd.normalize_partition_spec(PS((), "tp"))
    assert str(info.value) == "normalize_partition_spec: entry 0 is an empty tuple; a dim nothing shards is None"
