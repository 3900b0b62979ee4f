"""A small Llama-style model (2 blocks) and the ways the DTensor tests parallelize it.

* :func:`apply_tp`: tensor + sequence parallel the way torchtitan users write it
  (``parallelize_module`` with ``RowwiseParallel`` embeddings, ``SequenceParallel``
  norms, ``PrepareModuleInput`` before attention and the MLP, ``ColwiseParallel``
  q/k/v/w1/w3, ``RowwiseParallel`` wo/w2 back to sequence shards, a
  ``ColwiseParallel`` output that gathers the logits).
* :func:`apply_fsdp`: ``fully_shard`` per block, then the root (needs real
  storage: gloo, or a fake process group).
* :func:`apply_reduced_gather`: FSDP's weight gather written with the typed
  collective: every parameter is ``Shard(0)`` on dp and a parametrization
  gathers it with ``spmd.all_gather(w, "dp", src=S(0), dst=R)``, so the weight
  the forward uses is ``Reduced()`` and its gradient comes back by one
  reduce-scatter (runs on simulated ranks, where ``fully_shard`` cannot).

The attention core runs in ``spmd.local_map`` (what a user with a custom
kernel writes): heads sharded on tp (``S(2)``) or the batch on dp (``S(0)``).
On plain tensors and outside ``typecheck()`` it is just the function.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_types as spmd

DIM, HEADS, FFN, VOCAB, BLOCKS = 16, 4, 32, 32, 2
BATCH, SEQ = 4, 8


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


_CORES = {
    "tp": spmd.local_map(_sdpa, in_types=[{"tp": spmd.S(2)}] * 3, out_types={"tp": spmd.S(2)}),
    "dp": spmd.local_map(_sdpa, in_types=[{"dp": spmd.S(0)}] * 3, out_types={"dp": spmd.S(0)}),
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.core = "tp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS) for w in (self.wq, self.wk, self.wv))
        return self.wo(_CORES[self.core](q, k, v).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.boundary: dict | None = None  # types asserted on the block's DTensor input and output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.boundary is not None:
            x = spmd.assert_type(x, self.boundary)  # a plain local x (torchtitan's plan) comes back typed
        h = x + self.attention(self.attention_norm(x))
        out = h + self.feed_forward(self.ffn_norm(h))
        if self.boundary is not None:
            out = spmd.assert_type(out, self.boundary)
        return out


class Llama(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(BLOCKS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)  # norms away from 1, so their gradients are tested

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def reference(model: Llama, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Loss and every parameter's gradient on one device."""
    model.zero_grad()
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def apply_tp(model: Llama, tp_mesh, local_output: bool = False) -> Llama:
    """Tensor + sequence parallelism on ``tp_mesh`` (1-D), as torchtitan users write the plan.

    ``local_output=True`` is torchtitan's own plan (0.2.2's Llama3): the parallel styles keep their default
    ``use_local_output=True``, so the attention and MLP bodies and the residual stream between blocks are plain
    local tensors (``RowwiseParallel``'s output an ``AsyncCollectiveTensor``); the block boundaries and the
    attention core's ``local_map`` type them, and each ``DTensor.from_local`` checks those types.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    dt = {} if local_output else {"use_local_output": False}  # torchtitan's plan: the styles' defaults
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), **dt),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(**dt),
            "attention.wk": ColwiseParallel(**dt),
            "attention.wv": ColwiseParallel(**dt),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1), **dt),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(**dt),
            "feed_forward.w3": ColwiseParallel(**dt),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), **dt),
        })
        block.attention.core = "tp"
        block.boundary = {"tp": spmd.S(1)}  # sequence parallel between blocks
    return model


def apply_fsdp(model: Llama, dp_mesh, reshard_after_forward: bool = False) -> Llama:
    """``fully_shard`` each block, then the root, on ``dp_mesh``.

    ``reshard_after_forward=False`` keeps the gathered weights until backward,
    so backward only reduce-scatters (True re-gathers each block's weights).
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


class _GatherReduced(nn.Module):
    """A parametrization: the dp-sharded parameter, all-gathered to ``Reduced()`` for the forward."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return spmd.all_gather(w, "dp", src=spmd.S(0), dst=spmd.R)


def apply_reduced_gather(model: Llama, dp_mesh) -> Llama:
    """FSDP-style on ``dp_mesh`` with the typed gather: parameters ``Shard(0)``, used as ``Reduced()``."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.utils import parametrize

    for mod in list(model.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), dp_mesh, [Shard(0)])))
            parametrize.register_parametrization(mod, name, _GatherReduced())
    for block in model.layers.values():
        block.attention.core = "dp"
        block.boundary = {"dp": spmd.S(0)}  # the batch is sharded on dp
    return model


def sharded_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name as in the unparallelized model: parameter}`` (a parametrization's original is the parameter)."""
    out = {}
    for name, p in model.named_parameters():
        out[name.replace("parametrizations.", "").replace(".original", "")] = p
    return out
