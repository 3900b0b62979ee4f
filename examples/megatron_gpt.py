"""Typecheck an unmodified Megatron-core GPTModel and its training step, on a fake process group.

Run: python examples/megatron_gpt.py [--tp 2] [--dp 2] [--sequence-parallel]

Needs ``megatron-core`` (``pip install megatron-core==0.16.1``). No GPU and no
other process: a fake process group of tp*dp ranks stands in for the cluster
(this process is rank 0), so the check runs at production sizes in seconds.

1. ``spmd_megatron.register()``, ``spmd_megatron.mesh()``,
   ``spmd_megatron.type_parameters(model)``: the three calls.
2. One forward and backward typed: the loss comes out ``{dp: V, tp: I}`` and
   every gradient typed as Megatron means it.
3. Megatron's DistributedDataParallel and ``finalize_model_grads`` with the
   gradient buffers typed: after the sync every gradient is R where it was P,
   and the optimizer step is checked.
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

VOCAB, SEQ, BATCH = 64, 16, 2


def cpu_accommodations() -> None:
    """Megatron-core allocates on ``torch.cuda.current_device()`` and forks a CUDA RNG tracker for dropout."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="": contextlib.nullcontext()


def build(tp: int, sp: bool, layers: int = 2, hidden: int = 64, heads: int = 8):
    """GPTModel, local layer spec; under sequence parallel a LayerNorm that marks its parameters as Megatron's does."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=tp, sequence_parallel=sp)
    spec = get_gpt_layer_local_spec()
    if sp:  # torch's LayerNorm wrapper refuses sequence parallel; FusedLayerNorm needs Apex
        class SPLayerNorm(torch.nn.LayerNorm):
            def __init__(self, config, hidden_size, eps=1e-5, **_):
                super().__init__(hidden_size, eps=eps)
                for p in self.parameters():
                    p.sequence_parallel = True

        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SPLayerNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SPLayerNorm)
    return config, GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def main(tp: int = 2, dp: int = 2, sp: bool = True) -> dict:
    """Typecheck one training step; returns what it printed, as data."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    start = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=tp * dp, store=FakeStore())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    config, model = build(tp, sp)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-4)

    spmd_megatron.register()                                  # 1. the Functions, with their types
    mesh = spmd_megatron.mesh()                               #    {"dp": group, "tp": group}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    with spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            spmd_megatron.type_parameters(ddp)                #    every parameter, from Megatron's attributes
        tracker = spmd_megatron.track_grad_sync(ddp)         # 3. typed gradient buffers (before backward)
        with spmd.typecheck():
            ids = {"dp": spmd.V, "tp": spmd.I}               # 2. a micro-batch per dp rank, the same on tp
            loss = ddp(spmd.assert_type(tokens, ids), spmd.assert_type(positions, ids), mask,
                       labels=spmd.assert_type(torch.randint(0, VOCAB, (BATCH, SEQ)), ids))
            loss.sum().backward()
        before = tracker.grad_type("module.decoder.final_layernorm.weight")
        with tracker:
            finalize_model_grads([ddp])
        after = tracker.grad_type("module.decoder.final_layernorm.weight")
        for p in ddp.parameters():
            p.grad = p.main_grad
        with spmd.typecheck():
            optimizer.step()                                  #    a gradient still P here is an error
    result = {"loss": spmd.get_type(loss), "norm_grad_before_sync": before, "norm_grad_after_sync": after,
              "unsynced": tracker.unsynced(), "seconds": time.perf_counter() - start, "ranks": tp * dp}
    parallel_state.destroy_model_parallel()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cpu_accommodations()
    r = main(args.tp, args.dp, args.sequence_parallel)
    print(f"GPTModel on a fake process group of {r['ranks']} ranks (tp={args.tp}, dp={args.dp}, "
          f"sequence_parallel={args.sequence_parallel}): typechecked in {r['seconds']:.1f} s")
    print(f"  loss:                               {r['loss']}")
    print(f"  final_layernorm.weight grad, before: {r['norm_grad_before_sync']}")
    print(f"                              after:  {r['norm_grad_after_sync']}  (finalize_model_grads)")
    print(f"  gradients still pending a sum: {r['unsynced'] or 'none'}; optimizer step checked")
