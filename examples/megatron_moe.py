"""Typecheck an unmodified Megatron-core mixture-of-experts GPTModel, on a fake process group.

Run: python examples/megatron_moe.py [--tp 2] [--ep 2] [--dp 4] [--dispatcher alltoall|allgather] [--bug]

Needs ``megatron-core`` (``pip install megatron-core==0.16.1``). No GPU and no other process: a
fake process group of tp*dp ranks stands in for the cluster (this process is rank 0).

The same three calls as a dense model: ``register()``, ``mesh()``, ``type_parameters(model)``.
The experts live on the expert mesh ``(edp, ep, etp)``, the same ranks presented as Megatron's
expert groups; it is current inside every MoE layer. ``--bug`` removes the router weight's
``sequence_parallel`` mark (Megatron-LM #599): its gradient would never be summed over tp, and the
check stops at the router's matmul.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd
from spmd_types import megatron as spmd_megatron

VOCAB, SEQ, BATCH, EXPERTS = 64, 16, 2, 4


class _NoStream:
    """The alltoall dispatcher's device-to-host CUDA stream, on a machine without CUDA: copies run inline."""

    def wait_stream(self, stream):
        return None

    def record_event(self):
        return self

    def synchronize(self):
        return None


def cpu_accommodations() -> None:
    """What Megatron-core's MoE needs to run on a CPU; Megatron itself is not edited."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="": contextlib.nullcontext()
    moe_utils.te_general_gemm = None  # no Transformer Engine: the router multiplies with torch
    stream = _NoStream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()

    def to_host(t, as_numpy=False, record_stream=False):  # split sizes as NumPy arrays, as from a GPU
        if as_numpy and torch.is_tensor(t):
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.numpy(torch.Tensor.detach(t))
        return t

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def build(tp: int, ep: int, dispatcher: str, layers: int = 2, hidden: int = 64, heads: int = 8):
    """An MoE GPTModel: local layer spec, SequentialMLP experts, top-2 router with the load-balancing loss."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    sp = tp > 1
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=tp, sequence_parallel=sp, expert_model_parallel_size=ep,
                               num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
                               moe_aux_loss_coeff=0.01, add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if sp:  # torch's LayerNorm wrapper refuses sequence parallel; FusedLayerNorm needs Apex
        class SPLayerNorm(torch.nn.LayerNorm):
            def __init__(self, config, hidden_size, eps=1e-5, **_):
                super().__init__(hidden_size, eps=eps)
                for p in self.parameters():
                    p.sequence_parallel = True

        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SPLayerNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SPLayerNorm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def main(tp: int = 2, ep: int = 2, dp: int = 4, dispatcher: str = "alltoall", bug: bool = False) -> dict:
    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    cpu_accommodations()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=tp * dp, store=FakeStore())
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 create_gloo_process_groups=False)
    start = time.perf_counter()
    spmd_megatron.register()
    model = build(tp, ep, dispatcher)
    if bug:
        for layer in model.decoder.layers:
            del layer.mlp.router.weight.sequence_parallel  # the router outside the sequence-parallel region
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    out: dict = {}
    try:
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
            spmd_megatron.type_parameters(model)
            ids = {"dp": spmd.V, "tp": spmd.I}
            tokens, positions = spmd.assert_type(tokens, ids), spmd.assert_type(positions, ids)
            loss = model(tokens, positions, mask, labels=tokens)
            loss.sum().backward()
        expert = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
        out = {"loss": spmd.get_type(loss), "expert grad": spmd.get_type(expert.grad),
               "router grad": spmd.get_type(model.decoder.layers[0].mlp.router.weight.grad)}
        print(f"MoE GPTModel ({dispatcher} dispatcher) on a fake group of {tp * dp} ranks (tp={tp}, ep={ep}, "
              f"dp={dp}): typechecked in {time.perf_counter() - start:.1f} s")
        for name, types in out.items():
            print(f"  {name + ':':13s} {types}")
    except spmd.SpmdTypeError as err:
        print(err)
        out = {"error": err}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall")
    parser.add_argument("--bug", action="store_true")
    args = parser.parse_args()
    main(args.tp, args.ep, args.dp, args.dispatcher, args.bug)
