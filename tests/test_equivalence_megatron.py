"""check_equivalence on Megatron-core 0.16.1's GPTModel, unmodified, against the same code on one device (issue 17).

GPTModel (local layer spec) at tp=2 with and without sequence parallelism, dp=2, typed through
``spmd_types.megatron``, runs on 4 simulated ranks and on a one-device mesh (tp=1): every module output,
the loss, every gradient and every updated weight match, in float64 and, with no false alarm, in
bfloat16. Then type-invisible bugs, each a test-local
copy of one Megatron function with one line changed, a checkpoint loader, or a dropout in the wrong RNG
stream (tests/_equivalence_megatron.py): each diverges, and ``report.first`` names the module where it
starts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import _equivalence_megatron as M  # noqa: E402
import torch  # noqa: E402
from _megatron_support import accommodate_cpu  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from spmd_types.testing import check_equivalence  # noqa: E402

MEGATRON = "/megatron/core/"


@pytest.fixture
def cpu(monkeypatch):
    """Megatron's two CPU accommodations for one test, undone after it; its parallel state torn down."""
    accommodate_cpu(monkeypatch.setattr)
    yield monkeypatch
    ps.destroy_model_parallel()


def _check(sp: bool = False, layouts=None, **build):
    return check_equivalence(lambda mesh: M.build(mesh, sp, **build), M.step, M.batch(), output_dims=M.OUTPUT_DIMS,
                             layouts=layouts)


def _where(source: str) -> str:
    """``file:line: code`` with Megatron's installed path shortened to ``megatron/core/...``."""
    path, _, rest = source.partition(":")
    if MEGATRON in path:
        path = "megatron/core/" + path.split(MEGATRON, 1)[1]
    return f"{path}:{rest}"


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
def test_gpt_model_matches_one_device(cpu, sp):
    report = _check(sp)
    assert report.ok, report
    assert report.not_compared == []
    kinds = [c.kind for c in report.compared]
    assert (kinds.count("output"), kinds.count("loss"), kinds.count("grad"), kinds.count("update")) == (50, 1, 29, 29)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
def test_no_false_alarm_in_bfloat16(cpu, sp):
    report = check_equivalence(lambda mesh: M.build(mesh, sp), M.step, M.batch(), output_dims=M.OUTPUT_DIMS,
                               dtype=torch.bfloat16)
    assert report.ok, report
    # SGD at lr 0.1 moves most weights by less than bfloat16 resolves (a LayerNorm weight of 1.0 not at all):
    # those updates are listed as not compared, with the reason, rather than held to a tolerance that passes all.
    # The word embedding, the output layer and both fc2 weights are compared by the scale of the entries that stand out
    assert len(report.compared) == 98 and {n.kind for n in report.not_compared} == {"update"}
    assert len(report.not_compared) == 11
    # the closest value stays this many times under its tolerance (measured: about 10.7; docs/equivalence.md)
    assert min(c.tolerance / c.max_abs_error for c in report.compared if c.max_abs_error) > 4


def test_bug_vocab_parallel_cross_entropy_with_the_local_max(cpu):
    from megatron.core.tensor_parallel import cross_entropy

    cpu.setattr(cross_entropy._VocabParallelCrossEntropy, "forward", staticmethod(M.vocab_parallel_ce_local_max))
    first = _check().first
    # the loss is computed inside GPTModel.forward (no submodule of its own): the model's output is where it starts
    assert (first.name, first.kind, first.ranks) == ("GPTModel", "output", ())
    assert _where(first.source).startswith("megatron/core/models/common/language_module/language_module.py:")


def test_bug_embedding_output_mask_dropped(cpu):
    from megatron.core.tensor_parallel import layers

    cpu.setattr(layers.VocabParallelEmbedding, "forward", M.embedding_without_output_mask)
    first = _check().first
    assert (first.name, first.kind, first.ranks) == ("embedding.word_embeddings", "output", ())
    assert _where(first.source) == ("megatron/core/tensor_parallel/mappings.py:478: return "
                                    "_ReduceFromModelParallelRegion.apply(input_, group)")


def test_bug_fused_qkv_checkpoint_split_as_contiguous_q_k_v(cpu):
    assert _check(layouts=M.qkv_layouts(contiguous=False)).ok  # the loader that keeps Megatron's per-head layout
    report = _check(layouts=M.qkv_layouts(contiguous=True))
    first = report.first
    assert (first.name, first.kind) == ("decoder.layers.0.self_attention.linear_qkv", "output")
    assert _where(first.source) == "megatron/core/tensor_parallel/layers.py:490: output = output + bias"
    assert {d.name for d in report.divergences if d.kind == "grad"} >= {
        "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_qkv.bias"}


def test_dropout_is_replayed_and_checked_per_rank(cpu):
    # The residual and attention dropouts draw on the ranks; the one-device runs replay their draws, so the
    # model with dropout matches value by value. The attention dropout runs in the model-parallel stream
    # (Megatron's RNG tracker, seeded per tp rank: each rank's heads draw their own).
    from megatron.core.tensor_parallel import random as mrandom

    cpu.setattr(mrandom.CudaRNGStatesTracker, "fork", M.cpu_rng_tracker())
    report = _check(dropout=0.1, attention_dropout=0.1)
    assert report.ok, report
    draws = [c.name for c in report.compared if c.kind == "random"]
    assert draws == [name for layer in ("0", "1") for name in (
        f"decoder.layers.{layer}.self_attention.core_attention.attention_dropout", f"decoder.layers.{layer}",
        f"decoder.layers.{layer}#1")]


def test_bug_residual_dropout_in_the_per_tp_rank_rng_stream(cpu):
    first = _check(dropout=0.1, per_tp_rank_dropout=True).first
    assert (first.name, first.kind, first.ranks) == ("decoder.layers.0", "random", (1, 3))
    assert first.reason.startswith("ranks 1, 3 draw other numbers than their peers on 'tp', where the value is I")
    assert _where(first.source).startswith("megatron/core/fusions/fused_bias_dropout.py:")


def test_bug_attention_dropout_with_the_same_seed_on_every_tp_rank(cpu):
    from megatron.core.tensor_parallel import random as mrandom

    cpu.setattr(mrandom.CudaRNGStatesTracker, "fork", M.cpu_rng_tracker(same_seed_on_every_tp_rank=True))
    first = _check(attention_dropout=0.1).first
    assert (first.name, first.kind, first.ranks) == (
        "decoder.layers.0.self_attention.core_attention.attention_dropout", "random", (0, 1, 2, 3))
    assert first.reason.startswith("ranks 0, 1, 2, 3 draw the same numbers on 'tp', where the value is V")
    assert _where(first.source).startswith("megatron/core/transformer/dot_product_attention.py:")


# ---------------------------------------------------------------------------
# the MoE GPTModel: experts over ep, named by reference_names


@pytest.fixture
def moe_cpu(monkeypatch):
    from _megatron_moe_support import accommodate_moe_cpu

    accommodate_moe_cpu(monkeypatch.setattr)
    yield monkeypatch
    ps.destroy_model_parallel()


def _check_moe(shape: tuple[int, int], over: str):
    return check_equivalence(M.build_moe, M.step_moe, M.batch(), mesh_shape=shape, output_dims=M.OUTPUT_DIMS,
                             reference_names=M.local_experts(over))


def test_moe_gpt_model_with_experts_over_dp_matches_one_device(moe_cpu):
    report = _check_moe((2, 2), "dp")  # tp=2 (sequence parallel), ep=2 over dp's ranks, etp=2
    assert report.ok, report
    experts = [c.name for c in report.compared if c.kind == "grad" and ".local_experts." in c.name]
    assert len(experts) == 8  # 2 layers x 2 local experts x fc1, fc2: each rank's against its own reference
    assert {n.reason.split(":")[0] for n in report.not_compared} == {
        "the output of a module named by reference_names (an expert)", "its ranks hold different shapes ([(21, 16), "
        "(43, 16)])", "its ranks hold different shapes ([(30, 16), (34, 16)])",
        "V on 'tp' whose pieces make the reference's shape [32, 4] on no dim (local [8, 4])"}


def test_bug_moe_router_logits_stabilized_over_the_tokens(moe_cpu):
    from megatron.core.transformer.moe.router import TopKRouter

    moe_cpu.setattr(TopKRouter, "gating", M.router_max_over_tokens(TopKRouter.gating))
    report = _check_moe((1, 2), "tp")  # tp=2 (sequence parallel), ep=2 over tp's ranks, etp=1
    first = report.first
    assert (first.name, first.kind) == ("decoder.layers.0.mlp.router", "output"), report
    # the router's output is made in Megatron's routing function, downstream of the planted line in gating
    assert _where(first.source).startswith("megatron/core/transformer/moe/moe_utils.py:")
