"""torchtitan 0.3.0's own models through check_equivalence, with no rank shims (issue 22 items 1 to 5).

``tests/_equivalence_torchtitan.py`` builds each model the trainer's way and runs the trainer's forward and
backward; the only accommodations are the CPU ones of ``_torchtitan_shims.load`` (CPU device, FlexAttention as
dense math, the experts' grouped matmul in float32, no ``fully_shard``). torchtitan's embedding and loss read
their rank with ``dist.get_rank(group)``, which check_equivalence answers per simulated rank. The full table
(model x layout x dtype) is ``benchmarks/equivalence_torchtitan.py``'s, quoted in docs/equivalence.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import _equivalence_torchtitan as E  # noqa: E402
import torch  # noqa: E402
from _torchtitan_shims import fsdp_reads_spmd_types, load  # noqa: E402

from spmd_types.testing import check_equivalence  # noqa: E402


def _check(opts: E.Options, shape: tuple[int, int], dtype: torch.dtype = torch.float32):
    return check_equivalence(lambda mesh: E.build(mesh, opts), lambda m, b, mesh: E.step(m, b, mesh, opts),
                             E.batch(opts, shape[0]), mesh_shape=shape, names=("dp", "tp"), dtype=dtype)


def _margin(report) -> float:
    return min((c.tolerance / c.max_abs_error if c.max_abs_error else math.inf) for c in report.compared)


def _torchtitan_line(path: str, code: str) -> str:
    """``torchtitan/<path>:N: code`` for the one line of the installed torchtitan file that is ``code``."""
    import torchtitan

    lines = (Path(torchtitan.__file__).parent / path).read_text().splitlines()
    (n,) = [i for i, text in enumerate(lines, 1) if text.strip() == code]
    return f"torchtitan/{path}:{n}: {code}"


def _shown(source: str) -> str:
    return "torchtitan/" + source.split("/torchtitan/", 1)[1]


@pytest.mark.parametrize("model, shape, sp, dtype", [
    ("llama3", (1, 2), False, torch.float32),
    ("qwen3", (2, 2), True, torch.bfloat16),
], ids=["llama3-tp2-float32", "qwen3-dp2xtp2+SP-bfloat16"])
def test_dense_models_match_one_device_with_no_rank_shims(model, shape, sp, dtype):
    load()
    import torch.distributed as dist
    import torchtitan.components.loss as loss
    import torchtitan.models.common.embedding as embedding

    assert embedding.dist is dist and loss.dist is dist and "min" not in vars(loss)  # nothing patched in
    report = _check(E.Options(model=model, sp=sp), shape, dtype)
    assert report.ok, report
    assert report.not_compared == []
    assert _margin(report) > 4  # measured: docs/equivalence.md


def _fsdp_applied(seen: list):
    def record(model, parallel_dims) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        if parallel_dims.dp_shard > 1:
            seen.append(isinstance(model, FSDPModule) and all(isinstance(p, DTensor) for p in model.parameters()))

    return record


def _fsdp_mean(model, parallel_dims) -> None:
    # BUG: FSDP's default, the mean over dp, which torchtitan turns off (divide factor 1): its loss is already
    # divided by the global token count, so the dp ranks' gradients must be summed
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(parallel_dims.dp_shard))


@pytest.mark.skipif(not fsdp_reads_spmd_types(), reason="torch 2.13's FSDP2 does not read spmd types")
def test_llama3_with_fsdp_applied_matches_one_device():
    # issue 22 item 1: dp_shard=2 x tp=2 with torchtitan's fully_shard applied, so FSDP's all-gather and
    # reduce-scatter run on the simulated ranks inside the compared step
    seen: list = []
    report = _check(E.Options(model="llama3", fsdp=True, after_build=_fsdp_applied(seen)), (2, 2))
    assert seen == [True]  # the parallel run's model is FSDP's, its parameters sharded DTensors
    assert report.ok, report
    assert report.not_compared == []
    assert len([c for c in report.compared if c.kind == "grad"]) == 10
    assert _margin(report) > 4  # measured 11.6, as without FSDP (docs/equivalence.md)


@pytest.mark.slow
@pytest.mark.skipif(not fsdp_reads_spmd_types(), reason="torch 2.13's FSDP2 does not read spmd types")
def test_bug_llama3_fsdp_gradients_averaged_over_dp_is_caught_at_the_gradients(request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("nightly: the MLP of test_equivalence_fsdp.py plants FSDP's divide factor in CI (-m slow runs it)")
    report = _check(E.Options(model="llama3", fsdp=True, after_build=_fsdp_mean), (2, 2))
    assert {d.kind for d in report.divergences} == {"grad"}  # outputs and loss match: the reduction is wrong
    assert report.first.name == "tok_embeddings.weight"


def test_qwen3_moe_at_ep2_matches_one_device():
    report = _check(E.Options(model="qwen3_moe", sp=True, ep=2), (1, 2))
    assert report.ok, report
    assert [c.name for c in report.compared if c.kind == "grad" and "inner_experts" in c.name] == [
        "layers.0.moe.routed_experts.inner_experts.w1_EFD", "layers.0.moe.routed_experts.inner_experts.w2_EDF",
        "layers.0.moe.routed_experts.inner_experts.w3_EFD"]  # stacked experts, S(0) on ep: cut by their type


def _router_dropout(same_seed_on_every_tp_rank: bool):
    """TokenChoiceTopKRouter.forward with dropout on its input, drawn in a stream seeded per tp rank: each rank's
    tokens (split over tp under sequence parallelism) get their own mask."""
    import torch.distributed as dist
    from _rng_streams import Streams
    from torchtitan.distributed.spmd_types import current_spmd_mesh
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    original, streams = TokenChoiceTopKRouter.forward, Streams()

    def forward(self, x_BLD, expert_bias_E=None):
        tp_rank = dist.get_rank(current_spmd_mesh().get_group("tp")) if x_BLD.shape[1] < E.SEQ else 0
        # BUG (same_seed_on_every_tp_rank): the dropout's stream seeded alike on every tp rank
        with streams.fork("router-dropout", 1234 + (0 if same_seed_on_every_tp_rank else tp_rank)):
            x_BLD = torch.nn.functional.dropout(x_BLD, p=0.1, training=True)
        return original(self, x_BLD, expert_bias_E)

    return forward


@pytest.mark.parametrize("bug", [False, True], ids=["seeded-per-rank", "BUG-same-seed"])
def test_moe_router_dropout_is_replayed_and_its_seed_checked(monkeypatch, bug):
    load()
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    monkeypatch.setattr(TokenChoiceTopKRouter, "forward", _router_dropout(same_seed_on_every_tp_rank=bug))
    report = _check(E.Options(model="qwen3_moe", sp=True, ep=2), (1, 2))
    if not bug:
        assert report.ok, report
        return
    first = report.first
    assert (first.kind, first.name, first.ranks) == ("random", "layers.0.moe.router", (0, 1))
    assert first.source.endswith("x_BLD = torch.nn.functional.dropout(x_BLD, p=0.1, training=True)")


def _embedding_reads_the_dp_group(model, parallel_dims) -> None:
    if model.tok_embeddings.tp_group is not None:  # BUG: the vocab offset read from the dp group's rank
        model.tok_embeddings.tp_group = parallel_dims.spmd_dense_mesh().get_group("dp")


def test_bug_embedding_rank_from_the_wrong_group_points_into_torchtitan():
    report = _check(E.Options(model="llama3", after_build=_embedding_reads_the_dp_group), (2, 2))
    first = report.first
    assert (first.kind, first.name) == ("output", "tok_embeddings")
    # the embedding's output is made in torchtitan's local_map boundary (its redistribution to the declared type)
    assert _shown(first.source) == _torchtitan_line("distributed/spmd_types.py", "x = spmd.redistribute(")


def _adamw(lr_over_tp: bool):
    def make(named, lr, parallel_dims):
        norms = [p for n, p in named if "norm" in n]
        sharded = [p for n, p in named if "norm" not in n]  # every other llama3 weight is S(d) on tp
        # BUG (lr_over_tp): the sharded weights' learning rate divided by tp
        shard_lr = lr / parallel_dims.tp if lr_over_tp else lr
        return torch.optim.AdamW([{"params": sharded, "lr": shard_lr}, {"params": norms, "lr": lr}], lr=lr)

    return make


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_bug_learning_rate_divided_by_tp_on_shards_is_caught_with_a_margin_of_ten(dtype):
    # float64: torchtitan's loss still computes in float32. In float32 the least margin is the embedding's (39; 5.7
    # while the scale asked for half of an update's entries): only the rows the batch reaches stand out of float32's
    # round-off, the others move by weight decay alone
    opts = E.Options(model="llama3", lr=1e-4, optimizer=_adamw(lr_over_tp=True))
    report = _check(opts, (1, 2), dtype)
    first = report.first
    assert first.kind == "update" and "norm" not in first.name, report
    assert all(d.kind == "update" for d in report.divergences)  # outputs, loss and gradients match
    assert [d.name for d in report.divergences] == [
        c.name for c in report.compared if c.kind == "update" and "norm" not in c.name]  # every sharded weight
    assert min(d.max_abs_error / d.tolerance for d in report.divergences) >= 10


def test_a_correct_adamw_step_matches_in_float32():
    report = _check(E.Options(model="llama3", lr=1e-4, optimizer=_adamw(lr_over_tp=False)), (1, 2))
    assert report.ok, report
    assert report.not_compared == []
    assert _margin(report) > 4  # measured 16.2: docs/equivalence.md
