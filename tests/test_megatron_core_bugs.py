"""Megatron-core 0.16.1, unmodified: planted bugs, each caught where it happens with the fix (issue 7).

Each bug is one realistic line, made by monkeypatching Megatron in this file (Megatron is never edited):
the model's wiring (a bias added on every rank, a missing or doubled all-reduce, a wrong mapping, wrong
parameter attributes, gathered logits into the vocab-parallel loss) and the training loop around it
(Megatron's DistributedDataParallel and finalize_model_grads with the gradient buffers typed). The bug
reports they reproduce are cited per test. The correct model and loop are in test_megatron_core.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from _megatron_support import (  # noqa: E402
    accommodate_cpu,
    fake_gpt,
    forward_backward,
    gpt_config,
    init_parallel,
    typed_inputs,
    typed_step,
)
from conftest import fake_mesh  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import layers, mappings  # noqa: E402

import spmd_types as spmd  # noqa: E402
from spmd_types import megatron as spmd_megatron  # noqa: E402

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
HERE = Path(__file__).name


@pytest.fixture
def cpu(monkeypatch):
    """The two CPU accommodations for one test, undone after it; Megatron's parallel state torn down."""
    accommodate_cpu(monkeypatch.setattr)
    yield monkeypatch
    ps.destroy_model_parallel()

# ---------------------------------------------------------------------------
# planted bugs: one realistic line each, monkeypatched here; caught where it happens, with the fix


def _caught(model, mesh, batch) -> spmd.SpmdTypeError:
    with pytest.raises(spmd.SpmdTypeError) as err:
        typed_step(model, batch, mesh)
    return err.value


def _at(err: spmd.SpmdTypeError) -> tuple[str, str]:
    """(file name, code) of the line the error names."""
    where, _, code = err.source.partition(": ")
    return Path(where.rsplit(":", 1)[0]).name, code


def _row_forward(bias_inside: bool = False, bias_before_reduce: bool = False, raw_all_reduce: bool = False):
    """A RowParallelLinear.forward (non-SP path) with one of three mistakes switched on."""

    def forward(self, input_):
        out = self._forward_impl(input=input_, weight=self.weight, bias=self.bias if bias_inside else None,
                                 gradient_accumulation_fusion=False, allreduce_dgrad=False,
                                 sequence_parallel=False, tp_group=None, grad_output_buffer=None)
        if bias_before_reduce:
            out = out + self.bias  # BUG: the bias joins each rank's partial sum, so the all-reduce adds it tp times
        if raw_all_reduce:
            torch.distributed.all_reduce(out, group=self.tp_group)  # BUG: in place, no backward communication
            return out + self.bias, None
        out = mappings.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        return (out if bias_inside or bias_before_reduce else out + self.bias), None

    return forward


def test_bug_row_parallel_bias_added_before_all_reduce(cpu):
    # huggingface/text-generation-inference#1036, GeeeekExplorer/nano-vllm#99, Wenyueh/MinivLLM#80:
    # a row-parallel bias added to each rank's partial product is summed tp times.
    cpu.setattr(layers.RowParallelLinear, "forward", _row_forward(bias_before_reduce=True))
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("A pending sum (P) can only be added to another pending sum: Tensor.__add__ (+) adds P to I, "
                        "and the I value would be added once on every rank.")
    assert _at(err) == (HERE, "out = out + self.bias  # BUG: the bias joins each rank's partial sum, so the "
                              "all-reduce adds it tp times")
    assert err.fixes[0] == "spmd.all_reduce(out, 'tp', src=spmd.P, dst=spmd.R)"


def test_bug_row_parallel_bias_inside_the_matmul(cpu):
    # The same mistake passed to Megatron's own Function (bias=self.bias on a row-parallel weight).
    cpu.setattr(layers.RowParallelLinear, "forward", _row_forward(bias_inside=True))
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("LinearWithGradAccumulationAndAsyncCommunication: a row-parallel product (weight S(1) on "
                        "'tp') is a pending sum, and a bias inside it would be added once on every rank")
    assert _at(err)[0] == HERE and _at(err)[1].startswith("out = self._forward_impl(")
    assert err.fixes == ("pass bias=None and add the bias after the all-reduce (RowParallelLinear does)",)


def test_bug_raw_in_place_all_reduce_instead_of_the_mapping(cpu):
    # Wenyueh/MinivLLM#13: torch.distributed.all_reduce on the activation: forward right, backward has no
    # communication (the mapping's autograd Function is what makes the backward correct).
    cpu.setattr(layers.RowParallelLinear, "forward", _row_forward(raw_all_reduce=True))
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("torch.distributed.all_reduce writes its input in place, and an in-place op cannot change "
                        "its tensor's type: on axis 'tp' it takes P to R.")
    assert _at(err) == (HERE, "torch.distributed.all_reduce(out, group=self.tp_group)  # BUG: in place, no backward "
                              "communication")
    assert err.fixes[0] == "x = spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)"


def test_bug_column_parallel_input_gradient_never_all_reduced(cpu):
    # NovaSky-AI/SkyRL#1886: an LM head whose input gradient is not all-reduced over tp ("we train on
    # unreduced gradients"). Here: ColumnParallelLinear built with disable_grad_reduce=True in a dense model.
    init = layers.ColumnParallelLinear.__init__
    cpu.setattr(layers.ColumnParallelLinear, "__init__",
                lambda self, *a, **k: init(self, *a, **{**k, "disable_grad_reduce": True}))  # BUG
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("LinearWithGradAccumulationAndAsyncCommunication: I never mixes with R or V on 'tp': the "
                        "input's gradient would need an all-reduce that nothing does")
    assert _at(err) == ("attention.py", "mixed_qkv, _ = apply_module(self.linear_qkv)(hidden_states)")
    assert err.fixes[0] == ("spmd.reinterpret(input, 'tp', src=spmd.I, dst=spmd.R)  # Megatron: "
                            "copy_to_tensor_model_parallel_region(input)")


def test_bug_all_reduce_where_sequence_parallel_needs_reduce_scatter(cpu):
    # NVIDIA/Megatron-LM#236 (row-parallel output and bias under sequence parallel): the row-parallel output
    # all-reduced instead of reduce-scattered leaves a full sequence where the residual stream is sharded.
    cpu.setattr(layers, "reduce_scatter_to_sequence_parallel_region",
                mappings.reduce_from_tensor_model_parallel_region)  # BUG
    err = _caught(*fake_gpt(2, 2, sp=True))
    assert err.rule == ("Invariant (I) values only combine with other I values: Tensor.__add__ (+) combines input (I) "
                        "with other (R). Convert the I operand to R, so that its gradient is all-reduced in backward.")
    assert _at(err) == ("fused_bias_dropout.py", "x = x + bias")
    assert err.fixes[0] == "spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)"  # the generic fix; the real one: reduce-scatter


def test_bug_vocab_parallel_embedding_not_all_reduced(cpu):
    # The masked lookup of a vocab-sharded embedding is a partial sum; skipping its all-reduce mixes it with
    # the replicated position embedding.
    cpu.setattr(layers, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)  # BUG
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("Invariant (I) values only combine with other I values: Tensor.__add__ (+) combines other (I) "
                        "with input (V). Convert the I operand to R, so that its gradient is all-reduced in backward.")
    assert _at(err) == ("language_model_embedding.py", "embeddings = word_embeddings + position_embeddings")
    assert err.fixes[0] == "spmd.convert(position_embeddings, 'tp', src=spmd.I, dst=spmd.R)"  # generic, see docs


def test_bug_embedding_all_reduced_twice(cpu):
    # NVIDIA/Megatron-LM#7452 (a gather whose backward all-reduces an already replicated gradient doubles the
    # gradients): here the forward twin, an all-reduce of a value every tp rank already holds.
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    forward = LanguageModelEmbedding.forward
    cpu.setattr(LanguageModelEmbedding, "forward", lambda self, *a, **k: (
        mappings.reduce_from_tensor_model_parallel_region(forward(self, *a, **k))))  # BUG
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("reduce_from_tensor_model_parallel_region sums over 'tp', but its input is I there: the same "
                        "value on every rank, so the sum multiplies it by the group size")
    assert _at(err) == (HERE, "mappings.reduce_from_tensor_model_parallel_region(forward(self, *a, **k))))  # BUG")
    assert err.fixes == ("drop the reduce_from_tensor_model_parallel_region: the value is already complete on every "
                         "rank", "spmd.convert(input, 'tp', src=spmd.I, dst=spmd.P)  # if one rank's copy is meant")


def test_bug_gathered_logits_into_vocab_parallel_cross_entropy(cpu):
    # NVIDIA/Megatron-LM#7452 item 2: GPTModel(parallel_output=False) with labels gathers the logits and hands
    # them to vocab_parallel_cross_entropy: loss = correct + log(TP), wrong gradients. Unmodified Megatron.
    model, mesh, batch = fake_gpt(2, 2, model_kwargs={"parallel_output": False})  # BUG
    err = _caught(model, mesh, batch)
    assert err.rule == ("vocab-parallel cross entropy: its logits must be sharded on the vocab dim (S(-1)) on 'tp'; "
                        "its forward all-reduces MAX and SUM over 'tp' and its backward is local, so the loss is I")
    assert _at(err) == ("language_module.py", "loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)")
    assert err.fixes == ("keep the logits vocab-sharded: GPTModel(parallel_output=True), or the output layer's "
                         "ColumnParallelLinear(..., gather_output=False)",
                         "spmd.convert(logits, 'tp', src=spmd.I, dst=spmd.S(-1))")


def test_bug_label_smoothing_in_vocab_parallel_cross_entropy(cpu):
    # NVIDIA/Megatron-LM#737: with label_smoothing > 0 the mean log-probability is taken over the local vocab
    # shard, so the loss differs per tp rank. No sound type: refused.
    from megatron.core.models.common.language_module import language_module

    ce = language_module.tensor_parallel.vocab_parallel_cross_entropy
    cpu.setattr(language_module.tensor_parallel, "vocab_parallel_cross_entropy",
                lambda logits, labels: ce(logits, labels, label_smoothing=0.1))  # BUG
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("vocab_parallel_cross_entropy with label_smoothing > 0 has no sound type: its forward takes "
                        "the mean log-probability over this rank's vocab shard only, so the loss differs per tp rank "
                        "(neither I nor a pending sum)")
    assert _at(err) == (HERE, "lambda logits, labels: ce(logits, labels, label_smoothing=0.1))  # BUG")
    assert err.fixes == ("vocab_parallel_cross_entropy(logits, labels)  # label_smoothing=0.0",
                         "all-reduce the smoothing term over tp yourself (Megatron-LM issue #737)")


def test_bug_sequence_parallel_norm_not_marked(cpu):
    # NVIDIA/Megatron-LM#1448, #1446 and EleutherAI/gpt-neox#1257: a norm under sequence parallel without the
    # ``sequence_parallel`` attribute; finalize_model_grads then never all-reduces its gradient over tp.
    model, mesh, batch = fake_gpt(2, 2, sp=True)
    for p in model.decoder.layers[0].input_layernorm.parameters():
        del p.sequence_parallel  # BUG: the user's norm does not mark its parameters
    err = _caught(model, mesh, batch)
    assert err.rule == ("Invariant (I) values only combine with other I values: F.layer_norm combines weight (I) "
                        "with input (V). Convert the I operand to R, so that its gradient is all-reduced in backward.")
    assert _at(err) == ("transformer_layer.py", "input_layernorm_output = self.input_layernorm(hidden_states)")
    assert err.fixes[0] == "spmd.convert(weight, 'tp', src=spmd.I, dst=spmd.R)"  # i.e. mark it sequence_parallel


def test_bug_replicated_weight_marked_tensor_parallel(cpu):
    # ROCm/TransformerEngine#715 "Do not mark replicated weights as tensor-model-parallel" (and
    # NVIDIA-NeMo/RL#3788): a replicated norm weight marked as a tp shard.
    model, mesh, batch = fake_gpt(2, 2)
    w = model.decoder.final_layernorm.weight
    w.tensor_model_parallel, w.partition_dim = True, 0  # BUG
    err = _caught(model, mesh, batch)
    assert err.rule == ("Invariant (I) values only combine with other I values: F.layer_norm combines input (I) with "
                        "weight (S(0)). Convert the I operand to R, so that its gradient is all-reduced in backward.")
    assert _at(err) == ("transformer_block.py", "hidden_states = self.final_layernorm(hidden_states)")
    assert err.fixes[0] == "spmd.convert(input, 'tp', src=spmd.I, dst=spmd.R)"


def test_bug_sequence_parallel_embedding_not_scattered(cpu):
    # NVIDIA/Megatron-LM#1635 (a report about this very scatter): without it the full sequence enters the
    # sequence-parallel norms.
    from megatron.core.models.common.embeddings import language_model_embedding

    cpu.setattr(language_model_embedding.tensor_parallel, "scatter_to_sequence_parallel_region",
                lambda x, group=None: x)  # BUG
    err = _caught(*fake_gpt(2, 2, sp=True))
    assert err.rule == ("Invariant (I) values only combine with other I values: F.layer_norm combines input (I) with "
                        "weight (R). Convert the I operand to R, so that its gradient is all-reduced in backward.")
    assert _at(err) == ("transformer_layer.py", "input_layernorm_output = self.input_layernorm(hidden_states)")
    assert err.fixes[0] == "spmd.convert(input, 'tp', src=spmd.I, dst=spmd.R)"


def test_bug_loss_all_reduced_over_tp(cpu):
    # Each tp rank already holds the whole loss (vocab-parallel cross entropy all-reduces inside); summing it
    # again scales loss and gradients by tp.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    loss_fn = LanguageModule.compute_language_model_loss
    cpu.setattr(LanguageModule, "compute_language_model_loss", lambda self, labels, logits: (
        mappings.reduce_from_tensor_model_parallel_region(loss_fn(self, labels, logits))))  # BUG
    err = _caught(*fake_gpt(2, 2))
    assert err.rule == ("reduce_from_tensor_model_parallel_region sums over 'tp', but its input is I there: the same "
                        "value on every rank, so the sum multiplies it by the group size")
    assert _at(err) == (HERE, "mappings.reduce_from_tensor_model_parallel_region(loss_fn(self, labels, logits))))  "
                              "# BUG")


def test_bug_row_parallel_input_split_again(cpu):
    # input_is_parallel=False on a layer whose input is already the tp shard: Megatron would split the shard.
    model, mesh, batch = fake_gpt(2, 2)
    model.decoder.layers[0].self_attention.linear_proj.input_is_parallel = False  # BUG
    err = _caught(model, mesh, batch)
    assert err.rule == "spmd.convert's src= must be the input's type on the axis: src=I, but the tensor is V on axis 'tp'."
    assert _at(err) == ("attention.py", "output, bias = self.linear_proj(core_attn_out)")
    assert err.fixes[0] == "spmd.all_to_all(x, 'tp', src=spmd.V, dst=spmd.S(2))"  # S(-1) of the 3-d input


def test_bug_gather_with_tensor_parallel_output_grad_on_duplicated_compute(cpu):
    # NVIDIA/Megatron-LM#7452 (WanModel.forward): gathering the sequence-parallel output with the default
    # tensor_parallel_output_grad=True before duplicated (replicated) compute doubles its gradients.
    fake_mesh((2,), ("tp",))  # a fake world of 2 ranks
    init_parallel(2)
    spmd_megatron.register()
    with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
        h = spmd.assert_type(torch.randn(4, 2, 8, requires_grad=True), {"dp": V, "tp": S(0)})
        w = spmd.assert_type(torch.ones(8, requires_grad=True), {"dp": R, "tp": I})
        with pytest.raises(spmd.SpmdTypeError) as err:
            full = mappings.gather_from_sequence_parallel_region(h)  # BUG: tensor_parallel_output_grad=False
            torch.nn.functional.layer_norm(full, (8,), w)
        full = mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)
        assert spmd.get_type(torch.nn.functional.layer_norm(full, (8,), w)) == {"tp": I}  # dp has size 1: no type
    assert err.value.rule == ("Invariant (I) values only combine with other I values: F.layer_norm combines weight (I) "
                              "with input (R). Convert the I operand to R, so that its gradient is all-reduced in "
                              "backward.")
    assert _at(err.value) == (HERE, "torch.nn.functional.layer_norm(full, (8,), w)")


# ---------------------------------------------------------------------------
# the training loop: Megatron's DistributedDataParallel, finalize_model_grads, an optimizer step


def _ddp_step(cpu, sync):
    """One typed step of a DDP-wrapped GPTModel (tp=2, SP, dp=2); ``sync(ddp, tracker)`` does the gradient sync.

    Megatron's own optimizer cannot run on CPU (FP32Optimizer.__init__ makes ``torch.tensor([1.0],
    device='cuda')``, clip_grads.py asserts ``torch.cuda.FloatTensor`` gradients, get_megatron_optimizer needs
    gloo groups a fake process group cannot make), so the step is what Megatron's FP32Optimizer does around
    torch's Adam: ``param.grad = param.main_grad``, then ``step()``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model, mesh, batch = fake_gpt(2, 2, sp=True)
    ddp = DistributedDataParallel(gpt_config(2, True), DistributedDataParallelConfig(), model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    with spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            spmd_megatron.type_parameters(ddp)
        tracker = spmd_megatron.track_grad_sync(ddp)
        with spmd.typecheck():
            forward_backward(ddp, typed_inputs(batch))
        with tracker:
            sync(ddp, tracker)
        for p in ddp.parameters():
            p.grad = p.main_grad
        with spmd.typecheck():
            optimizer.step()
    return tracker


def test_loop_correct_gradient_types_follow_the_syncs(cpu):
    from megatron.core.distributed import finalize_model_grads

    seen = {}

    def sync(ddp, tracker):
        seen["before"] = {n: tracker.grad_type(n) for n in tracker.params}
        finalize_model_grads([ddp])

    tracker = _ddp_step(cpu, sync)
    name = "module.decoder.layers.0.input_layernorm.weight"
    assert seen["before"][name] == {"dp": P, "tp": P}
    assert tracker.grad_type(name) == {"dp": R, "tp": R}
    assert tracker.grad_type("module.output_layer.weight") == {"dp": R, "tp": S(0)}
    assert tracker.unsynced() == {}


def test_bug_loop_sequence_parallel_norm_gradients_not_all_reduced(cpu):
    # NVIDIA/Megatron-LM#1446 (final_layernorm main_grad differs across TP ranks with TP+SP), EleutherAI/gpt-neox#1257
    # (norm gradients never synced over TP: poor convergence): the data-parallel sync alone skips the tp all-reduce.
    with pytest.raises(spmd.SpmdTypeError) as err:
        _ddp_step(cpu, lambda ddp, tracker: ddp.finish_grad_sync())  # BUG: finalize_model_grads([ddp]) needed
    assert err.value.rule.startswith("The gradient of parameter 'module.decoder.layers.0.input_layernorm.weight' "
                                     "f32[16] is a pending sum (P) on 'tp'")
    assert _at(err.value) == (HERE, "optimizer.step()")
    assert err.value.fixes[0] == "p.grad = spmd.all_reduce(p.grad, 'tp', src=spmd.P, dst=spmd.R)"


def test_bug_loop_step_without_data_parallel_sync(cpu):
    # The classic forgotten gradient sync: each dp rank steps with its own micro-batch's gradient.
    with pytest.raises(spmd.SpmdTypeError) as err:
        _ddp_step(cpu, lambda ddp, tracker: None)  # BUG: no finalize_model_grads
    assert err.value.rule.startswith("The gradient of parameter 'module.embedding.word_embeddings.weight' "
                                     "f32[16,16] is a pending sum (P) on 'dp'")
    assert _at(err.value) == (HERE, "optimizer.step()")


def test_bug_loop_tensor_parallel_shards_all_reduced_over_tp(cpu):
    # NVIDIA-NeMo/RL#3788 and ROCm/TransformerEngine#715 (TP placement ignored in a gradient reduction): summing
    # every gradient over tp also sums the shards of different weights into each other.
    from megatron.core.distributed import finalize_model_grads

    def sync(ddp, tracker):
        finalize_model_grads([ddp])
        for p in ddp.parameters():
            torch.distributed.all_reduce(p.main_grad, group=ps.get_tensor_model_parallel_group())  # BUG

    with pytest.raises(spmd.SpmdTypeError) as err:
        _ddp_step(cpu, sync)
    assert err.value.rule == ("A gradient is summed over 'tp', but it is S(0) there: each rank's gradient is complete "
                              "for its own shard or copy; the sum multiplies or mixes it.")
    assert err.value.seen == (("parameter", "module.embedding.word_embeddings.weight"),
                              ("gradient", "{dp: R, tp: S(0)}"), ("axis", "tp"))
    assert _at(err.value) == (HERE, "torch.distributed.all_reduce(p.main_grad, group=ps.get_tensor_model_parallel_"
                                    "group())  # BUG")
    assert err.value.fixes == ("sum only the gradients that are P on 'tp': leave module.embedding.word_embeddings."
                               "weight out of this all-reduce",)


def test_loop_summing_a_gradient_twice_is_refused(cpu):
    # finish_grad_sync run twice (e.g. once by hand and once inside finalize_model_grads with a fresh flag).
    def sync(ddp, tracker):
        ddp.finish_grad_sync()
        for bucket_group in ddp.bucket_groups:
            bucket_group.is_last_microbatch = True
            bucket_group.grad_reduce_handle = None
        ddp.finish_grad_sync()  # BUG

    with pytest.raises(spmd.SpmdTypeError) as err:
        _ddp_step(cpu, sync)
    assert err.value.rule == "A gradient is summed over 'dp', but it was already summed there; the sum multiplies or mixes it."
