"""torch 2.14 calls spmd_types: FSDP2's ``fully_shard(..., dp_mesh_dims=...)`` on spmd-typed parameters.

torch's own code runs here, not a copy: ``_fsdp_param.py`` reads the types of
plain parameters to build their DTensor storage and restores them on the
unsharded parameters for compute (``_restore_spmd_types``). Checked: the
storage placements, the restored types and the gradients' types (P on the dp
axes, pending FSDP's reduce-scatter), loss and gradients equal to checking off
and to one device on real gloo processes; FSDP's own errors for a parameter
typed V or I on a dp axis reach the user unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import fake_mesh, torch_calls_spmd_types

import spmd_types as spmd

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not torch_calls_spmd_types():
    pytest.skip("FSDP2 reads spmd types from torch 2.14 on (torch 2.13's fully_shard(dp_mesh_dims=) takes DTensors "
                "only)", allow_module_level=True)

import _fsdp_spmd as F  # noqa: E402

R, I, V, S = spmd.R, spmd.I, spmd.V, spmd.S


@pytest.fixture(scope="module", params=sorted(F.LAYOUTS))
def gloo_rows(request, tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    layout = request.param
    world = 1
    for n in F.LAYOUTS[layout][0]:
        world *= n
    out = tmp_path_factory.mktemp(layout)
    mp.start_processes(F.worker, args=("file://" + str(out / "store"), str(out), layout), nprocs=world,
                       start_method="spawn")
    rows = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for row in rows:
        assert row["error"] is None, row["error"]
    return layout, rows


def test_storage_placements_follow_the_types(gloo_rows):
    layout, rows = gloo_rows
    # w1 is S(0) on tp and FSDP shards dim 0 too (strided, as FSDP does under a tp shard of that dim); w2 is S(1)
    rep = [] if layout == "fsdp_tp" else ["R"]  # HSDP: replicated over dp_replicate
    for row in rows:
        assert row["placements"] == {"w1": rep + ["_S(0, 2)", "S(0)"], "w2": rep + ["S(0)", "S(1)"]}
        assert row["grad placements"] == row["placements"]


def test_types_are_restored_for_compute_and_gradients_are_pending_sums_on_dp(gloo_rows):
    layout, rows = gloo_rows
    dp = "{'dp_shard': R, 'tp': V}" if layout == "fsdp_tp" else "{'dp_replicate': R, 'dp_shard': R, 'tp': V}"
    grad = dp.replace(": R", ": P")
    for row in rows:
        assert row["seen"] == {"w1": dp, "w2": dp, "w1.grad": grad}
        loss_type = "{'dp_shard': V, 'tp': I}" if layout == "fsdp_tp" else "{'dp_replicate': V, 'dp_shard': V, 'tp': I}"
        assert row["typed loss type"] == loss_type


def test_loss_and_gradients_equal_checking_off_and_one_device(gloo_rows):
    _, rows = gloo_rows
    ref_loss, ref_w1, ref_w2 = rows[0]["reference"]
    mean_loss = sum(r["typed loss"] for r in rows) / len(rows)  # every tp rank of a dp rank has its loss
    assert mean_loss == pytest.approx(ref_loss, rel=1e-12)
    for row in rows:
        assert row["typed loss"] == row["erased loss"]
        assert row["grads"] == row["erased grads"]  # exactly
        torch.testing.assert_close(torch.tensor(row["grads"]["w1"]), torch.tensor(ref_w1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.tensor(row["grads"]["w2"]), torch.tensor(ref_w2), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# FSDP's own refusals, triggered by our types, reach the user unchanged (a fake process group: no numerics)


@pytest.mark.parametrize("wrong", [V, I], ids=["V", "I"])
def test_a_parameter_typed_varying_or_invariant_on_a_dp_axis_gets_fsdps_error(wrong):
    mesh = fake_mesh((2, 2), ("dp_shard", "tp"))
    mlp = F.MLP(2, 0)
    with spmd.set_current_mesh(mesh):
        spmd.assert_type(mlp.w1, {"dp_shard": wrong, "tp": S(0)})
        spmd.assert_type(mlp.w2, {"tp": S(1)})
        with pytest.raises(ValueError) as info:
            fsdp.fully_shard(mlp, mesh=mesh, dp_mesh_dims=fsdp.DataParallelMeshDims(shard="dp_shard"))
    assert str(info.value) == (
        f"Expected spmd.R on FSDP DP axis dp_shard for parameter 'w1' but got {wrong}. FSDP requires DP parameters "
        "to be R since it handles the DP gradient reduction.")


def test_partial_types_with_no_current_mesh_get_fsdps_error():
    mesh = fake_mesh((2, 2), ("dp_shard", "tp"))
    mlp = F.MLP(2, 0)
    with spmd.set_current_mesh(mesh):
        F.type_parameters(mlp)
    with pytest.raises(ValueError, match=r"Parameter 'w1' has partial spmd_types annotations .* wrap fully_shard\(\) "
                                         r"in spmd.set_current_mesh\(\.\.\.\)"):
        fsdp.fully_shard(mlp, mesh=mesh, dp_mesh_dims=fsdp.DataParallelMeshDims(shard="dp_shard"))
