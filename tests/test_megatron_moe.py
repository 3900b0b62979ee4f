"""Megatron-core 0.16.1 mixture of experts, unmodified, typechecked with ``spmd_types.megatron`` (issue 16).

* the dense mesh and the expert mesh (edp, ep, etp) over the same ranks; the mesh an MoE layer runs on;
* MoE ``GPTModel`` (local spec, SequentialMLP experts, top-2 router with the aux loss) with both token
  dispatchers at tp=2 with sequence parallelism, ep=2, dp=4 (edp=2) on a fake process group of 8: no false
  alarm, every gradient typed as Megatron means it; more layouts (ep=1, ep=4, Megatron's parallel folding
  with etp=1, a layer mesh finer than both) likewise;
* Megatron's DistributedDataParallel + finalize_model_grads: expert gradients synced over edp, tracked;
* 4 gloo processes: typed loss and gradients equal untyped exactly, and equal one device (tp=ep=1 with the
  reassembled weights, every dp rank's micro-batch) to float32 round-off;
* every message the MoE registrations add, pinned. The planted bugs are in test_megatron_moe_bugs.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _megatron_moe_support import (  # noqa: E402
    CONFIGS,
    DDP_CONFIGS,
    WORLD,
    accommodate_moe_cpu,
    fake_moe,
    moe_config,
    typed_moe_step,
    worker,
)
from _megatron_support import forward_backward, launch_gloo, make_batch, typed_inputs  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

import spmd_types as spmd  # noqa: E402
from spmd_types import megatron as spmd_megatron  # noqa: E402
from spmd_types._core.types import TypeMap  # noqa: E402
from spmd_types.integrations.megatron import moe as _moe  # noqa: E402
from spmd_types.integrations.megatron import rules as _rules  # noqa: E402

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def cpu(monkeypatch):
    """The CPU accommodations for one test, undone after it; Megatron's parallel state torn down."""
    accommodate_moe_cpu(monkeypatch.setattr)
    yield monkeypatch
    ps.destroy_model_parallel()


def _ranks(mesh: dict) -> dict:
    return {name: dist.get_process_group_ranks(g) for name, g in mesh.items()}


# ---------------------------------------------------------------------------
# meshes


def test_dense_and_expert_meshes_over_the_same_ranks(cpu):
    fake_moe(2, 2, 8, "alltoall")
    assert _ranks(spmd_megatron.mesh()) == {"dp": [0, 2, 4, 6], "tp": [0, 1]}
    assert _ranks(spmd_megatron.mesh(expert=True)) == {"edp": [0, 4], "ep": [0, 2], "etp": [0, 1]}
    # every dense axis is an expert axis or a flattening of expert axes: the layer runs on the expert mesh
    expert = spmd_megatron.mesh(expert=True)
    assert spmd_megatron.layer_mesh(spmd_megatron.mesh(), expert) is expert
    with spmd.set_current_mesh(expert):
        assert spmd_megatron.axes_of_group(ps.get_expert_tensor_and_model_parallel_group()) == ("ep", "etp")
        assert spmd_megatron.axes_of_group(ps.get_data_parallel_group()) == ("edp", "ep")
        assert spmd_megatron.axes_of_group(ps.get_tensor_model_parallel_group()) == ("etp",)


def test_an_expert_axis_across_dense_axes_gives_a_finer_layer_mesh(cpu):
    # tp=2, etp=1, ep=4 on 8 ranks: ep runs over tp and half of dp, so the router's tp reductions and the
    # dispatcher's ep exchange need a mesh whose axes flatten into both: (edp, ep.dp, tp).
    fake_moe(2, 4, 8, "alltoall", etp=1)
    dense, expert = spmd_megatron.mesh(), spmd_megatron.mesh(expert=True)
    assert _ranks(expert) == {"edp": [0, 4], "ep": [0, 1, 2, 3], "etp": [0]}
    layer = spmd_megatron.layer_mesh(dense, expert)
    assert {n: a.layout_str() for n, a in layer.items()} == {"edp": "2:4", "ep.dp": "2:2", "tp": "2:1"}
    with spmd.set_current_mesh(layer):
        assert spmd_megatron.axes_of_group(ps.get_expert_model_parallel_group()) == ("ep.dp", "tp")
        assert spmd_megatron.axes_of_group(ps.get_data_parallel_group()) == ("edp", "ep.dp")


def test_a_group_of_one_rank_is_no_axis(cpu):
    fake_moe(2, 1, 4, "alltoall")
    with spmd.set_current_mesh(spmd_megatron.mesh(expert=True)):
        assert spmd_megatron.axes_of_group(ps.get_expert_model_parallel_group()) == ()


# ---------------------------------------------------------------------------
# the model on a fake process group: no false alarm, gradients typed


def _expected_grad_type(name: str, p) -> dict:
    if ".local_experts." in name:
        return {"edp": P, "ep": V, "etp": S(p.partition_dim)}
    tp = S(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else (
        P if getattr(p, "sequence_parallel", False) else I)
    return {"dp": P, "tp": tp}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_gpt_typechecks_without_false_alarm(cpu, dispatcher):
    # tp=2 with sequence parallelism, ep=2, dp=4 (edp=2), top-2 routing, aux loss on: 8 fake ranks.
    model, batch = fake_moe(2, 2, 8, dispatcher)
    loss = typed_moe_step(model, batch)
    assert spmd.get_type(loss) == {"dp": V, "tp": I}
    got = {n: spmd.get_type(p.grad) for n, p in model.named_parameters()}
    assert got == {n: _expected_grad_type(n, p) for n, p in model.named_parameters()}
    assert sum(".local_experts." in n for n in got) == 8 and sum(".router." in n for n in got) == 2


@pytest.mark.parametrize("dispatcher,tp,ep,world,etp", [
    ("alltoall", 2, 1, 4, None), ("allgather", 2, 1, 4, None),  # ep=1: Megatron's all_to_all over one rank
    ("alltoall", 1, 4, 4, None), ("allgather", 1, 2, 4, None),  # no tensor parallelism
    ("alltoall", 2, 2, 4, 1), ("allgather", 2, 2, 4, 1),        # parallel folding: etp=1, ep over the tp ranks
    ("alltoall", 2, 4, 8, 1), ("allgather", 2, 4, 8, 1),        # ep across tp and dp: the finer layer mesh
    ("alltoall", 1, 1, 4, 2),                                   # etp=2 beside tp=1 (Megatron-LM #1628's layout)
], ids=lambda v: str(v))
def test_more_layouts_typecheck_without_false_alarm(cpu, dispatcher, tp, ep, world, etp):
    model, batch = fake_moe(tp, ep, world, dispatcher, etp=etp)
    loss = typed_moe_step(model, batch)
    assert spmd.get_type(loss) == ({"dp": V, "tp": I} if tp > 1 else {"dp": V})
    for name, p in model.named_parameters():
        assert spmd.get_type(p.grad) is not None, name


def test_expert_parameters_are_typed_on_the_expert_mesh(cpu):
    model, _ = fake_moe(2, 2, 8, "alltoall")
    with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
        typed = spmd_megatron.type_parameters(model)
        fc1 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
        # (edp: R, ep: V) has no one type on the dense dp that flattens them: it reads on its own mesh
        assert spmd.get_type(fc1) == {"edp": R, "ep": V, "etp": S(0)}
    assert typed["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == {"edp": R, "ep": V,
                                                                                      "etp": S(0)}
    assert typed["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"] == {"edp": R, "ep": V,
                                                                                      "etp": S(1)}
    assert typed["decoder.layers.0.mlp.router.weight"] == {"dp": R, "tp": R}


def test_ddp_syncs_expert_gradients_over_edp_tracked(cpu):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    model, batch = fake_moe(2, 2, 8, "alltoall")
    ddp = DistributedDataParallel(moe_config(2, 2, 2, "alltoall"), DistributedDataParallelConfig(), model)
    with spmd.set_current_mesh(spmd_megatron.mesh()):
        with spmd.typecheck():
            spmd_megatron.type_parameters(ddp)
        tracker = spmd_megatron.track_grad_sync(ddp)
        with spmd.typecheck():
            forward_backward(ddp, typed_inputs(batch))
        assert tracker.unsynced()["module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == ["edp"]
        with tracker:
            finalize_model_grads([ddp])
    assert tracker.unsynced() == {}
    assert tracker.grad_type("module.decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight") == {
        "edp": R, "ep": V, "etp": S(1)}
    assert tracker.grad_type("module.decoder.layers.0.mlp.router.weight") == {"dp": R, "tp": R}


# ---------------------------------------------------------------------------
# numbers: 4 gloo processes


@pytest.fixture(scope="module")
def gloo_rows(tmp_path_factory):
    return launch_gloo(worker, WORLD, tmp_path_factory.mktemp("megatron_moe_gloo"))


@pytest.mark.parametrize("dispatcher,tp,ep,etp", CONFIGS, ids=lambda v: str(v))
def test_gloo_typed_equals_untyped_equals_one_device(gloo_rows, dispatcher, tp, ep, etp):
    for rank in range(WORLD):
        row = gloo_rows[(rank, f"{dispatcher}_tp{tp}_ep{ep}_etp{etp}")]
        assert "error" not in row, row.get("error")
        assert row["loss_typed_vs_untyped"] == 0.0 and row["grad_typed_vs_untyped"] == 0.0
        assert row["loss_vs_one_device"] < 1e-5 and row["grad_vs_one_device"] < 1e-5 * row["grad_scale"], row
        assert row["loss_type"] == "{'dp': V, 'tp': I}" and row["n_params"] == 27


@pytest.mark.parametrize("dispatcher,tp,ep,etp", DDP_CONFIGS, ids=lambda v: str(v))
def test_gloo_ddp_synced_gradients_equal_one_device_average(gloo_rows, dispatcher, tp, ep, etp):
    for rank in range(WORLD):
        row = gloo_rows[(rank, f"ddp_{dispatcher}_tp{tp}_ep{ep}_etp{etp}")]
        assert "error" not in row, row.get("error")
        assert row["unsynced"] == {} and row["expert_grad_type"] == "{'edp': R, 'ep': V}"
        assert row["grad_vs_one_device"] < 1e-5 * row["grad_scale"], row


# ---------------------------------------------------------------------------
# the registrations' own messages


def _tm(**types) -> TypeMap:
    return TypeMap.of(types)


def test_every_moe_message(cpu):
    fake_moe(2, 2, 8, "alltoall")
    cases = [
        (lambda: _moe._aux_loss_rule(_tm(edp=V, ep=V, etp=V), _tm(edp=V, ep=V, etp=I)),
         "MoEAuxLossAutoScaler adds each rank's aux loss to the objective, but the aux loss is I on 'etp': the "
         "same value on every rank, so it would be counted once per rank"),
        (lambda: _moe._random_ste_rule(_tm(edp=V, ep=I, etp=V)),
         "RandomSTE draws different logits on every rank and passes the gradient straight back, so the gradient "
         "reaching its I input on 'ep' would differ per rank"),
    ]
    group = ps.get_expert_model_parallel_group()
    a2a = [
        (lambda: _rules._all_to_all_rule(group, _tm(edp=V, ep=V, etp=V), [3, 5, 1], [4, 4], shapes=(None, (8, 2))),
         "Megatron's all_to_all: output_split_sizes has 3 entries for a group of 2 ranks"),
        (lambda: _rules._all_to_all_rule(group, _tm(edp=V, ep=V, etp=V), [3, 5], [4, 5], shapes=(None, (8, 2))),
         "Megatron's all_to_all: input_split_sizes add up to 9 rows, but the input has 8: the rows sent would "
         "not be this rank's rows"),
    ]
    with spmd.set_current_mesh(spmd_megatron.mesh(expert=True)):
        for call, rule in cases + a2a:
            got = call()
            assert isinstance(got, spmd._core.errors.Rejection) and got.rule == rule, (got, rule)
        assert _moe._aux_loss_rule(_tm(edp=V, ep=V, etp=V), _tm(edp=V, ep=V, etp=V)) == {"edp": V, "ep": V,
                                                                                        "etp": V}
        # a pending sum: the ones reach each rank's piece, which is the gradient of the sum
        assert _moe._aux_loss_rule(_tm(edp=V, ep=V, etp=V), _tm(edp=V, ep=P, etp=V)) == {"edp": V, "ep": V,
                                                                                        "etp": V}
        assert _moe._random_ste_rule(_tm(edp=R, ep=V, etp=V)) == {"edp": V, "ep": V, "etp": V}
    with pytest.raises(NotImplementedError) as err:
        _moe._fused_dispatch_rule("FusedDispatch")(_tm(edp=V))
    assert str(err.value) == ("spmd_megatron: typing FusedDispatch (the DeepEP / HybridEP fused all-to-all, CUDA "
                              "only) is not built; use moe_token_dispatcher_type='alltoall' or 'allgather' to "
                              "typecheck an MoE model")
    with pytest.raises(ValueError) as err:
        spmd_megatron.expert_parameter_types(torch.nn.Parameter(torch.ones(2)), ("dp",))
    assert str(err.value) == ("spmd_megatron.expert_parameter_types: 'dp' is not an axis of the expert mesh "
                              "(edp, ep, etp)")


def test_a_rule_can_ask_for_the_arguments_shapes(cpu):
    # register_autograd_function(rule=...) passes shapes= to a rule that names it (the all-to-all's split check)
    seen = []

    def rule(x, k, shapes):
        seen.append(shapes)
        return x.as_dict()

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g, None

    spmd.register_autograd_function(Scale, rule=rule)
    fake_moe(2, 1, 4, "alltoall")
    with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
        x = spmd.assert_type(torch.ones(3, 2), {"dp": V, "tp": R})
        assert spmd.get_type(Scale.apply(x, 2.0)) == {"dp": V, "tp": R}
    assert seen == [((3, 2), None)]


def test_megatron_moe_on_one_device_runs_as_before(cpu):
    # checking off: the wrapped load-balancing loss and the layer hooks change nothing
    model, batch = fake_moe(2, 2, 8, "alltoall")
    with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
        spmd_megatron.type_parameters(model)
    loss = forward_backward(model, make_batch(0))
    assert type(loss) is torch.Tensor and loss.shape == batch["tokens"].shape


def test_example_megatron_moe_runs_and_catches_its_bug():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "SPMD_TYPES_ERRORS": "plain", "OMP_NUM_THREADS": "1"}

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, "examples/megatron_moe.py", *args], cwd=root, capture_output=True,
                              text=True, env=env, timeout=240)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    out = run()
    assert "MoE GPTModel (alltoall dispatcher) on a fake group of 8 ranks (tp=2, ep=2, dp=4): typechecked" in out
    assert "  loss:         {'dp': V, 'tp': I}" in out and "  expert grad:  {'edp': P, 'ep': V, 'etp': S(0)}" in out
    out = run("--bug", "--dispatcher", "allgather")
    assert "Invariant (I) values only combine with other I values: torch.mm combines other (I) with input (V)." in out
    assert "moe_utils.py:" in out and "output = torch.mm(inp.to(router_dtype), weight.to(router_dtype).t())" in out
