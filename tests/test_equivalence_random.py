"""check_equivalence never passes silently (issue 22 item 2): random draws replayed and checked per rank, steps that repeat.

The parallel run's random draws are replayed on one device, so a step with dropout is compared value by
value in every dtype; each draw is also checked against the stream its type asks for (R/I: every rank
alike; V/S(d) on a model axis: each rank its own). A step that does not repeat, or whose float64 run
strays from its run in ``dtype``, raises ``NondeterministicStepError`` naming the value and the fix.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _rng_streams import fork

import spmd_types as spmd
from spmd_types.testing import NondeterministicStepError, check_equivalence

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
DIMS = {"*": {"dp": 0}}


def _tp(mesh) -> int:
    return mesh.size(mesh.mesh_dim_names.index("tp"))


class DropMLP(nn.Module):
    """Column-parallel fc1, dropout on its tp-sharded hidden units, row-parallel fc2, dropout on the I output.

    The hidden dropout runs in the model-parallel stream (``hidden_seed`` plus the tp rank, as Megatron's
    tracker seeds it), the output dropout in the default stream, which every tp rank shares.
    """

    def __init__(self, mesh, *, same_hidden_seed: bool = False, per_rank_output: bool = False) -> None:
        super().__init__()
        tp = _tp(mesh)
        self.same_hidden_seed, self.per_rank_output = same_hidden_seed, per_rank_output
        self.tp_group = mesh.get_group("tp")
        self.fc1 = nn.Linear(8, 16 // tp)
        self.fc2 = nn.Linear(16 // tp, 8, bias=False)
        self.hidden_dropout, self.out_dropout = nn.Dropout(0.3), nn.Dropout(0.2)
        for p, t in ((self.fc1.weight, S(0)), (self.fc1.bias, S(0)), (self.fc2.weight, S(1))):
            spmd.assert_type(p, {"dp": R, "tp": t})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(spmd.convert(x, "tp", src=I, dst=R)))
        tp_rank = dist.get_rank(self.tp_group)
        # BUG (same_hidden_seed): the model-parallel stream seeded alike on every tp rank
        with fork(1000 + (0 if self.same_hidden_seed else tp_rank)):
            h = self.hidden_dropout(h)
        out = spmd.all_reduce(self.fc2(h), "tp", src=V, dst=I)
        if self.per_rank_output:  # BUG: the replicated output's dropout in the per-rank stream
            with fork(2000 + tp_rank):
                return self.out_dropout(out)
        return self.out_dropout(out)


def step(model: nn.Module, batch: dict, mesh) -> torch.Tensor:
    loss = (model(batch["x"]) ** 2).mean()
    loss.backward()
    for p in model.parameters():
        p.grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R, op="avg")
    return spmd.all_reduce(loss.detach(), "dp", src=V, dst=I, op="avg")


def batch() -> dict:
    return {"x": (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), {"dp": S(0), "tp": I})}


def _check(dtype=torch.float64, **bugs):
    return check_equivalence(lambda mesh: DropMLP(mesh, **bugs), step, batch(), output_dims=DIMS, dtype=dtype)


def _margin(report) -> float:
    return min((c.tolerance / c.max_abs_error if c.max_abs_error else math.inf) for c in report.compared)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_dropout_seeded_as_the_tracker_seeds_it_matches_in_every_dtype(dtype):
    report = _check(dtype)
    assert report.ok, report
    draws = [c for c in report.compared if c.kind == "random"]
    assert [(c.name, c.ranks) for c in draws] == [("hidden_dropout", ()), ("out_dropout", ())]
    assert _margin(report) > 4


def test_the_same_dropout_seed_on_every_tp_rank_is_caught_at_the_draw():
    report = _check(torch.float32, same_hidden_seed=True)
    first = report.first
    assert (first.kind, first.name, first.ranks) == ("random", "hidden_dropout", (0, 1, 2, 3))
    assert first.reason == (
        "ranks 0, 1, 2, 3 draw the same numbers on 'tp', where the value is V: each rank of 'tp' holds its own "
        "piece and must draw its own (a stream seeded per rank of 'tp', e.g. torch.manual_seed(seed + "
        "dist.get_rank(group)))")
    assert first.source.endswith("h = self.hidden_dropout(h)")
    assert "The first: the random draw in hidden_dropout: ranks 0, 1, 2, 3 draw the same numbers" in str(report)


def test_a_replicated_value_dropped_out_per_rank_is_caught_at_the_draw():
    first = _check(per_rank_output=True).first
    assert (first.kind, first.name, first.ranks) == ("random", "out_dropout", (1, 3))
    assert first.reason == (
        "ranks 1, 3 draw other numbers than their peers on 'tp', where the value is I: every rank of 'tp' holds the "
        "same value and must draw the same numbers (one stream, seeded alike on 'tp')")


# ---------------------------------------------------------------------------
# steps that cannot be compared


class Plain(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.w = spmd.assert_type(nn.Parameter(torch.ones(4)), {"tp": I})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _plain_check(step_fn, dtype=torch.float64):
    return check_equivalence(Plain, step_fn, {"x": (torch.ones(3, 4), {"tp": I})}, mesh_shape=(2,), names=("tp",),
                             dtype=dtype)


def test_a_step_that_carries_state_between_runs_is_refused():
    schedule = itertools.count(1)  # a warm-up schedule object made outside build(): every run advances it

    def warming_up(model, batch, mesh):
        loss = model(batch["x"]).sum() * min(1.0, next(schedule) / 10)
        loss.backward()
        return loss

    with pytest.raises(NondeterministicStepError) as err:
        _plain_check(warming_up)
    assert str(err.value) == (
        "check_equivalence: the step is not deterministic: run twice on one device from the same start and batch, "
        "the loss differs by 1.2e+00 (largest entry 2.4e+00). A step that carries state between runs (a "
        "schedule, a counter or a generator made outside build()) or draws random numbers outside torch (Python's "
        "random, NumPy) cannot be compared: keep its state in build() or step, seed inside step (torch.manual_seed, "
        "per rank as the trainer does), or draw with torch")


def test_a_step_that_draws_outside_torch_is_refused():
    def noisy(model, batch, mesh):
        loss = (model(batch["x"]) * random.random()).sum()
        loss.backward()
        return loss

    with pytest.raises(NondeterministicStepError) as err:
        _plain_check(noisy)
    assert str(err.value).startswith("check_equivalence: the step is not deterministic: run twice on one device from "
                                     "the same start and batch, the loss differs by ")


def test_a_step_that_computes_otherwise_in_float64_is_refused_below_float64():
    def by_dtype(model, batch, mesh):
        out = model(batch["x"])
        loss = (out * (3.0 if out.dtype == torch.float64 else 1.0)).sum()  # a branch on the dtype
        loss.backward()
        return loss

    assert _plain_check(by_dtype).ok  # in float64 there is no second dtype to stray from
    with pytest.raises(NondeterministicStepError) as err:
        _plain_check(by_dtype, torch.float32)
    assert str(err.value) == (
        "check_equivalence: the step computes differently in float32 and in float64 beyond round-off: the loss "
        "differs by 2.4e+01 between the two one-device runs (67% of it, 3.6e+01), so round-off cannot set a "
        "tolerance. A draw outside torch, a branch on the dtype, or a choice that round-off flips (top-k, argmax on "
        "near ties) does this: draw with torch, or check in float64 (dtype=torch.float64)")


def test_a_draw_mixed_with_its_input_cannot_be_replayed():
    def leaky(model, batch, mesh):
        loss = F.rrelu(model(batch["x"]) - 2, training=True).sum()  # rrelu draws its slopes inside the op
        loss.backward()
        return loss

    with pytest.raises(NondeterministicStepError) as err:
        _plain_check(leaky)
    assert str(err.value).startswith(
        "check_equivalence replays the ranks' random draws on one device, but cannot replay the draw of "
        "rrelu_with_noise in step at tests/test_equivalence_random.py:")
    assert str(err.value).endswith(
        ": rrelu_with_noise mixes its draw with its input, so its draw cannot be replayed. Or compare with the random "
        "op off (dropout 0, model.eval())")


def test_an_untyped_draw_that_differs_per_rank_cannot_be_placed():
    def jitter(model, batch, mesh):
        with fork(dist.get_rank(mesh.get_group("tp"))):
            noise = torch.rand(4)  # drawn for no typed value, per rank
        loss = (model(batch["x"]) + noise).sum()
        loss.backward()
        return loss

    with pytest.raises(NondeterministicStepError) as err:
        _plain_check(jitter)
    assert str(err.value).endswith(
        "drawn for no typed value, and the ranks drew different numbers: type the value the numbers are drawn for "
        "(dropout's input). Or compare with the random op off (dropout 0, model.eval())")
