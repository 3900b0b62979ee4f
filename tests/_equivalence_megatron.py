"""Megatron-core GPTModel under ``check_equivalence``: build, training step, batch, and the planted bugs.

The trainer around the model is what a user writes without Megatron's CUDA-only DDP and optimizer:
forward with labels (per-token losses), the mean over this rank's micro-batch, backward, the
gradient sync of ``finalize_model_grads`` written with typed collectives (sequence-parallel norms
summed over tp, every gradient averaged over dp), one SGD step; the loss is reported averaged over
dp. Megatron itself is never edited: each bug is a test-local copy of one Megatron function with one
line changed (``monkeypatch``), a checkpoint loader, or a dropout in the wrong RNG stream.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from _megatron_support import SEQ, VOCAB, build_gpt, init_parallel
from _rng_streams import Streams

import spmd_types as spmd
from spmd_types import megatron as spmd_megatron

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
BATCH = 4  # 2 sequences per dp rank (with 1, Megatron's make_viewless_tensor meets a view; see docs/equivalence.md)
HEADS, HIDDEN = 4, 16

# Where the dp axis splits a module's output (its type says V, not which dim): Megatron's activations are
# [sequence, batch, hidden]; the embedding lookups and the per-token loss are [batch, sequence, ...]; the
# attention scores are [batch, heads, sq, sk].
OUTPUT_DIMS = {
    "embedding.word_embeddings": {"dp": 0},
    "embedding.position_embeddings": {"dp": 0},
    "*.core_attention.*": {"dp": 0},
    "GPTModel": {"dp": 0},
    "*": {"dp": 1},
}


def batch(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    split = {"dp": S(0), "tp": I}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return {"tokens": (tokens, split), "positions": (positions, split), "labels": (labels, split), "mask": mask}


def build(mesh, sp: bool = False, dropout: float = 0.0, per_tp_rank_dropout: bool = False,
          attention_dropout: float = 0.0):
    """GPTModel at tp = the mesh's tp size (sequence parallel only where tp > 1), typed from its attributes."""
    tp = mesh.size(mesh.mesh_dim_names.index("tp"))
    init_parallel(tp)
    spmd_megatron.register()
    model = build_gpt(tp, sp and tp > 1, params_dtype=torch.get_default_dtype(), use_cpu_initialization=False,
                      hidden_dropout=dropout, attention_dropout=attention_dropout)
    if dropout:
        model.embedding.embedding_dropout.p = 0.0  # only the residual dropouts of the layers draw masks
    if per_tp_rank_dropout:
        for layer in model.decoder.layers:
            # BUG: the residual dropout (on values every tp rank holds, I) runs in the model-parallel RNG
            # stream, which Megatron seeds differently on every tp rank: the copies drift apart.
            layer.bias_dropout_add_exec_handler = _model_parallel_rng
    with spmd.set_current_mesh(spmd_megatron.mesh()):
        spmd_megatron.type_parameters(model)
    return model


@contextlib.contextmanager
def _model_parallel_rng():
    from megatron.core import parallel_state as ps

    torch.manual_seed(1234 + 2718 + ps.get_tensor_model_parallel_group().rank())  # model_parallel_cuda_manual_seed
    with torch.enable_grad():
        yield


def cpu_rng_tracker(same_seed_on_every_tp_rank: bool = False):
    """``CudaRNGStatesTracker.fork`` on the CPU: the model-parallel stream seeded per tp rank, as Megatron's
    ``model_parallel_cuda_manual_seed`` seeds it (1234 + 2718 + tp rank), kept between forks."""
    from megatron.core import parallel_state as ps

    streams = Streams()

    def fork(self, name: str = "model-parallel-rng"):
        tp_rank = ps.get_tensor_model_parallel_group().rank()
        # BUG (same_seed_on_every_tp_rank): the model-parallel stream seeded alike on every tp rank
        return streams.fork(name, 1234 + 2718 + (0 if same_seed_on_every_tp_rank else tp_rank))

    return fork


def step(model, batch: dict, mesh) -> torch.Tensor:
    """One training step (the trainer's own mistakes are planted in test_equivalence_gpt.py's trainer)."""
    with spmd.set_current_mesh(spmd_megatron.mesh()):
        per_token = model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"])
        loss = per_token.mean()
        loss.backward()
        for p in model.parameters():
            grad = p.grad
            if spmd.get_type(grad).get("tp") is P:  # sequence-parallel norms: each tp rank holds a share
                grad = spmd.all_reduce(grad, "tp", src=P, dst=R)
            p.grad = spmd.all_reduce(grad, "dp", src=P, dst=R, op="avg")
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        return spmd.all_reduce(loss.detach(), "dp", src=V, dst=I, op="avg")


# ---------------------------------------------------------------------------
# a fused-QKV checkpoint loader: from separate q, k, v weights (the Hugging Face layout) to Megatron's


def _split_qkv(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused rows [head 0: q k v, head 1: q k v, ...] -> the checkpoint's separate q, k, v."""
    per_head = full.reshape(HEADS, 3, HIDDEN // HEADS, *full.shape[1:])
    return tuple(per_head[:, j].reshape(HIDDEN, *full.shape[1:]) for j in range(3))  # type: ignore[return-value]


def load_qkv(full: torch.Tensor, coords: dict[str, int], *, tp: int = 2, contiguous: bool = False) -> torch.Tensor:
    """This tp rank's fused QKV rows, made from the checkpoint's q, k, v (the loader under test)."""
    q, k, v = _split_qkv(full)
    t = coords["tp"]
    if contiguous:  # BUG: q|k|v stacked and cut in tp contiguous pieces, as if the layout were not per head
        return torch.cat([q, k, v]).chunk(tp)[t].clone()
    heads = HEADS // tp
    parts = [x.reshape(HEADS, HIDDEN // HEADS, *full.shape[1:])[t * heads:(t + 1) * heads] for x in (q, k, v)]
    return torch.stack(parts, 1).reshape(-1, *full.shape[1:]).clone()


def qkv_layouts(contiguous: bool) -> dict:
    return {"*.linear_qkv.weight": functools.partial(load_qkv, contiguous=contiguous),
            "*.linear_qkv.bias": functools.partial(load_qkv, contiguous=contiguous)}


# ---------------------------------------------------------------------------
# test-local copies of two Megatron functions, each with one line changed


def vocab_parallel_ce_local_max(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
    """_VocabParallelCrossEntropy.forward, without the all-reduce of the max (label_smoothing 0)."""
    from megatron.core.parallel_state import get_tensor_model_parallel_group, get_tensor_model_parallel_rank
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as CE
    from megatron.core.tensor_parallel.utils import VocabUtility

    group = get_tensor_model_parallel_group()
    vocab_parallel_logits, logits_max = CE.calculate_logits_max(vocab_parallel_logits)
    # BUG: torch.distributed.all_reduce(logits_max, op=ReduceOp.MAX, group=group) left out: each rank
    # subtracts its own max, and the partial sums of exp(logit - max) no longer add up.
    size = vocab_parallel_logits.size()[-1]
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(size, get_tensor_model_parallel_rank(),
                                                                        group.size())
    target_mask, masked_target_1d, predicted, sum_exp, exp_logits = CE.calculate_predicted_logits(
        vocab_parallel_logits, target, logits_max, start, end)
    torch.distributed.all_reduce(predicted, group=group)
    torch.distributed.all_reduce(sum_exp, group=group)
    exp_logits, loss = CE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    ctx.label_smoothing, ctx.vocab_size = label_smoothing, exp_logits.size(-1)
    ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
    return loss


def embedding_without_output_mask(self, input_):
    """VocabParallelEmbedding.forward without zeroing the rows of tokens outside this rank's vocabulary."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
    masked_input = input_.clone() - self.vocab_start_index
    masked_input[input_mask] = 0
    output_parallel = F.embedding(masked_input, self.weight)
    # BUG: output_parallel[input_mask, :] = 0.0 left out: every rank adds the row of its local token 0
    return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


# ---------------------------------------------------------------------------
# Megatron-core's MoE GPTModel (SequentialMLP experts), experts over ep


def build_moe(mesh, ep: int = 2):
    """The MoE GPTModel at tp from the mesh and ep=2 (etp = tp when dp > 1: ep over dp's ranks; etp = 1
    when dp is 1: ep over tp's ranks), typed from its attributes; the allgather dispatcher.

    Megatron's aux loss balances each dp rank's own tokens, which one device (all tokens) cannot reproduce:
    it is off here (``moe_router_load_balancing_type="none"``), as is its router's input jitter.
    """
    from _megatron_moe_support import build_moe as build
    from _megatron_moe_support import forget_aux_losses, init_moe

    tp = mesh.size(mesh.mesh_dim_names.index("tp"))
    dp = mesh.size(mesh.mesh_dim_names.index("dp"))
    ep = ep if tp > 1 else 1
    etp = tp if dp > 1 else 1
    forget_aux_losses()
    init_moe(tp, ep, etp)
    spmd_megatron.register()
    model = build(tp, ep, etp, "allgather", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                  params_dtype=torch.get_default_dtype(), use_cpu_initialization=False)
    with spmd.set_current_mesh(spmd_megatron.mesh()):
        spmd_megatron.type_parameters(model)
    return model


def step_moe(model, batch: dict, mesh) -> torch.Tensor:
    """The dense step's gradient sync for the dense parameters; experts' gradients (each ep rank's experts got
    every dp rank's tokens through the exchange: a sum over dp ranks' losses) divided by dp, as Megatron's DDP does."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    with spmd.set_current_mesh(spmd_megatron.mesh()):
        per_token = model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"])
        loss = per_token.mean()
        loss.backward()
        for name, p in model.named_parameters():
            if ".local_experts." in name:
                p.grad = p.grad / dp
                continue
            grad = p.grad
            if spmd.get_type(grad).get("tp") is P:
                grad = spmd.all_reduce(grad, "tp", src=P, dst=R)
            p.grad = spmd.all_reduce(grad, "dp", src=P, dst=R, op="avg")
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        return spmd.all_reduce(loss.detach(), "dp", src=V, dst=I, op="avg")


def local_experts(over: str, ep: int = 2, experts: int = 4):
    """reference_names for SequentialMLP: ``local_experts.k`` on ep rank r is ``local_experts.{r*n+k}``
    (``over``: the mesh axis whose ranks ep runs over, see :func:`build_moe`)."""
    import re

    n = experts // ep

    def name(local: str, coords: dict[str, int]) -> str:
        r = coords[over]
        return re.sub(r"local_experts\.(\d+)", lambda m: f"local_experts.{r * n + int(m.group(1))}", local)

    return {"*.local_experts.*": name}


def router_max_over_tokens(original):
    """TopKRouter.gating with one line added: the logits stabilized by their max over the tokens (dim 0) instead
    of over the experts (dim -1). On one device the max is over every token; on the ranks over each rank's."""
    def gating(self, input):
        logits = original(self, input)
        return logits - logits.amax(dim=0, keepdim=True)  # BUG: dim=0 (tokens), not -1 (experts)

    return gating
