"""Many meshes over the same ranks: reinterpret_mesh, implicit moves, same-named axes over other ranks.

A type is stated on a mesh; the same ranks can be presented as another mesh (a
flattened ``dp_cp``, an expert ``(edp, ep)``). Axes over the same ranks keep
their type; the others flatten group by group with one type per group; anything
else is refused with the reason. Numerics run on simulated ranks.
"""

from __future__ import annotations

import pytest
import torch
from conftest import by_region
from torch.distributed.device_mesh import init_device_mesh

import spmd_types as spmd
from spmd_types import MeshAxis
from spmd_types.testing import CommCounter, denote, per_rank, rank_values, simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
PS = spmd.PartitionSpec


def _meshes():
    """The dense (dp, cp, tp), flattened (dp_cp, tp) and expert (edp, ep) presentations of 8 ranks."""
    flat = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_cp", "tp"))
    expert = init_device_mesh("cpu", (2, 4), mesh_dim_names=("edp", "ep"))
    return flat, expert


@pytest.fixture
def fake():
    with simulate((2, 2, 2), ("dp", "cp", "tp")) as dense, spmd.typecheck():
        yield (dense, *_meshes())


@pytest.fixture
def ranks():
    with simulate((2, 2, 2), ("dp", "cp", "tp"), ranks="local", device="cpu") as dense, spmd.typecheck():
        yield (dense, *_meshes())


def _rank_ids():
    return per_rank(lambda r: torch.arange(3, dtype=torch.float64) + 10 * r)


# ---------------------------------------------------------------------------
# reinterpret_mesh


def test_flatten_and_unflatten_round_trip(ranks):
    dense, flat, _ = ranks
    x = spmd.assert_type(_rank_ids().requires_grad_(), {"dp": V, "cp": V, "tp": R})
    with CommCounter() as comms:
        with spmd.set_current_mesh(flat):
            y = spmd.reinterpret_mesh(x, spmd.current_mesh())
            assert spmd.get_type(y) == {"dp_cp": V, "tp": R}
        back = spmd.reinterpret_mesh(y, dense)
    assert comms.counts == {}
    assert spmd.get_type(back) == {"dp": V, "cp": V, "tp": R}
    assert y is not x and spmd.get_type(x) == {"dp": V, "cp": V, "tp": R}  # the input keeps its type
    for r in range(8):
        torch.testing.assert_close(rank_values(back)[r], rank_values(x)[r])
    g = per_rank(lambda r: torch.full((3,), float(r), dtype=torch.float64))
    with CommCounter() as comms:
        back.backward(g)
    assert comms.counts == {}  # nothing moves backward either
    assert spmd.get_type(x.grad) == {"dp": V, "cp": V, "tp": P}
    for r in range(8):
        torch.testing.assert_close(rank_values(x.grad)[r], torch.full((3,), float(r), dtype=torch.float64))


def test_dense_folds_onto_expert_and_back(fake):
    dense, _, expert = fake
    x = spmd.assert_type(torch.randn(4), {"dp": R, "cp": V, "tp": V})
    with spmd.set_current_mesh(expert):
        e = spmd.reinterpret_mesh(x, spmd.current_mesh())
        assert spmd.get_type(e) == {"edp": R, "ep": V}
        assert spmd.get_type(spmd.reinterpret_mesh(e, dense)) == {"dp": R, "cp": V, "tp": V}
    p = spmd.assert_type(torch.randn(4), {"dp": P, "cp": P, "tp": P})
    assert spmd.get_type(spmd.reinterpret_mesh(p, expert)) == {"edp": P, "ep": P}


def test_every_form_of_the_target_mesh(fake):
    dense, flat, _ = fake
    x = spmd.assert_type(torch.randn(4), {"dp": V, "cp": V, "tp": I})
    groups = {"dp_cp": flat.get_group("dp_cp"), "tp": flat.get_group("tp")}
    regions = {"dp_cp": MeshAxis.of(4, 2), "tp": MeshAxis.of(2, 1)}
    for target in (flat, groups, regions):
        assert spmd.get_type(spmd.reinterpret_mesh(x, target)) == {"dp_cp": V, "tp": I}
    # a collection of axes with no names: the names the regions were given
    assert spmd.get_type(spmd.reinterpret_mesh(x, frozenset(regions.values()))) == {"dp_cp": V, "tp": I}
    assert spmd.reinterpret_mesh(x, dense) is x  # already there


def test_refused_when_a_flattened_group_mixes_types(fake):
    _, flat, _ = fake
    x = spmd.assert_type(torch.randn(4), {"dp": R, "cp": V, "tp": V})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.reinterpret_mesh(x, flat)
    assert info.value.rule == (
        "spmd.reinterpret_mesh: the tensor's type cannot move onto the target mesh: axes (dp, cp) would flatten into "
        "(dp_cp), but their types differ (dp: R, cp: V); a flattened axis has one type.")
    assert info.value.seen == (("types", "{cp: V, dp: R, tp: V}"), ("target", "dp_cp=4:2, tp=2:1"))


def test_refused_when_axes_of_one_size_run_over_other_ranks(fake):
    dense, _, _ = fake
    with spmd.set_current_mesh(dense["cp", "tp"]):
        x = spmd.assert_type(torch.randn(4), {"cp": V, "tp": R})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.reinterpret_mesh(x, dense["dp", "tp"])
    assert info.value.rule == (
        "spmd.reinterpret_mesh: the tensor's type cannot move onto the target mesh: axes (cp) and (dp) have the same "
        "size but run over different ranks (2:2 vs 2:4).")


def test_refused_when_the_meshes_cover_different_ranks(fake):
    dense, flat, _ = fake
    x = spmd.assert_type(torch.randn(4), {"dp": V, "cp": V, "tp": R})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.reinterpret_mesh(x, dense["dp", "tp"])
    assert info.value.rule == ("spmd.reinterpret_mesh: the tensor's type cannot move onto the target mesh: axes (cp) "
                               "of the tensor's mesh have no counterpart in the target mesh (dp, tp).")
    with spmd.set_current_mesh(dense["tp"]):
        t = spmd.assert_type(torch.randn(4), {"tp": R})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.reinterpret_mesh(t, flat)
    assert info.value.rule == ("spmd.reinterpret_mesh: the tensor's type cannot move onto the target mesh: the "
                               "target mesh's axes (dp_cp) cover ranks the tensor's type says nothing about (its axes: "
                               "tp).")


def test_outside_typecheck_it_is_the_identity():
    with simulate((2, 2, 2), ("dp", "cp", "tp")):
        flat, _ = _meshes()
        x = torch.randn(4)
        assert spmd.reinterpret_mesh(x, flat) is x


def test_the_partition_spec_moves_with_the_type():
    with simulate((2, 2, 2), ("dp", "cp", "tp")), spmd.typecheck(local=False):
        flat, _ = _meshes()
        x = spmd.assert_type(torch.randn(4, 6), {"dp": V, "cp": V, "tp": R}, PS(("dp", "cp"), None))
        y = spmd.reinterpret_mesh(x, flat)
        assert spmd.get_type(y) == {"dp_cp": V, "tp": R}
        assert spmd.get_partition_spec(y) == PS("dp_cp", None)
        z = spmd.assert_type(torch.randn(4, 6), {"dp": V, "cp": V, "tp": R}, PS("cp", "dp"))
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.reinterpret_mesh(z, flat)
    assert info.value.rule == (
        "spmd.reinterpret_mesh: the tensor's partition spec cannot move onto the target mesh: dim 0 is sharded on "
        "('cp',), which splits a group of axes that moves as one (('dp', 'cp') -> ('dp_cp',)).")


# ---------------------------------------------------------------------------
# implicit moves


def test_an_op_moves_its_operands_onto_the_current_mesh(ranks):
    dense, flat, _ = ranks
    x = spmd.assert_type(_rank_ids(), {"dp": V, "cp": V, "tp": R})
    with spmd.set_current_mesh(flat):
        y = spmd.assert_type(per_rank(lambda r: torch.ones(3, dtype=torch.float64) * (r // 2)), {"dp_cp": V, "tp": R})
        z = x * y
        assert spmd.get_type(z) == {"dp_cp": V, "tp": R}
    for r in range(8):
        torch.testing.assert_close(rank_values(z)[r], rank_values(x)[r] * (r // 2))
    assert spmd.get_type(x * y) == {"dp": V, "cp": V, "tp": R}  # under the dense mesh, y moves instead
    mixed = spmd.assert_type(torch.ones(3), {"dp": R, "cp": V, "tp": R})
    with spmd.set_current_mesh(flat), pytest.raises(spmd.SpmdTypeError) as info:
        mixed * y
    assert info.value.rule == (
        "Tensor.__mul__ (*) mixes tensors typed on different meshes, and input cannot be moved onto the current mesh: "
        "axes (dp, cp) would flatten into (dp_cp), but their types differ (dp: R, cp: V); a flattened axis has one "
        "type.")


def test_a_collective_moves_its_input_onto_the_current_mesh(ranks):
    dense, flat, _ = ranks
    x = spmd.assert_type(_rank_ids(), {"dp": P, "cp": P, "tp": V})
    with spmd.set_current_mesh(flat):
        with CommCounter() as comms:
            y = spmd.all_reduce(x, "dp_cp", src=P, dst=I)
        assert comms.counts == {"all_reduce": 1} and spmd.get_type(y) == {"dp_cp": I, "tp": V}
        summed = denote(y, flat, {"dp_cp": I, "tp": V})
    torch.testing.assert_close(summed, denote(x, dense, {"dp": P, "cp": P, "tp": V}))
    mixed = spmd.assert_type(torch.ones(3), {"dp": P, "cp": V, "tp": V})
    with spmd.set_current_mesh(flat), pytest.raises(spmd.SpmdTypeError) as info:
        spmd.all_reduce(mixed, "dp_cp", src=P, dst=I)
    assert info.value.rule == (
        "spmd.all_reduce's input is typed on another mesh and cannot be moved onto the current one: axes (dp, cp) "
        "would flatten into (dp_cp), but their types differ (dp: P, cp: V); a flattened axis has one type.")
    assert info.value.fixes == ("spmd.reinterpret_mesh(x, mesh) onto a mesh over the same ranks",)


# ---------------------------------------------------------------------------
# the same name over other ranks: compared by regions, never by names


@pytest.fixture
def swapped(fake):
    """A mesh over the same ranks whose 'tp' is the dense mesh's dp, and whose 'dp' is the dense tp."""
    dense = fake[0]
    x = spmd.assert_type(torch.randn(4), {"dp": R, "cp": V, "tp": V})
    other = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("tp", "cp", "dp"))
    with spmd.set_current_mesh(other):
        yield dense, x


def test_an_assert_compares_regions_not_names(swapped):
    """Found by this test: an assert on 'tp' compared the dense mesh's tp (V), which here is 'dp'."""
    _, x = swapped
    assert spmd.assert_type(x, {"tp": R}) is x
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(x, {"tp": V})
    assert info.value.rule == "Type assertion failed: the tensor is R on axis 'tp', and the assertion says V."
    assert spmd.get_type(x) == {"tp": R, "cp": V, "dp": V}  # it now reads on the current mesh


def test_reading_and_retyping_compare_regions_not_names(swapped):
    dense, x = swapped
    assert spmd.get_local_type(x) == by_region({"tp": R, "cp": V, "dp": V})
    like = spmd.assert_type_like(torch.randn(4), x)
    assert spmd.get_type(like) == {"tp": R, "cp": V, "dp": V}
    spmd.mutate_type(x, "tp", src=R, dst=I)
    assert spmd.get_type(x) == {"tp": I, "cp": V, "dp": V}
    with spmd.set_current_mesh(dense):
        assert spmd.get_local_type(x) == by_region({"dp": I, "cp": V, "tp": V})


def test_a_declared_output_compares_regions_not_names(swapped):
    dense, x = swapped
    def same(t):
        return t

    assert spmd.get_type(spmd.local_map(out_types={"tp": R, "cp": V, "dp": V})(same)(x)) == {"tp": R, "cp": V, "dp": V}
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.local_map(out_types={"tp": V, "cp": V, "dp": V})(same)(x)
    assert info.value.rule.endswith("same is R on axis 'tp', and out_types declares V.")


def test_an_assert_that_cannot_move_says_why(fake):
    dense, flat, _ = fake
    x = spmd.assert_type(torch.randn(4), {"dp": R, "cp": V, "tp": V})
    with spmd.set_current_mesh(flat), pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(x, {"tp": V})
    assert info.value.rule == (
        "assert_type: the tensor is typed on another mesh, and its type cannot move onto the current one: axes (dp, "
        "cp) would flatten into (dp_cp), but their types differ (dp: R, cp: V); a flattened axis has one type.")


# ---------------------------------------------------------------------------
# nested meshes


def test_nested_meshes_keep_their_own_local_axes(fake):
    dense = fake[0]
    with spmd.set_current_mesh(None, local_axes=("dp",)), spmd.typecheck(local=False):
        a = spmd.assert_type(torch.randn(4), {"dp": V, "cp": R, "tp": S(0)})  # dp is local: V needs no layout
        assert spmd.get_partition_spec(a) == PS("tp")
        with spmd.set_current_mesh(dense), pytest.raises(spmd.SpmdTypeError) as info:
            spmd.assert_type(torch.randn(4), {"dp": V, "cp": R, "tp": S(0)})
        assert info.value.rule.startswith("Global SPMD: the tensor is V on axis 'dp', which is checked in global SPMD")


def test_global_spmd_moves_an_operands_partition_spec_too():
    """Found by this test: under another presentation an op dropped the operand's layout (spec (None, None)), or
    refused two operands whose layouts agree ('sharded on no axis')."""
    with simulate((2, 2, 2), ("dp", "cp", "tp")), spmd.typecheck(local=False):
        flat, _ = _meshes()
        x = spmd.assert_type(torch.randn(4, 6), {"dp": V, "cp": V, "tp": R}, PS(("dp", "cp"), None))
        with spmd.set_current_mesh(flat):
            y = spmd.assert_type(torch.randn(4, 6), {"dp_cp": V, "tp": R}, PS("dp_cp", None))
            doubled, total = x * 2, x + y
        assert spmd.get_type(doubled) == spmd.get_type(total) == {"dp_cp": V, "tp": R}
        assert spmd.get_partition_spec(doubled) == spmd.get_partition_spec(total) == PS("dp_cp", None)
        back = x * 2  # under the dense mesh again
        assert spmd.get_type(back) == {"dp": V, "cp": V, "tp": R}
        assert spmd.get_partition_spec(back) == PS(("dp", "cp"), None)
        split = spmd.assert_type(torch.randn(4, 6), {"dp": V, "cp": V, "tp": R}, PS("cp", "dp"))
        with spmd.set_current_mesh(flat), pytest.raises(spmd.SpmdTypeError) as info:
            split * 2
    assert info.value.rule == (
        "Global SPMD: Tensor.__mul__ (*) has an operand typed on another mesh, and it cannot move onto the current "
        "one: dim 0 is sharded on ('cp',), which splits a group of axes that moves as one (('dp', 'cp') -> "
        "('dp_cp',)).")


def test_the_target_given_as_a_type(fake):
    """reinterpret_mesh(t, {axis: type}): the target's axes, and the type the caller expects there."""
    dense, flat, _ = fake
    x = spmd.assert_type(torch.randn(4), {"dp": V, "cp": V, "tp": R})
    dp_cp, tp = flat.get_group("dp_cp"), spmd.MeshAxis.of(2, 1)
    y = spmd.reinterpret_mesh(x, {dp_cp: V, tp: R})
    assert spmd.get_type(y) == {"dp_cp": V, "tp": R}
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.reinterpret_mesh(x, {dp_cp: V, tp: I})
    assert info.value.rule == ("spmd.reinterpret_mesh: the tensor's type moves onto axis 'tp' as R, and the declared "
                               "type says I.")
