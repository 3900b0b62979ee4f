"""Types given outside typecheck() (``_checker/latent.py``): recorded as given, resolved only when read or applied.

The record is kept cheap (``benchmarks/erased_assert.py``: under a microsecond for a tensor asserted
again), so it leaves the tensor untouched and keeps its entry in a table keyed by the tensor's id with
a weak reference: these tests pin that an entry is only ever read as its own tensor's record, that the
table stays bounded, and that everything the records stood for before (``get_local_type``,
``has_local_type``, typing when ``typecheck()`` starts, the mesh and process-group world they were given under) still holds.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from conftest import by_region, fake_mesh, fake_world

import spmd_types as spmd
from spmd_types._checker import latent

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


def test_an_erased_assert_leaves_the_tensor_untouched_and_its_type_is_read_back(mesh_dp_tp):
    x = torch.randn(4, 8)
    with spmd.set_current_mesh(mesh_dp_tp):
        assert spmd.assert_type(x, {"dp": V, "tp": S(1)}) is x
    assert type(x) is torch.Tensor and x.__dict__ == {}  # no attribute, no dict made for it
    assert spmd.has_local_type(x)
    with spmd.set_current_mesh(mesh_dp_tp):
        assert spmd.get_local_type(x) == by_region({"dp": V, "tp": V})  # resolved on demand, under its mesh
    assert latent.remembered(x)[:2] == ({"dp": V, "tp": S(1)}, None)  # the raw arguments, nothing resolved


def test_typecheck_applies_each_record_once_under_its_mesh(mesh_dp_tp):
    x, w = torch.randn(4, 8), torch.nn.Linear(8, 8)
    with spmd.set_current_mesh(mesh_dp_tp):
        spmd.assert_type(x, {"dp": V, "tp": S(1)})
        spmd.assert_type(w, {"dp": R, "tp": R})  # a module: each parameter recorded
    tp_only = {"tp": mesh_dp_tp.get_group("tp")}
    with spmd.set_current_mesh(tp_only), spmd.typecheck():  # another current mesh: the record's own is used
        assert spmd.get_type(x) == {"dp": V, "tp": S(1)}
        assert spmd.get_type(w.weight) == {"dp": R, "tp": R} and spmd.get_type(w.bias) == {"dp": R, "tp": R}
    assert latent.remembered(x) is None and not latent.RECORDS


def test_the_last_record_wins_and_a_tensor_has_one_entry(mesh_dp_tp):
    x = torch.randn(4)
    with spmd.set_current_mesh(mesh_dp_tp):
        before = len(latent.RECORDS)
        for ty in (R, I, V):
            spmd.assert_type(x, {"dp": R, "tp": ty})
        assert len(latent.RECORDS) == before + 1
        with spmd.typecheck():
            assert spmd.get_type(x) == {"dp": R, "tp": V}


def test_asserts_that_add_nothing_leave_the_joined_record_as_it_is(mesh_dp_tp):
    """Two dicts asserted in turn on one tensor (each naming some axes) join once; after that each says nothing
    the record does not, and the record is kept, not written again. A new axis, a changed type, another spec
    or another mesh still rewrites it."""
    x = torch.randn(4, 8)
    first, second = {"dp": V}, {"tp": R}
    with spmd.set_current_mesh(mesh_dp_tp):
        spmd.assert_type(x, first)
        spmd.assert_type(x, second)
        joined = latent.RECORDS[id(x)]
        assert joined[1] == {"dp": V, "tp": R}
        for types in (first, second, {"dp": V, "tp": R}):
            spmd.assert_type(x, types)
            assert latent.RECORDS[id(x)] is joined
        spmd.assert_type(x, {"tp": I})  # a changed type: written
        assert latent.RECORDS[id(x)][1] == {"dp": V, "tp": I}
        spec = ((), ("tp",))
        spmd.assert_type(x, {"dp": V}, partition_spec=spec)  # another spec: written
        assert latent.RECORDS[id(x)][2] is spec
        before = latent.RECORDS[id(x)]
    with spmd.set_current_mesh(mesh_dp_tp) as again:  # the same axes, another Mesh object: written, with it
        spmd.assert_type(x, {"dp": V})
        assert latent.RECORDS[id(x)] is not before and latent.RECORDS[id(x)][3] is again


def test_a_dead_tensors_entry_is_never_read_as_another_tensors_record(mesh_dp_tp):
    """The table is keyed by id, and ids are reused: an entry counts only while its reference points at the
    tensor asked about (here the reuse is forced: the dead tensor's entry is filed under the live one's id)."""
    gone = torch.randn(2)
    dead = weakref.ref(gone)
    del gone
    gc.collect()
    assert dead() is None
    y = torch.randn(2)
    latent.RECORDS[id(y)] = (dead, {"tp": P}, None, None, None)
    assert latent.remembered(y) is None and not spmd.has_local_type(y) and spmd.get_local_type(y) == {}
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        assert spmd.get_type(y) is None and type(y) is torch.Tensor  # not applied either


def test_the_table_stays_bounded_when_recorded_tensors_die(mesh_dp_tp):
    """A process that never checks and annotates a fresh batch every step holds a bounded table."""
    keep = [torch.randn(1) for _ in range(10)]
    with spmd.set_current_mesh(mesh_dp_tp):
        for t in keep:
            spmd.assert_type(t, {"dp": V})
        for _ in range(10 * latent._PRUNE_FLOOR):
            spmd.assert_type(torch.empty(1), {"dp": V})  # dies at once
    assert len(latent.RECORDS) < 2 * latent._PRUNE_FLOOR
    with spmd.set_current_mesh(mesh_dp_tp):
        assert all(spmd.get_local_type(t) == by_region({"dp": V}) for t in keep)  # the live ones, as named


def test_a_typed_tensor_is_not_recorded(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp):
        with spmd.typecheck():
            x = spmd.assert_type(torch.randn(4), {"dp": R, "tp": R})
        assert spmd.assert_type(x, {"dp": V, "tp": V}) is x  # outside checking: returned, type kept
        assert latent.remembered(x) is None and spmd.get_type(x) == {"dp": R, "tp": R}


def test_records_of_a_torn_down_world_are_not_applied():
    """A record belongs to the process-group world it was given in: after that world is destroyed and a new
    one made, typecheck() leaves the tensor plain (its axes meant other groups)."""
    fake_world(2)
    x = torch.randn(2)
    spmd.assert_type(x, {"tp": V})  # no mesh current: names, resolved when applied
    dist.destroy_process_group()
    mesh = fake_mesh((2,), ("tp",))
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        assert type(x) is torch.Tensor and spmd.get_type(x) is None
    y = torch.randn(2)
    spmd.assert_type(y, {"tp": V})  # made in this world: applied
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        assert spmd.get_type(y) == {"tp": V}


def test_assert_type_records_as_remember_does(mesh_dp_tp):
    """assert_type has remember()'s common case inline (an erased call is one Python frame): the same record."""
    types, spec = {"dp": V, "tp": S(0)}, spmd.PartitionSpec("tp", None)
    a, b = torch.randn(4, 2), torch.randn(4, 2)
    with spmd.set_current_mesh(mesh_dp_tp):
        spmd.assert_type(a, types, partition_spec=spec)
        latent.remember(b, types, spec)
    ra, rb = latent.remembered(a), latent.remembered(b)
    assert ra == rb and ra[0] is types and ra[1] is spec and ra[2] is not None
    assert ra[3] is dist.distributed_c10d._get_default_group()  # the world read without its property's call


def test_until_a_thread_checks_the_erased_assert_reads_a_global_and_checking_turns_it_off(mesh_dp_tp, monkeypatch):
    """The erased assert_type reads ``state.never_checked`` instead of the per-thread flag: every way checking
    turns on (typecheck(), the DTensor bridge's per-op checking) clears it first, so an assert under checking
    types its tensor even in a process that had never checked."""
    from spmd_types._core import state
    from spmd_types.integrations.dtensor.bridge import checked_local

    for turn_on in (lambda: spmd.typecheck(), lambda: checked_local(mesh_dp_tp)):
        monkeypatch.setattr(state, "never_checked", True)
        x = torch.randn(4)
        with spmd.set_current_mesh(mesh_dp_tp):
            spmd.assert_type(x, {"dp": R, "tp": R})
            assert type(x) is torch.Tensor and latent.remembered(x) is not None  # erased: recorded
            with turn_on():
                assert state.never_checked is False
                y = torch.randn(4)
                spmd.assert_type(y, {"dp": R, "tp": V})
                assert spmd.get_type(y) == {"dp": R, "tp": V} and latent.remembered(y) is None  # typed, not recorded


def test_only_the_known_places_turn_checking_on():
    """A new place that sets STATE.checking to True must call checking_turned_on() first (the test above shows
    what goes wrong otherwise): this lists every assignment of True in the package."""
    import pathlib
    import re

    root = pathlib.Path(spmd.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(STATE\.checking\b[^=]*)=\s*([^=].*)$", line)
            if m and m.group(2).split(",")[0].strip() == "True":
                found.add(str(path.relative_to(root)))
    # asserts.py and bridge.py call checking_turned_on(); no_typecheck.py restores True inside a checked call
    assert found == {"_checker/asserts.py", "integrations/dtensor/bridge.py", "_boundaries/no_typecheck.py"}, found
