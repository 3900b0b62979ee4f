"""Megatron-core 0.16.1, unmodified, typechecked with ``spmd_types.megatron`` (issue 7).

* every autograd Function in ``megatron.core.tensor_parallel`` and ``megatron.core.fusions`` is registered,
  and the registrations are checked on simulated ranks (``spmd.testing.verify_registration``, or by hand);
* GPTModel (local layer spec) at tp=2 and tp=4, with and without sequence parallel, dp=2, on a fake process
  group: no false alarm, the loss and every gradient typed as Megatron means them; dp=8 x tp=8 in seconds;
* 4 gloo processes: the typed run's loss and gradients equal the untyped run's, and equal a tp=1 GPTModel
  with the reassembled weights; Megatron's DDP + finalize_model_grads give the tp=1 average;
* every message the adapter adds, pinned. The planted bugs are in test_megatron_core_bugs.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _megatron_support import (  # noqa: E402
    CONFIGS,
    WORLD,
    accommodate_cpu,
    fake_gpt,
    init_parallel,
    launch_gloo,
    typed_step,
    worker,
)
from conftest import fake_mesh  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import cross_entropy, layers, mappings  # noqa: E402

import spmd_types as spmd  # noqa: E402
from spmd_types import megatron as spmd_megatron  # noqa: E402
from spmd_types.integrations.megatron import adapter as _adapter  # noqa: E402
from spmd_types.testing import verify_registration  # noqa: E402

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def cpu(monkeypatch):
    """The two CPU accommodations for one test, undone after it; Megatron's parallel state torn down."""
    accommodate_cpu(monkeypatch.setattr)
    yield monkeypatch
    ps.destroy_model_parallel()


def _expected_grad_types(model) -> dict:
    """What each gradient must be: P on dp; on tp S(d) for a shard, P under sequence parallel, else I."""
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            tp = S(p.partition_dim)
        elif getattr(p, "sequence_parallel", False):
            tp = P
        else:
            tp = I
        out[name] = {"dp": P, "tp": tp}
    return out


# ---------------------------------------------------------------------------
# registrations


def _functions_in_megatron() -> set[type]:
    import importlib
    import pkgutil

    import megatron.core.fusions as fusions
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.transformer.moe as moe
    from megatron.core.utils import MakeViewlessTensor

    found = {MakeViewlessTensor}
    for pkg in (tensor_parallel, fusions, moe):
        for info in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for obj in vars(mod).values():
                if (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)
                        and obj.__module__ == mod.__name__):
                    found.add(obj)
    return found


def test_register_covers_every_function_and_is_idempotent(cpu):
    first = spmd_megatron.register()
    assert spmd_megatron.register() == first
    missing = {f"{c.__module__}.{c.__qualname__}" for c in _functions_in_megatron()} - {
        f"{c.__module__}.{c.__qualname__}" for c in first}
    assert not missing, missing
    assert len(first) == len(spmd_megatron.FUNCTIONS) == 39  # 32 dense, 7 under transformer.moe


def _verify_cases(g):
    return [
        ("copy_to", mappings._CopyToModelParallelRegion, (torch.empty(3, 8), g), [{"tp": I}],
         {}, {"all_reduce": 1}, R),  # its backward all-reduces the incoming gradient in place
        ("all_gather_last_dim", mappings._AllGatherFromTensorParallelRegion, (torch.empty(3, 2), g), [{"tp": S(-1)}],
         {"all_gather": 1}, {"reduce_scatter": 1}, R),
        ("reduce_from", mappings._ReduceFromModelParallelRegion, (torch.empty(4, 8), g), [{"tp": P}],
         {"all_reduce": 1}, {}, I),
        ("gather_sp_tp_grad", mappings._GatherFromSequenceParallelRegion, (torch.empty(2, 3), g, True),
         [{"tp": S(0)}], {"all_gather": 1}, {"reduce_scatter": 1}, R),
        ("gather_sp_duplicated", mappings._GatherFromSequenceParallelRegion, (torch.empty(2, 3), g, False),
         [{"tp": S(0)}], {"all_gather": 1}, {}, I),
        ("reduce_scatter_sp", mappings._ReduceScatterToSequenceParallelRegion, (torch.empty(8, 3), g),
         [{"tp": P}], {"reduce_scatter": 1}, {"all_gather": 1}, S(0)),
        ("reduce_scatter_last", mappings._ReduceScatterToTensorParallelRegion, (torch.empty(3, 8), g),
         [{"tp": P}], {"reduce_scatter": 1}, {"all_gather": 1}, S(-1)),
        ("all_to_all", mappings._AllToAll, (g, torch.empty(8, 3), None, None), [{"tp": V}],
         {"all_to_all": 1}, {"all_to_all": 1}, V),
        ("linear_allreduce_dgrad", layers.LinearWithGradAccumulationAndAsyncCommunication,
         (torch.empty(2, 3, 8), torch.empty(4, 8), torch.empty(4), False, True, False, None, None, g),
         [{"tp": I}, {"tp": S(0)}, {"tp": S(0)}], {}, {"all_reduce": 1}, V),
        ("linear_sequence_parallel", layers.LinearWithGradAccumulationAndAsyncCommunication,
         (torch.empty(2, 3, 8), torch.empty(4, 8), torch.empty(4), False, False, True, None, None, g),
         [{"tp": S(0)}, {"tp": S(0)}, {"tp": S(0)}], {"all_gather": 1}, {"all_gather": 1, "reduce_scatter": 1}, V),
        ("linear_row_parallel", layers.LinearWithGradAccumulationAndAsyncCommunication,
         (torch.empty(2, 3, 2), torch.empty(8, 2), None, False, False, False, None, None, g),
         [{"tp": S(-1)}, {"tp": S(1)}], {}, {}, P),
        ("linear_frozen", layers.LinearWithFrozenWeight,
         (torch.empty(2, 3, 8), torch.empty(4, 8), None, True, g), [{"tp": I}, {"tp": S(0)}], {},
         {"all_reduce": 1}, V),
        ("vocab_parallel_cross_entropy", cross_entropy._VocabParallelCrossEntropy,
         (torch.empty(3, 2, 5), torch.empty(3, 2, dtype=torch.long)), [{"tp": S(-1)}, {"tp": R}],
         {"all_reduce": 3}, {}, I),
    ]


_CASE_IDS = [c[0] for c in _verify_cases(None)]


@pytest.mark.parametrize("case", _CASE_IDS)
def test_registration_verified_on_simulated_ranks(cpu, case):
    mesh = fake_mesh((4,), ("tp",))
    init_parallel(4)
    spmd_megatron.register()
    _, cls, args, in_types, fwd, bwd, out = next(c for c in _verify_cases(mesh.get_group("tp")) if c[0] == case)
    report = verify_registration(cls, args, mesh=mesh, in_types=in_types)
    assert (report.forward_comms, report.backward_comms, report.out_types) == (fwd, bwd, {"tp": out})


def test_local_kernels_verified_no_communication(cpu):
    from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu, fused_weighted_squared_relu
    mesh = fake_mesh((2,), ("tp",))
    spmd_megatron.register()
    cases = [
        (fused_bias_gelu.GeLUFunction, (torch.empty(3, 4), torch.empty(4)), [{"tp": V}, {"tp": R}], V),
        (fused_bias_swiglu.SwiGLUFunction, (torch.empty(3, 8), False, False), [{"tp": V}], V),
        (fused_bias_swiglu.BiasSwiGLUFunction, (torch.empty(3, 8), torch.empty(8), False, False),
         [{"tp": I}, {"tp": I}], I),
        (fused_weighted_squared_relu.WeightedSquaredReLUFunction, (torch.empty(3, 4), torch.empty(3, 1)),
         [{"tp": V}, {"tp": V}], V),
    ]
    # MakeViewlessTensor (registered local=True: its forward returns a non-view alias through ``out.data = inp.data``,
    # its backward is the identity) is not verified here: a LocalTensor's ``.data`` cannot be re-pointed.
    for cls, args, in_types, out in cases:
        report = verify_registration(cls, args, mesh=mesh, in_types=in_types)
        assert (report.forward_comms, report.backward_comms, report.out_types) == ({}, {}, {"tp": out}), cls


def test_axis_of_group_matches_megatron_groups_by_ranks(cpu):
    mesh = fake_mesh((2, 2), ("dp", "tp"))  # a DeviceMesh: its groups are not Megatron's objects
    init_parallel(2)
    with spmd.set_current_mesh(mesh):
        assert spmd_megatron.axis_of_group(ps.get_tensor_model_parallel_group()) == "tp"
        assert spmd_megatron.axis_of_group(ps.get_data_parallel_group()) == "dp"
        with pytest.raises(ValueError) as err:
            spmd_megatron.axis_of_group(dist.group.WORLD)
    assert str(err.value) == ("spmd_megatron: the process group over ranks [0, 1, 2, 3] is not an axis of the "
                              "current mesh (axes: dp=[0, 2], tp=[0, 1])")
    assert set(spmd_megatron.mesh()) == {"dp", "tp"}


# ---------------------------------------------------------------------------
# GPTModel on a fake process group: types


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_gpt_typechecks_without_false_alarm(cpu, tp, sp):
    model, mesh, batch = fake_gpt(tp, 2, sp)
    loss = typed_step(model, batch, mesh)
    assert spmd.get_type(loss) == {"dp": V, "tp": I}
    got = {n: dict(spmd.get_type(p.grad)) for n, p in model.named_parameters()}
    assert got == _expected_grad_types(model)
    assert sum(1 for t in got.values() if t["tp"] is P) == (14 if sp else 0)  # 5 norms and 2 row biases under SP


def test_gpt_at_production_size_dp8_tp8_in_seconds(cpu):
    start = time.perf_counter()
    model, mesh, batch = fake_gpt(8, 8, True, num_attention_heads=8, hidden_size=32)
    loss = typed_step(model, batch, mesh)
    assert spmd.get_type(loss) == {"dp": V, "tp": I}
    assert time.perf_counter() - start < 30  # about 1 s alone on one core


def test_unregistered_function_is_refused(cpu):
    model, mesh, batch = fake_gpt(2, 2)
    from spmd_types._boundaries.autograd_functions import unregister_autograd_function

    spmd_megatron.register()
    unregister_autograd_function(mappings._ReduceFromModelParallelRegion)
    try:
        with pytest.raises(spmd.SpmdTypeError) as err:
            typed_step(model, batch, mesh)
    finally:
        _adapter._REGISTERED.clear()
        spmd_megatron.register()
    assert err.value.rule.startswith("The custom autograd Function _ReduceFromModelParallelRegion is applied to "
                                     "typed tensors, but it is not registered")


# ---------------------------------------------------------------------------
# numbers: 4 gloo processes


@pytest.fixture(scope="module")
def gloo_rows(tmp_path_factory):
    return launch_gloo(worker, WORLD, tmp_path_factory.mktemp("megatron_gloo"))


def test_gloo_ddp_loop_synced_gradients_equal_tp1_average(gloo_rows):
    # Megatron's DistributedDataParallel + finalize_model_grads at tp=2, dp=2, sequence parallel, typed and
    # tracked: every gradient synced, and equal to a tp=1 model's gradient averaged over the two micro-batches.
    for rank in range(WORLD):
        row = gloo_rows[(rank, "ddp_tp2_sp1")]
        assert "error" not in row, row.get("error")
        assert row["unsynced"] == {} and row["invariant_grad_spread"] == 0.0
        assert row["grad_vs_tp1"] < 1e-5, row


@pytest.mark.parametrize("tp,sp", CONFIGS)
def test_gloo_typed_equals_untyped_equals_tp1(gloo_rows, tp, sp):
    for rank in range(WORLD):
        row = gloo_rows[(rank, f"tp{tp}_sp{int(sp)}")]
        assert "error" not in row, row.get("error")
        assert row["loss_typed_vs_untyped"] == 0.0 and row["grad_typed_vs_untyped"] == 0.0
        assert row["loss_vs_tp1"] < 1e-5 and row["grad_vs_tp1"] < 1e-5, row
        assert row["invariant_grad_spread"] == 0.0  # gradients typed I are the same on every tp rank
        # at tp=4 on 4 processes dp has size 1: an axis of one rank carries no type
        assert row["loss_type"] == ("{'dp': V, 'tp': I}" if tp < WORLD else "{'tp': I}") and row["n_params"] == 29


def test_example_megatron_gpt_runs_at_dp8_tp8(cpu):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "megatron_gpt.py"
    spec = importlib.util.spec_from_file_location("megatron_gpt_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(tp=8, dp=8, sp=True)
    assert result["loss"] == {"dp": V, "tp": I}
    assert (result["norm_grad_before_sync"], result["norm_grad_after_sync"]) == ({"dp": P, "tp": P}, {"dp": R, "tp": R})
    assert result["unsynced"] == {} and result["ranks"] == 64


@pytest.mark.parametrize("name", ["gather_from_tp_forward"])
def test_registration_compared_by_hand_where_verify_registration_cannot(cpu, name):
    """A registration ``verify_registration`` cannot settle on simulated ranks, compared with its spmd op directly.

    _GatherFromModelParallelRegion's backward slices by ``group.rank()``, which every simulated rank answers 0,
    so only its forward can be simulated (the scatters are not simulable for the same reason; the gloo test
    runs _ScatterToSequenceParallelRegion for real inside GPTModel).
    """
    from torch.distributed._local_tensor import LocalTensorMode

    from spmd_types.testing import CommCounter, denote, random_value

    mesh = fake_mesh((4,), ("tp",))
    spmd_megatron.register()
    group = mesh.get_group("tp")
    from spmd_types._boundaries.autograd_functions import registration_of

    cls, shape = {
        "gather_from_tp_forward": (mappings._GatherFromModelParallelRegion, (3, 2)),
    }[name]
    reg = registration_of(cls)  # the claim under test: Megatron's Function runs like this spmd op
    op, src, dst = getattr(spmd, reg.op), reg.src, reg.dst
    with LocalTensorMode(4):
        x0 = random_value(mesh, {"tp": src}, shape, 1)
        runs = {}
        for who in ("megatron", "spmd"):
            x = x0.clone().requires_grad_(True)
            with spmd.set_current_mesh(mesh), spmd.typecheck():
                xt = spmd.assert_type(x, {"tp": src})
                with CommCounter() as fwd:
                    y = cls.apply(xt, group) if who == "megatron" else op(xt, "tp", src=src, dst=dst)
                types = dict(spmd.get_type(y))
            g = random_value(mesh, {"tp": spmd.backward_type(dst)}, tuple(y.shape), 2)
            with CommCounter() as bwd:
                (gx,) = torch.autograd.grad(y, x, g)
            runs[who] = (types, denote(y, mesh, types), fwd.counts, gx, bwd.counts)
        (t1, y1, f1, g1, b1), (t2, y2, f2, g2, b2) = runs["megatron"], runs["spmd"]
        assert t1 == t2 == {"tp": dst} and f1 == f2
        torch.testing.assert_close(y1, y2)
        if name != "gather_from_tp_forward":
            gtype = {"tp": spmd.backward_type(src)}
            torch.testing.assert_close(denote(g1, mesh, gtype), denote(g2, mesh, gtype))
            assert b1 == b2


@pytest.mark.parametrize("sp", [False, True])
def test_the_functions_gpt_model_reaches(cpu, sp):
    """Which Megatron autograd Functions one GPTModel step applies (read from the autograd graph)."""
    model, mesh, batch = fake_gpt(2, 2, sp)
    loss = typed_step(model, batch, mesh)
    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    names = {type(f).__name__.removesuffix("Backward") for f in seen if type(f).__name__.startswith(("_", "Linear"))}
    expected = {"LinearWithGradAccumulationAndAsyncCommunication", "_ReduceFromModelParallelRegion",
                "_VocabParallelCrossEntropy"}
    if sp:
        expected |= {"_ScatterToSequenceParallelRegion", "_ReduceScatterToSequenceParallelRegion"}
    assert names == expected


def test_every_adapter_message(cpu):
    """The adapter's remaining refusals, each with its exact text (rules called with the types they refuse)."""
    from spmd_types._core.types import TypeMap

    fake_mesh((2, 2), ("dp", "tp"))
    init_parallel(2)
    group = ps.get_tensor_model_parallel_group()

    def tm(tp, dp=V):
        return TypeMap.of({"dp": dp, "tp": tp})

    linear = _adapter._linear_rule("Linear", 5, 4, 8)
    frozen = _adapter._linear_rule("Frozen", None, 3, 4)
    ce = _adapter._cross_entropy_rule(None)
    cases = [
        (lambda: linear(tm(R), tm(S(0)), None, False, False, True, None, None, group),
         "Linear: with sequence_parallel=True its forward all-gathers the input along dim 0 and its backward "
         "reduce-scatters the input gradient, so the input must be S(0) on 'tp'"),
        (lambda: frozen(tm(R), tm(S(0)), None, True, group),
         "Frozen: with allreduce_dgrad=True its backward all-reduces the input gradient, so the input must be I on "
         "'tp' (the same on every rank, its gradient summed)"),
        (lambda: linear(tm(I), tm(S(1)), None, False, False, False, None, None, group),
         "Linear: a row-parallel weight (S(1) on 'tp') needs an input sharded on its last dim (V)"),
        (lambda: linear(tm(V), tm(S(0), dp=P), None, False, False, False, None, None, group),
         "Linear: a weight or bias that is P on 'dp' makes the product non-linear in a pending sum"),
        (lambda: linear(tm(V, dp=P), tm(S(0), dp=V), None, False, False, False, None, None, group),
         "Linear: its input is P on 'dp', so the weight must be R and there must be no bias"),
        (lambda: ce(tm(S(-1), dp=P), None),
         "vocab-parallel cross entropy is not linear: its logits must not be P on 'dp'"),
        (lambda: _adapter._gather_sp_rule(tm(I), group, True),
         "gather_from_sequence_parallel_region all-gathers along dim 0: its input must be S(0) on 'tp'"),
        (lambda: _adapter._gather_sp_rule(tm(V), group, True, [3, 5, 2]),
         "gather_from_sequence_parallel_region: output_split_sizes needs one size per rank of the group"),
        (lambda: _adapter._gather_sp_rule(tm(I), group, True, [3, 5]),
         "gather_from_sequence_parallel_region all-gathers along dim 0: its input must be V on 'tp'"),
        (lambda: _adapter._all_to_all_rule(group, tm(I), None, None),
         "Megatron's all_to_all exchanges different rows with every rank: its input must be V on 'tp'"),
    ]
    with spmd.set_current_mesh(spmd_megatron.mesh()):
        for call, rule in cases:
            got = call()
            assert isinstance(got, spmd._core.errors.Rejection) and got.rule == rule, (got, rule)

    with pytest.raises(ValueError) as err:
        spmd_megatron.axis_of_group(group)
    assert str(err.value) == ("spmd_megatron: no mesh is current: wrap the code in "
                              "spmd.set_current_mesh(spmd_megatron.mesh())")
    with pytest.raises(ValueError) as err:
        spmd_megatron.type_parameters(torch.nn.Linear(2, 2))
    assert str(err.value) == ("spmd_megatron.type_parameters: no mesh is current: wrap it in "
                              "spmd.set_current_mesh(spmd_megatron.mesh())")
    with pytest.raises(ValueError) as err:
        spmd_megatron.parameter_types(torch.nn.Parameter(torch.ones(2)), ("dp", "ep"))
    assert str(err.value) == ("spmd_megatron.parameter_types: 'ep' is not an axis of the dense mesh (dp, cp, tp, pp): "
                              "an expert axis (edp, ep, etp) is spmd_megatron.expert_parameter_types's; type any other "
                              "with spmd.assert_type")
    expert = torch.nn.Parameter(torch.ones(2))
    expert.allreduce = False
    with pytest.raises(ValueError) as err:
        spmd_megatron.parameter_types(expert, ("dp", "tp"))
    assert str(err.value) == ("spmd_megatron.parameter_types: an expert parameter (allreduce=False) lives on the "
                              "expert mesh: spmd_megatron.expert_parameter_types(param, axes) inside "
                              "spmd.set_current_mesh(spmd_megatron.mesh(expert=True)); type_parameters does both")
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError) as err:
        spmd_megatron.mesh()
    assert str(err.value) == ("spmd_megatron.mesh(): call megatron.core.parallel_state.initialize_model_parallel "
                              "first")


def test_gpt_with_shared_embedding_and_output_weights(cpu):
    # One vocab-sharded weight used twice (embedding lookup and output layer): S(0) on tp, gradients summed locally.
    model, mesh, batch = fake_gpt(2, 2, sp=True, model_kwargs={"share_embeddings_and_output_weights": True})
    assert model.output_layer.weight is None  # the output layer borrows the embedding weight (pp=1: no "shared" copy)
    loss = typed_step(model, batch, mesh)
    assert spmd.get_type(loss) == {"dp": V, "tp": I}
    assert spmd.get_type(model.embedding.word_embeddings.weight.grad) == {"dp": P, "tp": S(0)}


def test_the_core_never_imports_megatron():
    import subprocess
    import sys

    code = ("import sys, spmd_types, spmd_types.testing; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron') or m == 'spmd_types.megatron'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys, spmd_types.megatron; print(sorted(m for m in sys.modules if m.startswith('megatron')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # the adapter imports megatron.core only when one of its functions is called


def test_type_parameters_walks_the_module_tree_once_with_named_parameters_own_answer(cpu):
    """type_parameters runs every step in some loops: it walks the modules once and reads each one's own
    parameters, which must give exactly named_parameters()'s names, objects and order (tied weights once)."""
    model, _, _ = fake_gpt(2, 2, sp=True, model_kwargs={"share_embeddings_and_output_weights": True})
    shared = torch.nn.Module()
    shared.a, shared.b = model, torch.nn.Linear(2, 2)
    shared.b.register_parameter("none", None)
    shared.c = shared.b  # the same module twice: its parameters once

    class OwnWalk(torch.nn.Linear):  # a class with its own idea of its submodules: its own walk is used
        def named_modules(self, *args, **kwargs):
            yield "", self

    shared.d = OwnWalk(2, 2)
    shared.d.hidden = torch.nn.Linear(2, 2)
    for m in (model, shared):
        modules, params = _adapter._modules_and_parameters(m)
        assert [(n, id(p)) for n, p in params] == [(n, id(p)) for n, p in m.named_parameters()]
        assert [(n, id(x)) for n, x in modules] == [(n, id(x)) for n, x in m.named_modules()]
