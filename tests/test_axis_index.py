"""``spmd.axis_index(axis)``: this rank's index, typed V on the axis and R elsewhere; no communication."""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import CommCounter, per_rank, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


def _values(t: torch.Tensor) -> dict[int, int]:
    return {r: int(v) for r, v in rank_values(t).items()}


def test_each_simulated_rank_gets_its_index(mesh_dp_tp):
    # mesh (dp=2, tp=4): global rank r sits at dp = r // 4, tp = r % 4.
    with LocalTensorMode(8), spmd.set_current_mesh(mesh_dp_tp):
        with CommCounter() as comms:
            tp, dp = spmd.axis_index("tp"), spmd.axis_index("dp")
            both = spmd.axis_index(("dp", "tp"))
        assert comms.total == 0
        assert tp.dtype == torch.int64 and tp.dim() == 0
        assert _values(tp) == {r: r % 4 for r in range(8)}
        assert _values(dp) == {r: r // 4 for r in range(8)}
        assert _values(both) == {r: r for r in range(8)}
        assert spmd.get_type(tp) is None  # erased outside typecheck


def test_typed_v_on_the_axis_r_elsewhere(mesh_dp_tp):
    with LocalTensorMode(8), spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        rank = spmd.axis_index("tp")
        assert spmd.get_type(rank) == {"dp": R, "tp": V}
        assert spmd.get_type(spmd.axis_index(("dp", "tp"))) == {"dp": V, "tp": V}
        # A per-rank mask from the rank is V, and so is what it selects from an R value.
        ids = spmd.assert_type(per_rank(lambda r: torch.arange(8)), {"dp": R, "tp": R})
        mask = (ids // 2) == rank
        assert spmd.get_type(mask) == {"dp": R, "tp": V}
        assert {r: v.nonzero().flatten().tolist() for r, v in rank_values(mask).items()} == {
            r: [2 * (r % 4), 2 * (r % 4) + 1] for r in range(8)
        }


def test_the_index_on_a_real_fake_pg_is_this_ranks():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        rank = spmd.axis_index(mesh["tp"])  # a 1-D DeviceMesh as the axis
        assert int(rank) == 0 and type(rank) is spmd.LTensor
        assert spmd.get_type(rank) == {"dp": R, "tp": V}
        assert rank.device.type == "cpu"


def test_an_axis_index_typed_v_cannot_pose_as_replicated(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        rank = spmd.axis_index("tp")
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.assert_type(rank, {"tp": R})
    assert info.value.rule == "Type assertion failed: the tensor is V on axis 'tp', and the assertion says R."


def test_global_spmd_asks_for_a_local_axis(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=False):
        with pytest.raises(spmd.SpmdTypeError) as info:
            spmd.axis_index("tp")
    assert info.value.rule == (
        "spmd.axis_index is V on axis 'tp', which is checked in global SPMD, where a per-rank value has no global "
        "meaning."
    )
    assert list(info.value.fixes) == ["call it inside spmd.local_map(..., axes=['tp'])",
                                      "spmd.typecheck(local=['tp']) to check that axis locally"]
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=["tp"]):
        assert spmd.get_type(spmd.axis_index("tp")) == {"dp": R, "tp": V}


def test_bad_axes(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp):
        with pytest.raises(ValueError) as info:
            spmd.axis_index("pp")
        assert str(info.value) == "spmd.axis_index: unknown mesh axis 'pp'; the current mesh has axes 'dp', 'tp'"
        with pytest.raises(TypeError) as info:
            spmd.axis_index(3)
        assert str(info.value) == "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got int"
    with pytest.raises(RuntimeError) as info:
        spmd.axis_index("tp")
    assert str(info.value) == (
        "spmd.axis_index: axis 'tp' is a name, but no mesh is current: wrap the code in "
        "`with spmd.set_current_mesh(mesh):`"
    )
