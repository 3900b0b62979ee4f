"""Mesh axes as regions of ranks: MeshAxis, the keys a type dict takes, axes of size 1, flattened groups.

The published spmd_types API names an axis by a name, a ProcessGroup or a
MeshAxis; all three stand for a region of ranks, and two spellings of one
region are one axis. Numerics run on simulated ranks against one device.
"""

from __future__ import annotations

import enum

import pytest
import torch
import torch.distributed as dist
from conftest import by_region, fake_mesh
from torch.distributed.device_mesh import init_device_mesh

import spmd_types as spmd
from spmd_types import MeshAxis
from spmd_types._core.axes import flatten, orthogonal
from spmd_types._core.mesh import current_mesh, resolve_axes
from spmd_types.testing import CommCounter, denote, per_rank, rank_values, simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


class Axis(str, enum.Enum):
    """Axis names as a StrEnum, as torchtitan spells some of them."""

    TP = "tp"
    DP = "dp"


@pytest.fixture
def cube():
    """8 fake ranks as (dp=2, cp=2, tp=2), current; checking on."""
    with simulate((2, 2, 2), ("dp", "cp", "tp")) as mesh, spmd.typecheck():
        yield mesh


@pytest.fixture
def with_one():
    """(dp=2, pp=1, tp=4): pp is an axis of one rank."""
    with simulate((2, 1, 4), ("dp", "pp", "tp")) as mesh, spmd.typecheck():
        yield mesh


# ---------------------------------------------------------------------------
# MeshAxis values


def test_an_axis_is_its_region_of_ranks():
    assert MeshAxis.of(4, 1) == MeshAxis.from_ranks([4, 5, 6, 7])  # relative to the first rank
    assert hash(MeshAxis.of(2, 4)) == hash(MeshAxis.from_ranks([1, 5]))
    assert MeshAxis.of(2, 4) != MeshAxis.of(2, 2)
    assert {MeshAxis.of(2, 1): "tp"}[MeshAxis.from_ranks([6, 7])] == "tp"
    assert MeshAxis.of(2, 2) in {MeshAxis.of(2, 1), MeshAxis.from_ranks([0, 2])}
    assert MeshAxis.of(2, 1) != 2 and MeshAxis.of(2, 1) != "tp"


def test_equal_regions_built_differently_are_equal():
    assert flatten([MeshAxis.of(2, 4), MeshAxis.of(4, 1)]) == MeshAxis.of(8, 1)
    assert flatten([MeshAxis.of(2, 1), MeshAxis.of(2, 2)]) == MeshAxis.from_ranks(range(4))
    assert MeshAxis.of(1, 1) == MeshAxis.of(1, 8) == flatten([])  # one rank is one rank


def test_of_checks_its_arguments():
    with pytest.raises(ValueError) as info:
        MeshAxis.of(0, 1)
    assert str(info.value) == "MeshAxis.of(size, stride) needs a size >= 1 and a stride >= 1, got 0, 1"
    with pytest.raises(ValueError):
        MeshAxis.of(4)
    with pytest.raises(TypeError) as info:
        MeshAxis.of("tp")
    assert str(info.value) == "expected a ProcessGroup, got str"
    with pytest.raises(AttributeError):
        MeshAxis.of(2, 1).atoms = ()


def test_size_and_sub_regions():
    tp, dp_tp = MeshAxis.of(2, 1), MeshAxis.of(4, 1)
    assert (tp.size(), dp_tp.size(), MeshAxis.of(1, 1).size()) == (2, 4, 1)
    assert tp <= dp_tp and tp < dp_tp and dp_tp <= dp_tp and not dp_tp < dp_tp
    assert MeshAxis.of(2, 2) < MeshAxis.of(4, 1)  # a strided subgroup
    assert not MeshAxis.of(2, 1) <= MeshAxis.of(2, 2) and not MeshAxis.of(2, 2) <= MeshAxis.of(2, 1)


def test_a_rank_set_no_mesh_dim_describes_is_kept_as_ranks():
    """Found by this test: {0, 1, 3} made from_ranks loop for ever."""
    odd = MeshAxis.from_ranks([10, 11, 13])
    assert (odd.size(), odd.layout_str(), repr(odd)) == (3, "{0,1,3}", "MeshAxis({0,1,3})")
    assert odd == MeshAxis.from_ranks([0, 1, 3]) and odd != MeshAxis.of(3, 1)
    assert odd.isorthogonal(MeshAxis.of(1, 1)) and not odd.isorthogonal(MeshAxis.of(2, 8))


def test_orthogonal_axes_are_independent_dims():
    dp, cp, tp = MeshAxis.of(2, 4), MeshAxis.of(2, 2), MeshAxis.of(2, 1)
    assert dp.isorthogonal(cp, tp) and orthogonal([tp, dp])
    assert not tp.isorthogonal(tp)  # an axis overlaps itself
    assert MeshAxis.of(1, 1).isorthogonal(tp) and MeshAxis.of(1, 1).isorthogonal(MeshAxis.of(1, 1))
    assert not MeshAxis.of(4, 1).isorthogonal(MeshAxis.of(2, 2))  # dp_tp and tp share ranks
    assert not MeshAxis.of(3, 1).isorthogonal(MeshAxis.of(2, 2))  # ranks 0 and 2 in both
    assert MeshAxis.of(2, 1).isorthogonal(MeshAxis.of(2, 3))  # a 2 x 2 mesh [[0, 1], [3, 4]]
    assert MeshAxis.of(2**20, 1).isorthogonal(MeshAxis.of(2**10, 2**20))  # never lists the ranks


def test_flatten():
    dp, cp = MeshAxis.of(2, 4), MeshAxis.of(2, 2)
    assert flatten([cp]) == cp
    assert flatten([dp, cp]) == MeshAxis.of(4, 2) == flatten([cp, dp])
    with pytest.raises(ValueError) as info:
        flatten([MeshAxis.of(4, 1), MeshAxis.of(2, 2)])
    assert str(info.value) == "cannot flatten axes that are not independent dims of one mesh: 4:1, 2:2"


def test_axes_of_a_device_mesh(cube):
    dp, cp, tp = (MeshAxis.of(cube.get_group(n)) for n in ("dp", "cp", "tp"))
    assert (dp, cp, tp) == (MeshAxis.of(2, 4), MeshAxis.of(2, 2), MeshAxis.of(2, 1))
    assert MeshAxis.of(cube.get_group("tp")) is tp  # cached per group
    assert (repr(dp), repr(tp)) == ("dp", "tp") and "tp" in tp.names  # shown by the current mesh's names
    dp_cp = cube["dp", "cp"]._flatten("dp_cp").get_group()
    assert MeshAxis.of(dp_cp) == flatten([dp, cp]) == MeshAxis.of(4, 2)
    assert MeshAxis.of(dist.group.WORLD) == flatten([dp, cp, tp]) == MeshAxis.of(8, 1)
    expert = init_device_mesh("cpu", (2, 4), mesh_dim_names=("edp", "ep"))
    assert MeshAxis.of(expert.get_group("edp")) == dp
    assert MeshAxis.of(expert.get_group("ep")) == flatten([cp, tp])
    other = dist.new_group([0, 1])  # another group over the ranks of a tp group: the same axis
    assert MeshAxis.of(other) == tp


def test_repr_of_unnamed_regions():
    assert repr(MeshAxis.of(3, 7)) == "MeshAxis(3:7)"  # no mesh ever named it
    assert repr(MeshAxis.of(1, 1)) == "MeshAxis(1:1)"
    assert MeshAxis.from_ranks([0, 1, 8, 9]).layout_str() == "(2,2):(8,1)"


# ---------------------------------------------------------------------------
# the current mesh


def test_current_mesh_is_the_set_of_typed_axes(with_one):
    assert spmd.current_mesh() == frozenset({MeshAxis.of(2, 4), MeshAxis.of(4, 1)})
    assert spmd.current_mesh_names() == {"dp": MeshAxis.of(2, 4), "tp": MeshAxis.of(4, 1)}
    assert spmd.current_mesh_all_names() == {"dp": MeshAxis.of(2, 4), "pp": MeshAxis.of(1, 1),
                                             "tp": MeshAxis.of(4, 1)}
    assert current_mesh().typed_axes == ("dp", "tp")


def test_no_current_mesh():
    assert spmd.current_mesh() is None and spmd.current_mesh_names() is None
    with pytest.raises(RuntimeError) as info:
        with spmd.set_current_mesh(None):
            pass
    assert str(info.value) == "set_current_mesh() with no mesh keeps the current one, but no mesh is current"


def test_repr_prefers_the_current_meshs_name(cube):
    with spmd.set_current_mesh({"data": MeshAxis.of(2, 4), "model": MeshAxis.of(4, 1)}):
        assert (repr(MeshAxis.of(2, 4)), repr(MeshAxis.of(4, 1))) == ("data", "model")
        assert repr(MeshAxis.of(2, 1)) == "tp"  # not an axis here: the name a mesh gave it last
    assert (repr(MeshAxis.of(2, 4)), repr(MeshAxis.of(4, 1))) == ("dp", "model")
    assert MeshAxis.of(2, 4).names >= {"dp", "data"}


def test_every_form_of_a_mesh_gives_the_same_axes(cube):
    groups = {n: cube.get_group(n) for n in ("dp", "cp", "tp")}
    regions = {n: MeshAxis.of(g) for n, g in groups.items()}
    for form in (cube, groups, regions):
        with spmd.set_current_mesh(form):
            assert spmd.current_mesh_names() == regions
    with spmd.set_current_mesh({Axis.TP: groups["tp"], Axis.DP: groups["dp"]}) as m:
        assert m.axis_names == ("tp", "dp")  # a StrEnum key is its value
    for form in (frozenset(regions.values()), list(groups.values())):
        with spmd.set_current_mesh(form) as m:  # no names given: the regions' names, outermost first
            assert m.axis_names == ("dp", "cp", "tp") and spmd.current_mesh() == frozenset(regions.values())


def test_a_mesh_is_independent_axes_each_named_once(cube):
    tp = cube.get_group("tp")
    with pytest.raises(ValueError) as info:
        with spmd.set_current_mesh({"a": tp, "b": cube.get_group("tp")}):
            pass
    assert str(info.value) == ("set_current_mesh: axes 'a' and 'b' run over the same ranks; a mesh axis is one "
                               "region of ranks, named once")
    with pytest.raises(ValueError) as info:
        with spmd.set_current_mesh({"dp_tp": MeshAxis.of(4, 1), "tp": MeshAxis.of(2, 1)}):
            pass
    assert str(info.value) == ("set_current_mesh: the axes (dp_tp, tp) are not independent dims of one mesh "
                               "(regions 4:1, 2:1); a type per axis needs axes that do not overlap")
    with pytest.raises(TypeError) as info:
        with spmd.set_current_mesh({1: tp}):
            pass
    assert str(info.value) == "mesh axis names must be str, got 1"
    with pytest.raises(ValueError) as info:
        with spmd.set_current_mesh({}):
            pass
    assert str(info.value) == "set_current_mesh: the mesh has no axes"


def test_the_order_of_axes_sharding_one_dim_is_part_of_the_spec(cube):
    """("tp", "dp") splits the dim by tp first, ("dp", "tp") by dp first: different layouts, never equal (they
    used to compare equal, so a spec remembered for one assertion came back for the other)."""
    dp, tp = MeshAxis.of(cube.get_group("dp")), MeshAxis.of(cube.get_group("tp"))
    assert spmd.PartitionSpec(("tp", "dp"), None) != spmd.PartitionSpec(("dp", "tp"), None)
    assert spmd.PartitionSpec((tp, dp), None) != spmd.PartitionSpec(("dp", "tp"), None)
    assert spmd.PartitionSpec((tp, dp), None) == spmd.PartitionSpec(("tp", cube.get_group("dp")), None)
    with spmd.typecheck(local=False):
        for order in (("tp", "dp"), ("dp", "tp"), ("tp", "dp")):
            x = spmd.assert_type(torch.zeros(8, 3), {}, partition_spec=spmd.PartitionSpec(order, None))
            assert [repr(a) for a in spmd.get_partition_spec(x)[0]] == list(order)


def test_normalize_axis_of_a_name_with_no_mesh_says_so():
    """A name means an axis only on a current mesh; with none, the error says so (it used to be an
    AttributeError from inside the lookup)."""
    assert spmd.current_mesh() is None
    with pytest.raises(RuntimeError, match="no mesh is current"):
        spmd.normalize_axis("tp")


def test_naming_an_axis_the_mesh_lacks(cube):
    with pytest.raises(ValueError) as info:
        spmd.assert_type(torch.randn(2), {"xp": R})
    assert str(info.value) == "unknown mesh axis 'xp'; the current mesh has axes 'dp', 'cp', 'tp'"
    odd = dist.new_group([0, 3])
    with pytest.raises(ValueError) as info:
        spmd.assert_type(torch.randn(2), {odd: R})
    assert str(info.value) == ("this ProcessGroup (ranks 2:3) is not an axis, nor a flattening of axes, of the "
                               "current mesh (dp=2:4, cp=2:2, tp=2:1)")
    with spmd.set_current_mesh(cube), pytest.raises(ValueError) as info:
        spmd.all_reduce(torch.randn(2), "xp", src=P, dst=R)
    assert str(info.value) == "spmd.all_reduce: unknown mesh axis 'xp'; the current mesh has axes 'dp', 'cp', 'tp'"


def test_typing_by_groups_alone_makes_the_mesh_of_those_axes():
    """With no current mesh, a type keyed by groups is on the mesh of the axes it names (the published API's way);
    a collective on the tensor runs on that mesh. A name still needs a current mesh."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))  # made, not current
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    with spmd.typecheck():
        x = spmd.assert_type(torch.randn(4), {tp: R})
        assert spmd.get_local_type(x) == {MeshAxis.of(tp): R}
        name = repr(MeshAxis.of(tp))  # the name a mesh gave the region, else its group's group_desc
        assert spmd.get_type(x) == {name: R} and any(n.startswith("mesh_tp") for n in MeshAxis.of(tp).names)
        y = spmd.assert_type(torch.randn(4), {dp: V, MeshAxis.of(tp): P})
        assert spmd.get_local_type(y) == {MeshAxis.of(dp): V, MeshAxis.of(tp): P}
        z = spmd.all_reduce(y, tp, src=P, dst=R)
        assert spmd.get_local_type(z) == {MeshAxis.of(dp): V, MeshAxis.of(tp): R}
        assert spmd.get_type(x + x) == {name: R}
        with pytest.raises(RuntimeError) as info:
            spmd.assert_type(torch.randn(2), {"tp": R})
    assert str(info.value) == "assert_type needs a current mesh: wrap the code in `with spmd.set_current_mesh(mesh):`"


# ---------------------------------------------------------------------------
# type dicts: keys


def test_every_key_spelling_types_the_same_axis(cube):
    tp = cube.get_group("tp")
    spellings = ["tp", Axis.TP, tp, MeshAxis.of(tp), MeshAxis.of(2, 1), cube["tp"]]
    for key in spellings:
        x = spmd.assert_type(torch.randn(4), {key: R, "dp": I, "cp": V})
        assert spmd.get_type(x) == {"dp": I, "cp": V, "tp": R}, key
    mixed = spmd.assert_type(torch.randn(4), {Axis.DP: V, MeshAxis.of(2, 2): P, tp: I})
    assert spmd.get_type(mixed) == {"dp": V, "cp": P, "tp": I}


def test_two_keys_for_one_axis_agree_or_refine_v(cube):
    """torchtitan's ``{**spmd.get_local_type(x), group: spmd.S(1)}`` refines x's V to S(1), and a type read back
    with get_local_type may be changed by a later key; two types spelled for one axis (``{"tp": R, tp_group: V}``)
    are an error naming the axis."""
    x = spmd.assert_type(torch.randn(4, 6), {"dp": R, "cp": R, "tp": S(0)})
    out = spmd.assert_type(torch.randn(4, 6), {**spmd.get_local_type(x), cube.get_group("tp"): S(1)})
    assert spmd.get_type(out) == {"dp": R, "cp": R, "tp": S(1)}
    same = spmd.assert_type(torch.randn(4), {cube.get_group("tp"): I, "tp": I, "dp": V, "cp": V})
    assert spmd.get_type(same)["tp"] is I
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(torch.randn(4), {"tp": R, cube.get_group("tp"): V})
    assert str(info.value) == ("assert_type: axis 'tp' is given two types, R (key 'tp') and V (key ProcessGroup); an "
                               "axis has one type")
    changed = spmd.assert_type(torch.randn(4, 6), {**spmd.get_local_type(x), "cp": S(1)})  # R read back, changed
    assert spmd.get_type(changed) == {"dp": R, "cp": S(1), "tp": V}
    loss_types = dict(spmd.get_local_type(x))  # torchtitan's loss: the logits' types, tp changed to I
    loss_types[cube.get_group("tp")] = I
    assert spmd.get_type(spmd.assert_type(torch.randn(()), loss_types)) == {"dp": R, "cp": R, "tp": I}


def test_a_flattened_group_types_each_of_its_axes(cube):
    dp_cp = cube["dp", "cp"]._flatten("dp_cp").get_group()
    x = spmd.assert_type(torch.randn(4), {dp_cp: V, "tp": R})
    assert spmd.get_type(x) == {"dp": V, "cp": V, "tp": R}
    y = spmd.assert_type(torch.randn(4), {dp_cp: V, "cp": S(0), "tp": R})  # then cp alone, refining V
    assert spmd.get_type(y) == {"dp": V, "cp": S(0), "tp": R}
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(torch.randn(4), {dp_cp: V, "cp": P, "tp": R})
    assert str(info.value) == ("assert_type: axis 'cp' is given two types, V (key ProcessGroup) and P (key 'cp'); an "
                               "axis has one type")
    assert resolve_axes(dp_cp) == ("dp", "cp") and resolve_axes(MeshAxis.of(8, 1)) == ("dp", "cp", "tp")


# ---------------------------------------------------------------------------
# axes of size 1


def test_a_size_one_axis_carries_no_type(with_one):
    x = spmd.assert_type(torch.randn(4), {"dp": V, "pp": P, "tp": R})
    assert spmd.get_type(x) == {"dp": V, "tp": R} and spmd.get_local_type(x) == by_region({"dp": V, "tp": R})
    assert spmd.get_type(spmd.assert_type(torch.randn(4), {"pp": R, "dp": R, "tp": R})) == {"dp": R, "tp": R}
    assert resolve_axes("pp") == () and resolve_axes(with_one.get_group("pp")) == ()
    with simulate((1,), ("solo",)), spmd.typecheck():
        alone = spmd.assert_type(torch.randn(2), {"solo": V})
        assert spmd.get_type(alone) == {} and spmd.has_local_type(alone)
        assert spmd.current_mesh() == frozenset() and spmd.current_mesh_all_names() == {"solo": MeshAxis.of(1, 1)}


def test_values_that_differ_only_on_a_size_one_axis_mix(with_one):
    a = spmd.assert_type(torch.randn(4), {"dp": V, "pp": R, "tp": R})
    b = spmd.assert_type(torch.randn(4), {"dp": V, "pp": V, "tp": R})
    assert spmd.get_type(a + b) == {"dp": V, "tp": R}
    assert spmd.assert_type(a, {"pp": P}) is a  # nothing to compare on one rank


def test_a_collective_over_one_rank_is_an_identity_in_types():
    with simulate((2, 1, 2), ("dp", "pp", "tp"), ranks="local", device="cpu") as mesh, spmd.typecheck(strict=True):
        x = per_rank(lambda r: torch.arange(3.0) + 10 * r)
        spmd.assert_type(x, {"dp": V, "tp": S(0)})
        with CommCounter() as comms:
            y = spmd.all_reduce(x, "pp", src=P, dst=R)  # src is not checked on an axis with no type
            z = spmd.all_reduce(x, mesh.get_group("pp"), src=P, dst=I)
        assert spmd.get_type(y) == spmd.get_type(z) == {"dp": V, "tp": S(0)}
        assert comms.counts == {"all_reduce": 2}  # each runs over its group of one rank
        for r in range(4):
            torch.testing.assert_close(rank_values(y)[r], rank_values(x)[r])
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.all_reduce(x, "pp", src=R, dst=R)  # but the transition itself is still checked
        assert info.value.rule == ("spmd.all_reduce cannot take src=R to dst=R: seed 003's forward/backward table "
                                   "has no such all_reduce, so it has no backward.")


def test_mutate_type_on_a_size_one_axis_changes_nothing(with_one):
    x = spmd.assert_type(torch.randn(4), {"dp": R, "tp": R})
    assert spmd.mutate_type(x, "pp", src=P, dst=V) is x
    spmd.mutate_type(x, src={"dp": R, "pp": I}, dst={"dp": V, "pp": P})
    assert spmd.get_type(x) == {"dp": V, "tp": R}


def test_a_scalar_and_a_partition_spec_drop_size_one_axes(with_one):
    s = spmd.Scalar(2, {"dp": V, "pp": V, "tp": V})
    assert spmd.get_type(s) == {"dp": V, "tp": V}
    x = spmd.assert_type(torch.randn(8), {"dp": R, "pp": R, "tp": R})
    assert spmd.get_type(torch.narrow(x, 0, 0, s)) == {"dp": V, "tp": V}
    with spmd.typecheck(local=False):
        y = spmd.assert_type(torch.randn(4, 6), {"dp": R, "pp": R, "tp": V},
                             partition_spec=spmd.PartitionSpec(None, ("tp", "pp")))
        assert spmd.get_partition_spec(y) == spmd.PartitionSpec(None, "tp")
        assert spmd.normalize_partition_spec(spmd.PartitionSpec("pp", ("dp", "pp"))) == spmd.PartitionSpec(None, "dp")


def test_local_axes_skip_an_axis_of_one_rank(with_one):
    with spmd.set_current_mesh(None, local_axes=("pp",)) as m:
        assert m.local_axes == frozenset()
    with spmd.set_current_mesh(None, local_axes=("dp", "pp")) as m:
        assert m.local_axes == {"dp"}


# ---------------------------------------------------------------------------
# collectives over a flattened group, on simulated ranks against one device


@pytest.fixture
def cube_ranks():
    with simulate((2, 2, 2), ("dp", "cp", "tp"), ranks="local", device="cpu") as mesh, spmd.typecheck():
        yield mesh, mesh["dp", "cp"]._flatten("dp_cp").get_group()


def _values(*shape, key=lambda r: r):
    """Rank r holds a value that depends on ``key(r)`` only (r // 2: the same across tp)."""
    n = int(torch.tensor(shape).prod())
    return per_rank(lambda r: torch.arange(float(n), dtype=torch.float64).reshape(shape) * (key(r) + 1) + key(r))


def test_all_reduce_over_a_flattened_group(cube_ranks):
    mesh, dp_cp = cube_ranks
    x = spmd.assert_type(_values(3).requires_grad_(), {"dp": P, "cp": P, "tp": V})
    with CommCounter() as forward:
        y = spmd.all_reduce(x, dp_cp, src=P, dst=I)
    assert forward.counts == {"all_reduce": 1} and spmd.get_type(y) == {"dp": I, "cp": I, "tp": V}
    torch.testing.assert_close(denote(y, mesh, {"dp": I, "cp": I, "tp": V}),
                               denote(x, mesh, {"dp": P, "cp": P, "tp": V}))
    g = spmd.assert_type(per_rank(lambda r: torch.full((3,), float(r % 2 + 1), dtype=torch.float64)),
                         {"dp": I, "cp": I, "tp": V})
    with CommCounter() as backward:
        (y * g).sum().backward()
    assert backward.counts == {}  # P -> I: the gradient is already summed
    assert spmd.get_type(x.grad) == {"dp": R, "cp": R, "tp": V}
    torch.testing.assert_close(denote(x.grad, mesh, {"dp": R, "cp": R, "tp": V}), denote(g, mesh, spmd.get_type(g)))


def test_all_gather_and_reduce_scatter_over_a_flattened_group(cube_ranks):
    mesh, dp_cp = cube_ranks
    x = spmd.assert_type(_values(2, 3, key=lambda r: r // 2), {"dp": V, "cp": V, "tp": R})
    with CommCounter() as comms:
        y = spmd.all_gather(x, dp_cp, src=V, dst=R)
    assert comms.counts == {"all_gather": 1} and spmd.get_type(y) == {"dp": R, "cp": R, "tp": R}
    want = denote(x, mesh, {"dp": V, "cp": V, "tp": R})  # (dp, cp, 2, 3): dp outermost, as the group's ranks
    torch.testing.assert_close(denote(y, mesh, {"dp": R, "cp": R, "tp": R}), want.reshape(4, 2, 3))
    p = spmd.assert_type(_values(8), {"dp": P, "cp": P, "tp": V})
    with CommCounter() as comms:
        s = spmd.reduce_scatter(p, dp_cp, src=P, dst=S(0))
    assert comms.counts == {"reduce_scatter": 1} and spmd.get_type(s) == {"dp": S(0), "cp": S(0), "tp": V}
    have, summands = rank_values(s), rank_values(p)
    for r in range(8):  # rank (dp, cp, tp) = (r // 4, r // 2 % 2, r % 2): chunk dp * 2 + cp of the tp slice's sum
        total = sum(summands[q] for q in range(8) if q % 2 == r % 2)
        torch.testing.assert_close(have[r], total.chunk(4)[r // 2])


def test_a_flattened_group_checks_src_axis_by_axis(cube_ranks):
    _, dp_cp = cube_ranks
    x = spmd.assert_type(_values(2), {"dp": P, "cp": V, "tp": V})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.all_reduce(x, dp_cp, src=P, dst=R)
    assert info.value.plain.splitlines()[:4] == [
        "spmd.all_reduce's src= must be the input's type on the axis: src=P, but the tensor is V on axis 'cp'.",
        "  op:    spmd.all_reduce(x, ('dp', 'cp'), src=spmd.P, dst=spmd.R)",
        "  input: f64[2] {dp: P, cp: V, tp: V}",
        "  axis:  'cp': V is not P",
    ]
    assert info.value.fixes == ("spmd.all_gather(x, 'cp', src=spmd.V, dst=spmd.R)",)


def test_a_group_across_axes_that_is_no_flattening_is_refused(cube_ranks):
    odd = dist.new_group([0, 3])
    x = spmd.assert_type(_values(2), {"dp": P, "cp": P, "tp": P})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.all_reduce(x, odd, src=P, dst=R)
    assert info.value.rule == (
        "spmd.all_reduce runs over a process group (ranks 2:3) that is not an axis of the current mesh, nor a "
        "flattening of its axes, so the input's type says nothing about it.")
    assert info.value.seen[1:] == (("input", "f64[2] {dp: P, cp: P, tp: P}"), ("current mesh", "dp=2:4, cp=2:2, tp=2:1"))
    plain = _values(2)
    assert spmd.get_type(spmd.all_reduce(plain, odd, src=P, dst=R)) is None  # a plain tensor: erased, it runs
