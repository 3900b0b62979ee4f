"""Megatron-core 0.16.1 mixture of experts: bugs, each caught where it happens with the fix (issue 16).

One is Megatron's own, unplanted: at ep=1 with etp != tp its DistributedDataParallel syncs the expert
gradients over the dense data-parallel group (Megatron-LM #1628, open). The others are one realistic line
each, monkeypatched here (Megatron is never edited): the router outside the sequence-parallel region
(Megatron-LM #599), the all-to-all's split sizes swapped on the way back, the tokens-per-expert counts not
all-reduced before the load-balancing loss, the aux loss summed over tp before it is attached (its gradient
then scales with the tp size, the symptom of Megatron-LM #5047 and #3768), and an expert weight typed as if
every rank held the same experts. The correct model is in test_megatron_moe.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from _megatron_moe_support import accommodate_moe_cpu, fake_moe, moe_config, typed_moe_step  # noqa: E402
from _megatron_support import forward_backward, typed_inputs  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.transformer.moe import moe_utils, router, token_dispatcher  # noqa: E402

import spmd_types as spmd  # noqa: E402
from spmd_types import megatron as spmd_megatron  # noqa: E402
from spmd_types.integrations.megatron import moe as _moe  # noqa: E402

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
HERE = Path(__file__).name


@pytest.fixture
def cpu(monkeypatch):
    accommodate_moe_cpu(monkeypatch.setattr)
    yield monkeypatch
    ps.destroy_model_parallel()


def _caught(model, batch) -> spmd.SpmdTypeError:
    with pytest.raises(spmd.SpmdTypeError) as err:
        typed_moe_step(model, batch)
    return err.value


def _at(err: spmd.SpmdTypeError) -> tuple[str, str]:
    """(file name, code) of the line the error names."""
    where, _, code = err.source.partition(": ")
    return Path(where.rsplit(":", 1)[0]).name, code


def test_bug_router_outside_the_sequence_parallel_region(cpu):
    # Megatron-LM #599 (fixed by #619): under sequence parallelism each tp rank's router sees its own slice of
    # the sequence, but its weight was not marked sequence_parallel, so its gradient was never all-reduced over
    # tp and the routers drifted apart. Typed I on tp (the same gradient on every rank), it meets V tokens.
    model, batch = fake_moe(2, 2, 8, "alltoall")
    for layer in model.decoder.layers:
        del layer.mlp.router.weight.sequence_parallel  # BUG: the router weight as before Megatron-LM #619
    err = _caught(model, batch)
    assert err.rule == ("Invariant (I) values only combine with other I values: torch.mm combines other (I) with "
                        "input (V). Convert the I operand to R, so that its gradient is all-reduced in backward.")
    assert _at(err) == ("moe_utils.py", "output = torch.mm(inp.to(router_dtype), weight.to(router_dtype).t())")
    # R on tp is what Megatron's sequence_parallel attribute gives (its gradient P until finalize_model_grads)
    assert err.fixes == ("spmd.convert(weight.to(router_dtype).t(), 'tp', src=spmd.I, dst=spmd.R)",)


def test_bug_expert_gradients_synced_over_dp_at_ep1_is_megatrons_own(cpu):
    # Megatron-LM #1628 (open; fix proposed in #1622), in Megatron-core 0.16.1 as installed: at ep=1 with
    # etp=2 beside tp=1, the expert weights are not marked allreduce=False (only ep > 1 marks them), so
    # DistributedDataParallel sums their gradients over the dense dp group, across the etp shards.
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    model, batch = fake_moe(1, 1, 4, "alltoall", etp=2)
    ddp = DistributedDataParallel(moe_config(1, 1, 2, "alltoall"), DistributedDataParallelConfig(), model)
    with spmd.set_current_mesh(spmd_megatron.mesh()):
        with spmd.typecheck():
            spmd_megatron.type_parameters(ddp)
        tracker = spmd_megatron.track_grad_sync(ddp)
        with spmd.typecheck():
            forward_backward(ddp, typed_inputs(batch))
        with pytest.raises(spmd.SpmdTypeError) as err, tracker:
            finalize_model_grads([ddp])
    assert err.value.rule == ("A gradient is summed over 'etp', but it is S(0) there: each rank's gradient is "
                              "complete for its own shard or copy; the sum multiplies or mixes it.")
    # where Megatron's gradient buckets flush their coalesced all-reduce
    assert _at(err.value) == ("param_and_grad_buffer.py", "with stream_context, _coalescing_manager("
                                                          "communication_group, async_ops=async_op) as cm:")
    assert ("parameter", "module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight") in err.value.seen
    assert err.value.fixes == ("sum only the gradients that are P on 'etp': leave "
                               "module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight out of this "
                               "all-reduce",)


def _combine_with_swapped_splits(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
    """MoEAlltoAllTokenDispatcher.token_combine with the way back's split sizes swapped."""
    from megatron.core.tensor_parallel import all_to_all

    self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
    # BUG: the dispatch's split sizes reused as they were: the combine must send output_splits, receive input_splits
    return all_to_all(self.ep_group, hidden_states, self.output_splits, self.input_splits)


def test_bug_all_to_all_splits_swapped_on_the_way_back(cpu):
    cpu.setattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "token_combine", _combine_with_swapped_splits)
    model, batch = fake_moe(2, 2, 8, "alltoall")
    err = _caught(model, batch)
    assert err.rule == ("Megatron's all_to_all: input_split_sizes add up to 16 rows, but the input has 22: the rows "
                        "sent would not be this rank's rows")
    assert _at(err) == (HERE, "return all_to_all(self.ep_group, hidden_states, self.output_splits, self.input_splits)")
    assert err.fixes == ("on the way back (the combine), send with the dispatch's output_split_sizes and receive with "
                         "its input_split_sizes: all_to_all(group, x, input_splits, output_splits)",)


def _counts_not_reduced(routing_map, reduce_group, topk=None, with_padding_mask=False):
    """moe_utils.get_tokens_per_expert_and_token_count without the all-reduce of the counts."""
    local_tokens_per_expert = routing_map.sum(dim=0)
    global_tokens_per_expert = local_tokens_per_expert  # BUG: reduce_from_tensor_model_parallel_region left out
    local_num_tokens = routing_map.shape[0]
    return global_tokens_per_expert, local_num_tokens, local_num_tokens * reduce_group.size()


def test_bug_tokens_per_expert_not_all_reduced_before_load_balancing(cpu):
    cpu.setattr(router, "get_tokens_per_expert_and_token_count", _counts_not_reduced)
    model, batch = fake_moe(2, 2, 8, "allgather")
    err = _caught(model, batch)
    assert err.rule == ("switch_load_balancing_loss_func: tokens_per_expert is V on 'etp', the counts of this rank's "
                        "tokens only; the load-balancing loss pairs each rank's probabilities with the counts of all "
                        "the tokens of its group (tp x cp), the same on every rank there")
    assert _at(err) == ("router.py", "aux_loss = switch_load_balancing_loss_func(")
    assert err.fixes == ("reduce_from_tensor_model_parallel_region(local_tokens_per_expert, tp_cp_group) before the "
                         "loss (as get_tokens_per_expert_and_token_count does)",)


def test_bug_aux_loss_summed_over_tp_before_it_is_attached(cpu):
    # Each tp rank's aux loss is its own share (its slice of the sequence); summing the shares on every rank
    # and attaching the sum makes every rank add the whole loss: its gradient grows with the tp size.
    original = router.TopKRouter.attach_and_log_load_balancing_loss

    def attach_summed(self, activation, coeff, aux_loss, name, reduce_group, *args, **kwargs):
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        aux_loss = reduce_from_tensor_model_parallel_region(aux_loss, reduce_group)  # BUG: the whole loss everywhere
        return original(self, activation, coeff, aux_loss, name, reduce_group, *args, **kwargs)

    cpu.setattr(router.TopKRouter, "attach_and_log_load_balancing_loss", attach_summed)
    model, batch = fake_moe(2, 2, 8, "alltoall")
    err = _caught(model, batch)
    assert err.rule == ("MoEAuxLossAutoScaler adds each rank's aux loss to the objective, but the aux loss is I on "
                        "'etp': the same value on every rank, so it would be counted once per rank")
    assert _at(err) == ("router.py", "activation = MoEAuxLossAutoScaler.apply(activation, aux_loss)")
    assert err.fixes[0].startswith("keep the aux loss each rank's own share (V on 'etp')")


def test_bug_expert_weight_typed_as_if_shared(cpu):
    # Experts typed like dense weights: the same on every ep rank (R), so their outputs look complete on ep and
    # the combine's reduce-scatter over tp x ep would sum copies.
    def as_dense(param, axes):
        return {a: S(param.partition_dim) if a == "etp" else R for a in axes}  # BUG: R on ep, not V

    cpu.setattr(_moe, "expert_parameter_types", as_dense)
    model, batch = fake_moe(2, 2, 8, "allgather")
    err = _caught(model, batch)
    assert err.rule == ("reduce_scatter_to_sequence_parallel_region sums over 'ep', but its input is R there: the "
                        "same value on every rank, so the sum multiplies it by the group size")
    assert _at(err) == ("token_dispatcher.py", "hidden_states = reduce_scatter_to_sequence_parallel_region(")
    assert err.fixes[0] == "drop the reduce_scatter_to_sequence_parallel_region: the value is already complete on every rank"


def test_the_bugs_leave_unchecked_runs_alone(cpu):
    # With checking off the patched functions run as written: the wrappers and rules cost nothing there.
    cpu.setattr(router, "get_tokens_per_expert_and_token_count", _counts_not_reduced)
    model, batch = fake_moe(2, 2, 8, "allgather")
    loss = forward_backward(model, batch)
    assert type(loss) is torch.Tensor
    assert moe_utils.get_moe_layer_wise_logging_tracker()  # the aux loss was computed and logged
