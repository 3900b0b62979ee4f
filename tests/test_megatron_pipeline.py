"""Megatron-core 0.16.1 pipeline stages, typed with ``spmd_types.megatron`` (issue 16 item 4).

* ``type_parameters`` types every stage's parameters on ``pp``: V, and R for the tied word embedding at pp=2;
* each stage's program runs on a fake process group as that stage's first rank (``simulate(rank=)``), driven by
  Megatron's own non-interleaved 1F1B schedule with the typed communicator;
* ``p2p_communicator``: what a stage sends is checked against the declared ``PipelineTypes``, what it receives is
  typed, a gradient that is never sent back is caught; every message pinned, with the planted bugs;
* 4 gloo processes (pp=2 x tp=2): the typed schedule's losses and gradients equal the untyped schedule's exactly.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _megatron_pipeline_support import (  # noqa: E402
    GLOO_CONFIGS,
    GLOO_WORLD,
    MICRO_BATCHES,
    accommodate_schedule,
    accommodate_tied_embedding,
    activation_types,
    build_stage,
    forward_step,
    micro_batches,
    run_schedule,
    typed_schedule,
    worker,
)
from _megatron_support import HIDDEN, SEQ, accommodate_cpu, init_parallel, launch_gloo, typed_inputs  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

import spmd_types as spmd  # noqa: E402
from spmd_types import megatron as spmd_megatron  # noqa: E402
from spmd_types.testing import simulate  # noqa: E402

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
HERE = Path(__file__).name
SUPPORT = "_megatron_pipeline_support.py"
SHAPE = (SEQ, 2, HIDDEN)  # [sequence, micro-batch, hidden]: what crosses between stages


@pytest.fixture
def cpu(monkeypatch):
    """The CPU accommodations (dense model and schedule) for one test, undone after it."""
    accommodate_cpu(monkeypatch.setattr)
    accommodate_schedule(monkeypatch.setattr)
    yield monkeypatch
    ps.destroy_model_parallel()


@contextlib.contextmanager
def stage_world(stage: int, pp: int = 2, dp: int = 2, tp: int = 2):
    """A fake process group of pp*dp*tp ranks, run as ``stage``'s first rank, with Megatron's parallel state on it."""
    with simulate((pp, dp, tp), ("pp", "dp", "tp"), rank=stage * dp * tp, device="cpu"):
        ps.destroy_model_parallel()
        init_parallel(tp, pipeline_model_parallel_size=pp)
        spmd_megatron.register()
        assert ps.get_pipeline_model_parallel_rank() == stage
        try:
            yield
        finally:
            ps.destroy_model_parallel()


def _at(err: Exception) -> tuple[str, str]:
    """(file name, code) of the line an SpmdTypeError names."""
    where, _, code = err.source.partition(": ")
    return Path(where.rsplit(":", 1)[0]).name, code


def _comm(sp: bool = False, types=None):
    config = build_stage(2, sp).config
    return spmd_megatron.p2p_communicator(config, types or spmd_megatron.PipelineTypes(activation_types(sp)))


# ---------------------------------------------------------------------------
# parameters on pp


def _tp_type(p):
    if getattr(p, "tensor_model_parallel", False):
        return S(p.partition_dim)
    return R if getattr(p, "sequence_parallel", False) else I


@pytest.mark.parametrize("stage", [0, 1])
def test_type_parameters_types_every_stage_V_on_pp(cpu, stage):
    with stage_world(stage):
        model = build_stage(2, sp=True)
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
            typed = spmd_megatron.type_parameters(model)
        assert typed == {n: {"dp": R, "tp": _tp_type(p), "pp": V} for n, p in model.named_parameters()}
        names = set(typed)
    first = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
    last = {"output_layer.weight", "decoder.final_layernorm.weight", "decoder.final_layernorm.bias"}
    assert (names >= first, names >= last, names & (first | last)) == (
        (True, False, first) if stage == 0 else (False, True, last))
    assert len(names) == (14 if stage == 0 else 15)  # one transformer layer per stage (12 parameters)


@pytest.mark.parametrize("stage", [0, 1])
def test_tied_word_embedding_is_R_on_pp_and_its_gradient_P(cpu, stage):
    # share_embeddings_and_output_weights at pp=2: the first stage's word embedding and the last stage's output
    # weight are one value held twice (marked shared_embedding), summed over the embedding group = the pp axis.
    accommodate_tied_embedding(cpu.setattr)
    with stage_world(stage):
        model = build_stage(2, share_embeddings_and_output_weights=True)
        tied = model.shared_embedding_or_output_weight()
        assert tied.shared_embedding
        typed_schedule(model, sp=False)
        assert spmd.get_type(tied) == {"dp": R, "pp": R, "tp": S(0)}
        assert spmd.get_type(tied.grad) == {"dp": P, "pp": P, "tp": S(0)}
        assert {spmd.get_type(p)["pp"] for p in model.parameters() if p is not tied} == {V}


def test_tied_word_embedding_beyond_two_stages_is_not_built(cpu):
    # At pp=4 the embedding group is stages 0 and 3 only: no type on 'pp' says "the same on two of its ranks".
    accommodate_tied_embedding(cpu.setattr)
    with stage_world(0, pp=4, dp=1, tp=1):
        weight = torch.nn.Parameter(torch.ones(32, 16))
        weight.shared_embedding = True  # as Megatron marks it
        with spmd.set_current_mesh(spmd_megatron.mesh()), pytest.raises(NotImplementedError) as err:
            spmd_megatron.parameter_types(weight, ("dp", "tp", "pp"))
        assert spmd_megatron.parameter_types(torch.nn.Parameter(torch.ones(2)), ("pp",)) == {"pp": V}
    assert str(err.value) == (
        "spmd_megatron.type_parameters: the tied word embedding (a parameter marked shared_embedding, [32, 16]) is "
        "summed over Megatron's embedding group (ranks [0, 3]), the first and last pipeline stages, which is not the "
        "whole pipeline axis (ranks [0, 1, 2, 3]): no type on 'pp' says 'the same on two of its ranks'. Untie it "
        "(share_embeddings_and_output_weights=False) or use pipeline_model_parallel_size=2")


# ---------------------------------------------------------------------------
# each stage's program on a fake process group, driven by Megatron's schedule


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("stage", [0, 1])
def test_each_stage_program_typechecks_under_megatrons_schedule(cpu, stage, sp):
    with stage_world(stage):
        model = build_stage(2, sp)
        seen = {}
        losses, comm = typed_schedule(model, sp, seen)
        want_input = {"dp": V, "pp": V, "tp": S(0) if sp else I}
        if stage == 0:
            assert seen["input"] == [None] * MICRO_BATCHES and losses == []  # the first stage embeds its tokens
        else:
            assert seen["input"] == [want_input] * MICRO_BATCHES  # as the declaration says stage 0 sends
            assert [spmd.get_type(d["loss"]) for d in losses] == [{"dp": V, "pp": V, "tp": I}] * MICRO_BATCHES
        grads = {n: dict(spmd.get_type(p.grad)) for n, p in model.named_parameters()}
        assert grads == {n: {"dp": P, "pp": V, "tp": P if t is R else t}
                         for n, t in ((n, _tp_type(p)) for n, p in model.named_parameters())}
        assert len(comm._awaiting) == 0 and comm.stage == stage


@pytest.mark.parametrize("stage", [0, 1])
def test_every_p2p_method_checks_its_sends_and_types_its_receives(cpu, stage):
    # Driven by hand, one call of each method Megatron's P2PCommunicator has; a declared R activation has a
    # P gradient, so the dual type is visible.
    declared = {"dp": V, "tp": R}
    with stage_world(stage):
        comm = _comm(types=spmd_megatron.PipelineTypes(declared))
        act = {"dp": V, "pp": V, "tp": R}
        grad = {"dp": V, "pp": V, "tp": P}
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck(), comm.iteration(forward_only=True):
            typed = [spmd.assert_type(torch.zeros(SHAPE), declared)]  # pp is V where it is left out
            if stage == 0:
                assert comm.recv_forward(SHAPE, is_first_stage=True) is None
                comm.send_forward(typed[0], is_last_stage=False)
                got = [comm.recv_backward(SHAPE, is_last_stage=False),
                       comm.send_forward_recv_backward(typed[0], SHAPE, is_last_stage=False),
                       comm.send_forward_recv_backward(typed, [SHAPE], is_last_stage=False)[0]]
                assert [spmd.get_type(g) for g in got] == [grad] * 3
                assert comm.send_forward_recv_forward(typed[0], False, SHAPE) is None
                assert spmd.get_type(comm.send_backward_recv_backward(None, True, SHAPE)) == grad
                assert comm.send_backward_recv_forward(None, SHAPE, is_first_stage=True) is None
                comm.config.batch_p2p_comm = False  # overlapping needs Megatron's unbatched sends
                g, handles = comm.send_backward_recv_backward(None, True, SHAPE, overlap_p2p_comm=True)
                assert spmd.get_type(g) == grad and "recv_next" in handles
            else:
                got = [comm.recv_forward(SHAPE, is_first_stage=False),
                       comm.recv_forward([SHAPE], is_first_stage=False)[0],
                       comm.send_backward_recv_forward(spmd.assert_type(torch.zeros(SHAPE), {"dp": V, "tp": P}),
                                                       SHAPE, is_first_stage=False),
                       comm.send_forward_recv_forward(None, True, SHAPE)]
                assert [spmd.get_type(g) for g in got] == [act] * 4
                assert all(g.requires_grad and g.is_leaf for g in got)  # their gradients reach send_backward
                comm.send_backward(spmd.assert_type(torch.zeros(SHAPE), {"dp": V, "tp": P}), is_first_stage=False)
                assert comm.send_forward_recv_backward(torch.ones(1), SHAPE, is_last_stage=True) is None
                back = spmd.assert_type(torch.zeros(SHAPE), {"dp": V, "tp": P})
                f, b = comm.send_forward_backward_recv_forward_backward(None, back, True, False, SHAPE)
                assert (spmd.get_type(f), b) == (act, None)
                comm.config.batch_p2p_comm = False  # overlapping needs Megatron's unbatched sends
                x, handles = comm.send_forward_recv_forward(None, True, SHAPE, overlap_p2p_comm=True)
                assert spmd.get_type(x) == act and "recv_prev" in handles
        # outside typecheck it is Megatron's communicator: plain tensors in, plain tensors out
        out = comm.recv_forward(SHAPE, is_first_stage=stage == 0)
        assert out is None if stage == 0 else spmd.get_type(out) is None


# ---------------------------------------------------------------------------
# the declaration and the communicator: every message


def test_pipeline_types_declaration_errors():
    cases = [
        (lambda: spmd_megatron.PipelineTypes(), TypeError,
         "spmd_megatron.PipelineTypes takes one type for every stage boundary (PipelineTypes({'dp': spmd.V, 'tp': "
         "spmd.I})) or one StageTypes per stage (stages=[...])"),
        (lambda: spmd_megatron.PipelineTypes({"tp": I}, stages=[]), TypeError,
         "spmd_megatron.PipelineTypes takes one type for every stage boundary (PipelineTypes({'dp': spmd.V, 'tp': "
         "spmd.I})) or one StageTypes per stage (stages=[...])"),
        (lambda: spmd_megatron.PipelineTypes(["tp"]), TypeError,
         "spmd_megatron.PipelineTypes: activation is a dict {axis name: type}, e.g. {'dp': spmd.V, 'tp': spmd.I}; "
         "got ['tp']"),
        (lambda: spmd_megatron.PipelineTypes({"tp": "I"}), TypeError,
         "spmd_megatron.PipelineTypes: activation['tp'] must be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or "
         "spmd.S(d)), got 'I' of type str"),
        (lambda: spmd_megatron.PipelineTypes(stages=[spmd_megatron.StageTypes(sends={"tp": I})]), TypeError,
         "spmd_megatron.PipelineTypes: stages= is a list of one spmd_megatron.StageTypes per pipeline stage (two or "
         "more); got [StageTypes(receives=None, sends={'tp': I})]"),
        (lambda: spmd_megatron.PipelineTypes(stages=[spmd_megatron.StageTypes(receives={"tp": I}, sends={"tp": I}),
                                                     spmd_megatron.StageTypes(receives={"tp": I})]), ValueError,
         "spmd_megatron.PipelineTypes: stage 0 is the first stage: it receives nothing and sends its activation, "
         "StageTypes(sends=...); got StageTypes(receives={'tp': I}, sends={'tp': I})"),
        (lambda: spmd_megatron.PipelineTypes(stages=[spmd_megatron.StageTypes(sends={"tp": I}),
                                                     spmd_megatron.StageTypes(receives={"tp": I}),
                                                     spmd_megatron.StageTypes(receives={"tp": I})]), ValueError,
         "spmd_megatron.PipelineTypes: stage 1 is a middle stage: it receives and sends its activation, "
         "StageTypes(receives=..., sends=...); got StageTypes(receives={'tp': I}, sends=None)"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind) as err:
            call()
        assert str(err.value) == message
    assert repr(spmd_megatron.PipelineTypes({"dp": V, "tp": S(0)})) == "PipelineTypes({dp: V, tp: S(0)})"
    two = spmd_megatron.PipelineTypes(stages=[spmd_megatron.StageTypes(sends={"tp": I}),
                                              spmd_megatron.StageTypes(receives={"tp": I})])
    assert (two.boundary(0, 2), two.key(2)) == ({"tp": I}, ("{tp: I}",))


def test_p2p_communicator_argument_errors(cpu):
    with stage_world(0):
        config = build_stage(2).config
        one = spmd_megatron.PipelineTypes({"tp": I})
        three = spmd_megatron.PipelineTypes(stages=[spmd_megatron.StageTypes(sends={"tp": I}),
                                                    spmd_megatron.StageTypes(receives={"tp": I}, sends={"tp": I}),
                                                    spmd_megatron.StageTypes(receives={"tp": I})])
        with pytest.raises(TypeError) as bad_types:
            spmd_megatron.p2p_communicator(config, {"tp": I})
        with pytest.raises(ValueError) as stages:
            spmd_megatron.p2p_communicator(config, three)
        with pytest.raises(ValueError) as no_pipeline:
            spmd_megatron.p2p_communicator(config, one, pp_group=dist.new_group([0]))
        config.virtual_pipeline_model_parallel_size = 2
        with pytest.raises(NotImplementedError) as virtual:
            spmd_megatron.p2p_communicator(config, one)
    assert str(bad_types.value) == ("spmd_megatron.p2p_communicator: types is a spmd_megatron.PipelineTypes, got "
                                    "{'tp': I}")
    assert str(stages.value) == ("spmd_megatron.p2p_communicator: the PipelineTypes declares 3 stages, but the "
                                 "pipeline group has 2")
    assert str(no_pipeline.value) == ("spmd_megatron.p2p_communicator: the pipeline group has one rank, so there is "
                                      "no pipeline (pipeline_model_parallel_size=1 runs forward_backward_no_pipelining)")
    assert str(virtual.value) == (
        "spmd_megatron.p2p_communicator: the interleaved (virtual) pipeline (virtual_pipeline_model_parallel_size=2) "
        "is not typed: a rank runs several model chunks, each its own stage; use the non-interleaved schedule")


def test_declaration_on_the_mesh_and_wrong_direction_errors(cpu):
    with stage_world(1):
        mesh = spmd_megatron.mesh()
        named_pp = _comm(types=spmd_megatron.PipelineTypes({"dp": V, "tp": I, "pp": V}))
        missing = _comm(types=spmd_megatron.PipelineTypes({"tp": I}))
        comm = _comm()
        errors = []
        no_pp = {"dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group()}
        for m, call in ((mesh, lambda: named_pp.recv_forward(SHAPE, False)),
                        (mesh, lambda: missing.recv_forward(SHAPE, False)),
                        (mesh, lambda: comm.send_forward(torch.zeros(SHAPE), is_last_stage=False)),
                        (mesh, lambda: comm.recv_backward(SHAPE, is_last_stage=False)),
                        (no_pp, lambda: comm.recv_forward(SHAPE, False))):
            with spmd.set_current_mesh(m), spmd.typecheck(), pytest.raises(ValueError) as err:
                call()
            errors.append(str(err.value))
    with spmd.typecheck(), pytest.raises(ValueError) as err:  # no mesh (and no process group) any more
        comm.recv_forward(SHAPE, False)
    errors.append(str(err.value))
    with stage_world(0):
        comm = _comm()
        for call in (lambda: comm.recv_forward(SHAPE, is_first_stage=False),
                     lambda: comm.send_backward(torch.zeros(SHAPE), is_first_stage=False)):
            with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck(), pytest.raises(ValueError) as err:
                call()
            errors.append(str(err.value))
    assert errors == [
        "spmd_megatron.PipelineTypes: leave the pipeline axis 'pp' out of the types: an activation is V there (each "
        "stage holds its own)",
        "spmd_megatron.PipelineTypes: what stage 0 sends to stage 1 names no type on axis 'dp' of the current mesh; "
        "name one, e.g. {'dp': spmd.V, ...}",
        "spmd_megatron: stage 1 is the last stage: it sends nothing forward (pass is_last_stage=True); Megatron would "
        "send to stage 0",
        "spmd_megatron: stage 1 is the last stage: no gradient comes back to it (pass is_last_stage=True); Megatron "
        "would receive from stage 0",
        "spmd_megatron: the pipeline group (ranks [0, 4]) is not an axis of the current mesh (axes: dp, tp); use "
        "spmd.set_current_mesh(spmd_megatron.mesh())",
        "spmd_megatron: no mesh is current: wrap the pipeline in spmd.set_current_mesh(spmd_megatron.mesh())",
        "spmd_megatron: stage 0 is the first stage: nothing is sent to it forward (pass is_first_stage=True); "
        "Megatron would receive from stage 1",
        "spmd_megatron: stage 0 is the first stage: it sends no gradient back (pass is_first_stage=True); Megatron "
        "would send to stage 1",
    ]


def test_an_untyped_send_is_refused(cpu):
    with stage_world(0):
        comm = _comm()
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as err:
            comm.send_forward(torch.zeros(SHAPE), is_last_stage=False)  # a plain tensor
    assert err.value.rule == ("A pipeline stage sends typed tensors: stage 0 sends an untyped activation to stage 1, "
                              "so its type there is unknown.")
    assert err.value.seen == (("sent", "stage 0: f32[8,2,16] untyped"), ("declared", "{dp: V, tp: I, pp: V}"))
    assert err.value.fixes == ("spmd.assert_type(output, {'dp': spmd.V, 'pp': spmd.V, 'tp': spmd.I})",)
    assert _at(err.value) == (HERE, "comm.send_forward(torch.zeros(SHAPE), is_last_stage=False)  # a plain tensor")


def test_a_gradient_of_the_wrong_type_is_refused(cpu):
    # stage 1 received {tp: I}, whose gradient is I; sending back a pending sum (a forgotten all-reduce) is caught.
    with stage_world(1):
        comm = _comm()
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as err:
            x = comm.recv_forward(SHAPE, is_first_stage=False)
            grad = spmd.assert_type(torch.zeros(SHAPE), {"dp": V, "tp": P})
            comm.send_backward(grad, is_first_stage=False)
    assert err.value.rule == ("A pipeline stage sends back the gradient type of what it received: stage 1 received "
                              "{dp: V, tp: I, pp: V} from stage 0, so the gradient it sends back is I on 'tp', not P.")
    assert err.value.seen == (("sent", "stage 1: f32[8,2,16] {dp: V, tp: P, pp: V}"),
                              ("declared", "stage 0 expects the gradient {dp: V, tp: I, pp: V}"),
                              ("axis", "'tp': P is not I"))
    assert err.value.fixes == ("spmd.all_reduce(grad, 'tp', src=spmd.P, dst=spmd.I)",)
    assert _at(err.value) == (HERE, "comm.send_backward(grad, is_first_stage=False)")
    assert x is not None


def test_no_activation_sent_is_refused(cpu):
    # send_forward(None) from a stage that is not the last: Megatron sends nothing, and the next stage waits.
    with stage_world(0):
        comm = _comm()
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as err:
            comm.send_forward([None], is_last_stage=False)
    assert err.value.rule == ("A pipeline stage sends the next stage an activation for every micro-batch: stage 0 "
                              "sends None to stage 1, so Megatron sends nothing and stage 1 waits for it.")
    assert err.value.seen == (("sent", "stage 0: None"),)
    assert err.value.fixes == ("comm.send_forward(output_tensor, is_last_stage=False) with this micro-batch's output",
                               "is_last_stage=True on the last stage only")
    assert _at(err.value) == (HERE, "comm.send_forward([None], is_last_stage=False)")


def test_an_activation_sent_as_R_on_pp_is_refused(cpu):
    # Inputs typed R on pp (the same on every stage) give an activation R there; what crosses is this stage's value.
    with stage_world(0):
        comm = _comm()
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as err:
            out = spmd.assert_type(torch.zeros(SHAPE), {"dp": V, "tp": I, "pp": R})
            comm.send_forward(out, is_last_stage=False)
    assert err.value.rule == ("What a pipeline stage sends is what the next stage receives: stage 0 sends R on 'pp' "
                              "to stage 1, which receives V there.")
    assert err.value.fixes == ("spmd.reinterpret(output, 'pp', src=spmd.R, dst=spmd.V)",)


# ---------------------------------------------------------------------------
# planted bugs: each caught on one stage's program, with the fix


def test_bug_sequence_parallel_output_sent_without_the_gather(cpu):
    # Stage 0 runs with sequence parallel and sends its sequence shard; stage 1 (a head written for the full
    # sequence) declares I. Megatron would send [s/tp, b, h] where [s, b, h] is awaited: a hang or garbage.
    with stage_world(0):
        model = build_stage(2, sp=True)
        types = spmd_megatron.PipelineTypes({"dp": V, "tp": I})  # BUG: stage 0 sends S(0) under sequence parallel
        with pytest.raises(spmd.SpmdTypeError) as err:
            typed_schedule(model, sp=True, types=types)
    # local SPMD: the residual stream's shard is V (no layout) by the time it leaves the stage; the fix knows
    # Megatron shards the sequence (dim 0) between stages
    assert err.value.rule == ("What a pipeline stage sends is what the next stage receives: stage 0 sends V on 'tp' "
                              "to stage 1, which receives I there.")
    assert err.value.seen == (("sent", "stage 0: f32[4,2,16] {dp: V, tp: V, pp: V}"),
                              ("declared", "stage 1 receives {dp: V, tp: I, pp: V}"), ("axis", "'tp': V is not I"))
    assert err.value.fixes == (
        "spmd.all_gather(output, 'tp', src=spmd.S(0), dst=spmd.I)  # Megatron: "
        "gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False)",
        "declare what crosses: spmd_megatron.PipelineTypes({..., 'tp': spmd.S(0)}), if stage 1 takes that")
    assert _at(err.value) == (SUPPORT, "return forward_backward_pipelining_without_interleaving(")  # the user's call


def test_bug_next_stage_built_with_sequence_parallel(cpu):
    # The stages disagree on sequence_parallel: stage 0 sends the whole sequence (I, as declared), and stage 1,
    # built with sequence parallel, feeds it to a norm whose weight is R (a sequence-parallel parameter).
    with stage_world(1):
        model = build_stage(2, sp=True)  # BUG: stage 0 was built with sequence_parallel=False
        with pytest.raises(spmd.SpmdTypeError) as err:
            typed_schedule(model, sp=False)
    assert err.value.rule == ("Invariant (I) values only combine with other I values: F.layer_norm combines input (I) "
                              "with weight (R). Convert the I operand to R, so that its gradient is all-reduced in "
                              "backward.")
    assert _at(err.value) == ("transformer_layer.py", "input_layernorm_output = self.input_layernorm(hidden_states)")


def test_bug_stages_declare_different_types(cpu):
    # Each stage's author declares its side: stage 0 sends its sequence shard, stage 1 expects the full sequence.
    with pytest.raises(spmd.SpmdTypeError) as err:
        spmd_megatron.PipelineTypes(stages=[
            spmd_megatron.StageTypes(sends={"dp": V, "tp": S(0)}),
            spmd_megatron.StageTypes(receives={"dp": V, "tp": I}),  # BUG
        ])
    assert err.value.rule == ("What a pipeline stage sends is what the next stage receives: stage 0 declares it sends "
                              "S(0) on 'tp', and stage 1 declares it receives I there.")
    assert err.value.seen == (("stage 0 sends", "{dp: V, tp: S(0)}"), ("stage 1 receives", "{dp: V, tp: I}"),
                              ("axis", "'tp': S(0) is not I"))
    assert err.value.fixes == (
        "stage 0 converts before it sends: spmd.all_gather(output, 'tp', src=spmd.S(0), dst=spmd.I)  # Megatron: "
        "gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False)",
        "spmd_megatron.StageTypes(receives={'dp': spmd.V, 'tp': spmd.S(0)}, ...) for stage 1, if its code takes that")
    assert _at(err.value)[0] == HERE and _at(err.value)[1].startswith("spmd_megatron.PipelineTypes(stages=[")


def test_bug_stage_ignores_its_received_activation(cpu):
    # Every stage built with pre_process=True: stage 1 embeds the tokens itself and never uses what stage 0 sent,
    # so the received activation gets no gradient and Megatron's send_backward(None) sends nothing: stage 0 hangs.
    with stage_world(1):
        model = build_stage(2, pre_process=True)  # BUG: pre_process=ps.is_pipeline_first_stage()
        with pytest.raises(spmd.SpmdTypeError) as err:
            typed_schedule(model, sp=False)
    assert err.value.rule == (
        "A pipeline stage sends back the gradient of every activation it received: stage 1 sends None to stage 0 for "
        "micro-batch 0's activation f32[8,2,16] {dp: V, tp: I, pp: V}, so stage 0 gets no gradient (Megatron sends "
        "nothing, and stage 0 waits for it).")
    assert err.value.seen[0] == ("received", "stage 1 from stage 0: micro-batch 0's activation f32[8,2,16] "
                                             "{dp: V, tp: I, pp: V}")
    assert err.value.seen[1][0] == "received at" and err.value.seen[1][1].endswith(
        "return forward_backward_pipelining_without_interleaving(")  # the user's call into Megatron's schedule
    assert err.value.fixes == ("use the received activation in this stage's forward: model.set_input_tensor("
                               "input_tensor), and GPTModel(pre_process=False) on every stage but the first",)


def test_bug_last_gradient_send_forgotten(cpu):
    # A hand-written schedule for the last stage that sends back every micro-batch's gradient but the last.
    with stage_world(1):
        model = build_stage(2)
        comm = _comm()
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
            spmd_megatron.type_parameters(model)
            with pytest.raises(spmd.SpmdTypeError) as err, comm.iteration():
                for i, batch in enumerate(micro_batches()):
                    x = comm.recv_forward(SHAPE, is_first_stage=False)
                    model.set_input_tensor(x)
                    b = typed_inputs(batch)
                    model(b["tokens"], b["positions"], b["mask"], labels=b["labels"]).sum().backward()
                    if i < MICRO_BATCHES - 1:  # BUG: the last micro-batch's gradient is never sent
                        comm.send_backward(x.grad, is_first_stage=False)
    assert err.value.rule == (
        "A pipeline stage sends back the gradient of every activation it received: stage 1 received 1 activation "
        "from stage 0 whose gradient it never sent back, so stage 0 waits for it and its backward never runs.")
    line = _line_of("test_bug_last_gradient_send_forgotten", "x = comm.recv_forward(SHAPE")
    assert err.value.seen == (("received", "stage 1 from stage 0: micro-batch 1's activation f32[8,2,16] "
                                           "{dp: V, tp: I, pp: V}"),
                              ("received at", f"tests/{HERE}:{line}: x = comm.recv_forward(SHAPE, is_first_stage=False)"))
    assert err.value.fixes == ("comm.send_backward(input_tensor.grad, is_first_stage=False) after each micro-batch's "
                               "backward (Megatron's schedules do)", "comm.iteration(forward_only=True) if no backward "
                               "is meant")


def _line_of(test: str, code: str) -> int:
    """The number of the first line of ``test`` in this file that starts with ``code``."""
    lines = Path(__file__).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {test}("))
    return next(i for i, line in enumerate(lines[start:], start + 1) if line.strip().startswith(code))


def _ddp_stage(cpu, sync, stage: int = 0, dp: int = 2, tied: bool = True):
    """A stage of a GPTModel in Megatron's DDP, one typed step by the schedule, then ``sync``, then an optimizer step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    accommodate_tied_embedding(cpu.setattr)
    with stage_world(stage, dp=dp):
        model = build_stage(2, share_embeddings_and_output_weights=tied)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        comm = _comm()
        with spmd.set_current_mesh(spmd_megatron.mesh()):
            with spmd.typecheck():
                spmd_megatron.type_parameters(ddp)
            tracker = spmd_megatron.track_grad_sync(ddp)
            with spmd.typecheck(), comm.iteration():
                run_schedule(ddp, comm, forward_step(typed=True))
            with tracker:
                sync(ddp)
            for p in ddp.parameters():
                p.grad = p.main_grad
            with spmd.typecheck():
                optimizer.step()
    return tracker


def test_loop_tied_embedding_gradient_summed_over_pp_by_finalize_model_grads(cpu):
    from megatron.core.distributed import finalize_model_grads

    tracker = _ddp_stage(cpu, lambda ddp: finalize_model_grads([ddp]))
    assert tracker.grad_type("module.embedding.word_embeddings.weight") == {"dp": R, "pp": R, "tp": S(0)}
    assert tracker.grad_type("module.decoder.layers.0.mlp.linear_fc1.weight") == {"dp": R, "pp": V, "tp": S(0)}
    assert tracker.unsynced() == {}


def test_loop_with_one_data_parallel_rank(cpu):
    # pp=2 x tp=2 on 4 ranks leaves dp one rank: Megatron's data-parallel all-reduce over it changes nothing.
    from megatron.core.distributed import finalize_model_grads

    tracker = _ddp_stage(cpu, lambda ddp: finalize_model_grads([ddp]), stage=1, dp=1, tied=False)
    assert tracker.grad_type("module.output_layer.weight") == {"pp": V, "tp": S(0)}
    assert tracker.unsynced() == {}


def test_bug_loop_tied_embedding_gradient_never_summed_over_pp(cpu):
    # The data-parallel sync alone leaves the two copies of the tied embedding with different updates.
    with pytest.raises(spmd.SpmdTypeError) as err:
        _ddp_stage(cpu, lambda ddp: ddp.finish_grad_sync())  # BUG: finalize_model_grads([ddp]) all-reduces it
    assert err.value.rule.startswith("The gradient of parameter 'module.embedding.word_embeddings.weight' f32[16,16] "
                                     "is a pending sum (P) on 'pp'")
    assert _at(err.value) == (HERE, "optimizer.step()")
    assert err.value.fixes[0] == "p.grad = spmd.all_reduce(p.grad, 'pp', src=spmd.P, dst=spmd.R)"


# ---------------------------------------------------------------------------
# numbers: 4 gloo processes, pp=2 x tp=2, Megatron's schedule


@pytest.fixture(scope="module")
def gloo_rows(tmp_path_factory):
    return launch_gloo(worker, GLOO_WORLD, tmp_path_factory.mktemp("megatron_pipeline_gloo"))


@pytest.mark.parametrize("sp", GLOO_CONFIGS)
def test_gloo_typed_pipeline_equals_untyped(gloo_rows, sp):
    # Megatron's forward_backward_pipelining_without_interleaving, 2 micro-batches, on real gloo processes:
    # untyped (its own P2PCommunicator) and typed (spmd_megatron.p2p_communicator), bit for bit.
    for rank in range(GLOO_WORLD):
        row = gloo_rows[(rank, f"pp2_tp2_sp{int(sp)}")]
        assert "error" not in row, row.get("error")
        stage = rank // 2
        assert row["stage"] == stage
        assert row["losses_equal"] and row["grads_equal"], row
        assert row["loss_typed_vs_untyped"] == 0.0 and row["grad_typed_vs_untyped"] == 0.0
        assert row["n_losses"] == (MICRO_BATCHES if stage == 1 else 0) and row["awaiting"] == 0
        assert row["n_params"] == row["grads_nonzero"] == (14 if stage == 0 else 15)  # stage 0's from stage 1's
        want = "{'pp': V, 'tp': " + ("S(0)" if sp else "I") + "}"  # dp has one rank here: no type
        assert row["input_types"] == ([want] * MICRO_BATCHES if stage == 1 else ["None"] * MICRO_BATCHES)
        if stage == 1:
            assert row["loss_nonzero"]
        assert all("'pp': V" in t for t in row["grad_types"]), row["grad_types"]


def test_gloo_stages_must_hold_the_same_declaration(gloo_rows):
    for rank in range(GLOO_WORLD):
        row = gloo_rows[(rank, "disagree")]
        assert "error" not in row, row.get("error")
        stage, other = rank // 2, 1 - rank // 2
        assert row["rule"] == (f"Every pipeline stage holds the same PipelineTypes: stage {stage} and stage {other} "
                               "declare different types for what stage 0 sends to stage 1.")
        mine, theirs = ("{dp: V, tp: I}", "{dp: V, tp: S(0)}")[:: 1 if stage == 0 else -1]
        assert row["seen"] == [[f"stage {stage} (this one)", mine], [f"stage {other}", theirs]]
        assert row["fixes"] == ["build the PipelineTypes from the same code and config on every rank"]
