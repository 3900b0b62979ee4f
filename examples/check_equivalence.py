"""A 2-layer Megatron-style GPT, one planted bug the types cannot see, and the check that finds it.

Run: python examples/check_equivalence.py [--bug NAME] [--sp] [--dtype float32]

The model is written the Megatron way with spmd calls: a vocab-parallel embedding, column-parallel
QKV and MLP-in, row-parallel projections, a vocab-parallel cross entropy, optionally sequence
parallel, data parallel over ``dp``. Every planted bug is one realistic line that is well typed:
``spmd.typecheck()`` accepts it, and it trains wrong. ``check_equivalence`` runs the training step
on 2 x 2 simulated ranks and on one device, lines up every module output, the loss, the gradients
and the updated weights by their types, and prints the table with the first divergence and its
source line. With ``--bug none`` the report is ok.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import check_equivalence

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
VOCAB, HEADS, LAYERS, SEQ, BATCH, LR = 64, 4, 2, 8, 4, 0.1
BUGS = {
    "none": "the correct model",
    "ce-local-max": "vocab-parallel cross entropy subtracts this rank's max, not the global max",
    "embedding-mask": "the vocab-parallel embedding keeps the rows of tokens another rank owns",
    "bias-before-reduce": "the row-parallel bias joins each rank's partial sum, so the all-reduce adds it tp times",
    "sp-position-offset": "under sequence parallelism, positions counted from this rank's chunk, not the sequence",
    "loss-not-averaged": "the reported loss is summed over dp instead of averaged",
    "grads-averaged-twice": "the gradients are averaged over dp, then divided by dp again",
}


def _param(*shape: int, scale: float, types: dict) -> nn.Parameter:
    return spmd.assert_type(nn.Parameter(torch.randn(*shape) * scale), types)


def _to_tp_region(x: torch.Tensor, sp: bool) -> torch.Tensor:
    """Megatron's copy_to (I -> R) or, under sequence parallelism, gather_from_sequence_parallel (S(1) -> R)."""
    return spmd.all_gather(x, "tp", src=S(1), dst=R) if sp else spmd.convert(x, "tp", src=I, dst=R)


def _from_tp_region(x: torch.Tensor, sp: bool) -> torch.Tensor:
    """Megatron's reduce_from (sum -> I) or reduce_scatter_to_sequence_parallel (sum -> S(1))."""
    return spmd.reduce_scatter(x, "tp", src=V, dst=S(1)) if sp else spmd.all_reduce(x, "tp", src=V, dst=I)


class VocabEmbedding(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.bug, self.rows = cfg["bug"], VOCAB // cfg["tp"]
        self.weight = _param(self.rows, cfg["hidden"], scale=0.5, types={"dp": R, "tp": S(0)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = spmd.axis_index("tp") * self.rows
        outside = (ids < start) | (ids >= start + self.rows)
        out = F.embedding((ids - start).masked_fill(outside, 0), self.weight)
        if self.bug != "embedding-mask":
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return spmd.all_reduce(out, "tp", src=V, dst=I)


class Embedding(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.sp, self.bug = cfg["sp"], cfg["bug"]
        self.word = VocabEmbedding(cfg)
        self.pos = _param(SEQ, cfg["hidden"], scale=0.1, types={"dp": R, "tp": I})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.word(ids)
        if not self.sp:
            return x + self.pos
        x = spmd.convert(x, "tp", src=I, dst=S(1))  # scatter_to_sequence_parallel_region: my chunk
        s = x.shape[1]
        positions = spmd.axis_index("tp") * s + torch.arange(s)
        if self.bug == "sp-position-offset":
            positions = torch.arange(s)
        return x + F.embedding(positions, spmd.convert(self.pos, "tp", src=I, dst=R))


class LayerNorm(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.sp = cfg["sp"]
        self.weight = _param(cfg["hidden"], scale=0.1, types={"dp": R, "tp": I})
        self.bias = _param(cfg["hidden"], scale=0.1, types={"dp": R, "tp": I})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = (self.weight + 1, self.bias)
        if self.sp:  # each rank normalizes its own positions: the weights are used as R there
            w, b = spmd.convert(w, "tp", src=I, dst=R), spmd.convert(b, "tp", src=I, dst=R)
        return F.layer_norm(x, (x.shape[-1],), w, b)


class Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, tp = cfg["hidden"], cfg["tp"]
        self.sp, self.heads = cfg["sp"], HEADS // tp
        # column-parallel, Megatron's fused layout: per head [q; k; v], this rank's heads
        self.qkv = _param(3 * h // tp, h, scale=h**-0.5, types={"dp": R, "tp": S(0)})
        self.qkv_bias = _param(3 * h // tp, scale=0.1, types={"dp": R, "tp": S(0)})
        self.proj = _param(h, h // tp, scale=h**-0.5, types={"dp": R, "tp": S(1)})  # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _to_tp_region(x, self.sp)
        b, s, _ = h.shape
        qkv = F.linear(h, self.qkv, self.qkv_bias).view(b, s, self.heads, 3, -1)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return _from_tp_region(F.linear(out, self.proj), self.sp)


class MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, ffn = cfg["hidden"], 4 * cfg["hidden"] // cfg["tp"]
        self.sp, self.bug = cfg["sp"], cfg["bug"]
        self.fc1 = _param(ffn, h, scale=h**-0.5, types={"dp": R, "tp": S(0)})
        self.fc2 = _param(h, ffn, scale=ffn**-0.5, types={"dp": R, "tp": S(1)})
        self.bias = _param(h, scale=0.1, types={"dp": R, "tp": I})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(F.gelu(F.linear(_to_tp_region(x, self.sp), self.fc1)), self.fc2)  # a partial sum
        if self.bug == "bias-before-reduce":
            return _from_tp_region(out + spmd.convert(self.bias, "tp", src=I, dst=R), self.sp)
        bias = spmd.convert(self.bias, "tp", src=I, dst=R) if self.sp else self.bias
        return _from_tp_region(out, self.sp) + bias


class Block(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.norm1, self.attention, self.norm2, self.mlp = LayerNorm(cfg), Attention(cfg), LayerNorm(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VocabParallelCrossEntropy(nn.Module):
    """Megatron's loss on vocab-sharded logits: per-token losses, the same on every tp rank."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.bug, self.rows = cfg["bug"], VOCAB // cfg["tp"]

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        top = logits.detach().amax(-1, keepdim=True)
        if self.bug != "ce-local-max":
            top = spmd.all_reduce(top, "tp", src=V, dst=R, op="max")
        shifted = logits - top
        total = spmd.all_reduce(shifted.exp().sum(-1), "tp", src=V, dst=I)
        start = spmd.axis_index("tp") * self.rows
        outside = (targets < start) | (targets >= start + self.rows)
        mine = shifted.gather(-1, (targets - start).masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
        target_logit = spmd.all_reduce(mine.masked_fill(outside, 0.0), "tp", src=V, dst=I)
        return total.log() - target_logit


class GPT(nn.Module):
    def __init__(self, tp: int, sp: bool = False, hidden: int = 32, bug: str = "none") -> None:
        super().__init__()
        cfg = {"tp": tp, "sp": sp, "hidden": hidden, "bug": bug}
        self.sp = sp
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(LAYERS))
        self.norm = LayerNorm(cfg)
        self.head = _param(VOCAB // tp, hidden, scale=hidden**-0.5, types={"dp": R, "tp": S(0)})
        self.cross_entropy = VocabParallelCrossEntropy(cfg)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(_to_tp_region(self.norm(x), self.sp), self.head)  # vocab-sharded
        return self.cross_entropy(logits, targets)


def train_step(model: GPT, batch: dict, mesh, bug: str = "none") -> torch.Tensor:
    """Forward, backward, gradient sync over dp, one SGD step; returns the loss averaged over dp."""
    loss = model(batch["ids"], batch["targets"]).mean()  # this dp rank's micro-batch
    loss.backward()
    for p in model.parameters():
        p.grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R, op="avg")
        if bug == "grads-averaged-twice":
            p.grad /= mesh.size(0)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return spmd.all_reduce(loss.detach(), "dp", src=V, dst=I, op="sum" if bug == "loss-not-averaged" else "avg")


def make_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    split = {"dp": S(0), "tp": I}  # a micro-batch per dp rank; every tp rank sees all of it
    return {"ids": (data[:, :-1], split), "targets": (data[:, 1:], split)}


def check(bug: str = "none", sp: bool = False, hidden: int = 32, dtype: torch.dtype = torch.float64):
    """One check_equivalence of the GPT with ``bug`` planted, on dp=2 x tp=2 simulated ranks."""
    return check_equivalence(
        lambda mesh: GPT(mesh.size(1), sp, hidden, bug),
        lambda model, batch, mesh: train_step(model, batch, mesh, bug),
        make_batch(),
        mesh_shape=(2, 2), names=("dp", "tp"),
        output_dims={"*": {"dp": 0}},  # activations are [batch, sequence, ...]: dp splits the batch
        dtype=dtype,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", choices=sorted(BUGS), default="ce-local-max")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    args = parser.parse_args()
    print(f"planted bug: {args.bug} ({BUGS[args.bug]})")
    print(check(args.bug, args.sp, dtype=getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
