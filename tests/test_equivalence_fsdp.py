"""FSDP2 (``fully_shard``) inside ``check_equivalence``: FSDP's all-gather and reduce-scatter run on the simulated ranks.

torch's simulator alone refuses FSDP2 (its all-gather resizes storage: test_torchtitan_fsdp.py pins the error);
``simulate(ranks="local")``, and so ``check_equivalence``, runs FSDP's storage resizing, shard picking and group
ranks per simulated rank (``spmd_types/testing/_simulate_fsdp.py``). Checked: plain FSDP on a 1-D mesh (the
default group) and on the dp axis of a 2-D mesh gives the one-device gradients, with a different shard on each dp
rank; a typed TP MLP under FSDP x TP (dp2 x tp2, FSDP's strided shard of the tp-sharded dim) matches one device
in float32; FSDP-specific mistakes (a gradient divide factor that sums instead of averaging, a float16 reduce) are
caught at the gradients, after the outputs and the loss matched. torchtitan's llama3 with FSDP applied is in
test_torchtitan_equivalence.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import torch_calls_spmd_types

import spmd_types as spmd
from spmd_types._torch.private import fsdp_slots, strided_shard_class
from spmd_types.testing import check_equivalence, per_rank, rank_values, simulate

if not torch_calls_spmd_types():
    pytest.skip("FSDP2 reads spmd types from torch 2.14 on", allow_module_level=True)

from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


# ---------------------------------------------------------------------------
# plain FSDP on simulated ranks


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


@pytest.mark.parametrize("shape, names", [((2,), ("dp",)), ((2, 2), ("dp", "tp"))], ids=["dp2", "dp2 x tp2"])
def test_plain_fsdp_on_simulated_ranks_gives_the_one_device_gradients(shape, names):
    w1, w2, x = _weights()
    before = [vars(owner)[name] for owner, name in fsdp_slots()]
    with simulate(shape, names, ranks="local", device="cpu") as mesh:
        dp = mesh["dp"] if len(shape) > 1 else mesh
        model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(w1)
            model[2].weight.copy_(w2)
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=dp)
        shards = rank_values(model[0].weight.to_local())
        tp = shape[-1] if len(shape) > 1 else 1
        rows = per_rank(lambda r: x[2 * (r // tp):2 * (r // tp) + 2].clone())  # each dp rank its own two rows
        for _ in range(2):  # the second step re-gathers into storage the first one freed
            model(rows).pow(2).sum().backward()
        grads = [rank_values(p.grad.to_local()) for p in model.parameters()]
    assert [vars(owner)[name] for owner, name in fsdp_slots()] == before  # FSDP's own functions again
    last = len(shards) - 1
    torch.testing.assert_close(shards[0], w1[:4], rtol=0, atol=0)
    torch.testing.assert_close(shards[last], w1[4:], rtol=0, atol=0)  # the last dp rank holds the other half
    r1, r2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    for _ in range(2):
        (F.relu(x @ r1.T) @ r2.T).pow(2).sum().backward()
    for got, ref in zip(grads, (r1.grad / 2, r2.grad / 2)):  # FSDP averages over dp
        torch.testing.assert_close(torch.cat([got[0], got[last]]), ref, rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------
# a typed TP MLP under FSDP x TP through check_equivalence


class ColumnParallel(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16 // tp, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(F.linear(spmd.convert(x, "tp", src=I, dst=R), self.weight))


class RowParallel(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16 // tp) / 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return spmd.all_reduce(F.linear(h, self.weight), "tp", src=V, dst=I)


class MLP(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.up, self.down = ColumnParallel(tp), RowParallel(tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _build(mesh, *, divide_factor: float | None = None, reduce_dtype: torch.dtype | None = None,
           built: list | None = None) -> MLP:
    model = MLP(mesh.size(1))
    with spmd.no_typecheck():  # as torchtitan parallelizes: types given and FSDP applied outside typecheck()
        spmd.assert_type(model.up.weight, {"tp": S(0)})
        spmd.assert_type(model.down.weight, {"tp": S(1)})
        if mesh.size(0) > 1:  # FSDP on the dp axis; on one device the plain model is the reference
            policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"), mp_policy=policy)
            if divide_factor is not None:  # BUG when not the dp size: FSDP's reduce-scatter divides by it
                model.set_gradient_divide_factor(divide_factor)
    if built is not None:
        built.append(model)
    return model


def _step(model: nn.Module, batch: dict, mesh) -> torch.Tensor:
    loss = model(batch["x"]).pow(2).mean()  # this dp rank's rows; FSDP averages the gradients over dp
    loss.backward()
    total = spmd.all_reduce(spmd.reinterpret(loss.detach(), "dp", src=V, dst=P), "dp", src=P, dst=I)
    return total / mesh.size(0)


def _check(**kwargs):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    return check_equivalence(lambda mesh: _build(mesh, **kwargs), _step, {"x": (x, {"dp": S(0), "tp": I})},
                             mesh_shape=(2, 2), names=("dp", "tp"), dtype=torch.float32,
                             output_dims={"up": {"dp": 0, "tp": 1}})


def _margin(report) -> float:
    return min((c.tolerance / c.max_abs_error if c.max_abs_error else math.inf) for c in report.compared)


def test_typed_fsdp_x_tp_mlp_matches_one_device_in_float32():
    built: list = []
    report = _check(built=built)
    assert report.ok, report
    assert report.not_compared == []
    assert [(c.kind, c.name) for c in report.compared] == [
        ("output", "up"), ("output", "down"), ("output", "MLP"), ("loss", "loss"),
        ("grad", "up.weight"), ("grad", "down.weight")]
    assert _margin(report) > 4  # measured 9.7 (docs/equivalence.md)
    parallel = [m for m in built if isinstance(m, FSDPModule)]
    assert len(parallel) == 1  # the parallel run's model, FSDP applied; the reference runs are plain
    up, down = parallel[0].up.weight, parallel[0].down.weight
    assert isinstance(up.placements[0], strided_shard_class())  # dp shards dim 0 inside tp's shard of it
    assert str(down.placements) == "(Shard(dim=0), Shard(dim=1))"


@pytest.mark.parametrize("factor", [1.0, 4.0], ids=["summed", "divided by 4"])
def test_bug_fsdp_gradient_divide_factor_is_caught_at_the_gradients(factor):
    report = _check(divide_factor=factor)
    # FSDP's reduce-scatter sums the dp ranks' gradients and divides by the factor, not by dp=2: the outputs and
    # the loss match, and the first divergence is the first gradient
    assert not report.ok
    assert [(d.kind, d.name) for d in report.divergences] == [("grad", "up.weight"), ("grad", "down.weight")]
    assert report.first.max_abs_error > 1000 * report.first.tolerance


def test_fsdp_gradient_divide_factor_of_the_dp_size_is_fsdps_mean():
    report = _check(divide_factor=2.0)
    assert report.ok, report


def test_bug_fsdp_reduce_in_float16_is_caught_at_the_gradients():
    report = _check(reduce_dtype=torch.float16)
    assert [(d.kind, d.name) for d in report.divergences] == [("grad", "up.weight"), ("grad", "down.weight")]
    assert report.first.max_abs_error > 10 * report.first.tolerance
