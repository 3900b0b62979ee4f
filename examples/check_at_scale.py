"""Typecheck a Llama-70B-shaped training step at dp=8 x tp=8 on one CPU, in seconds.

Run: python examples/check_at_scale.py                 (80 layers, d_model 8192, dp=8, tp=8)
     python examples/check_at_scale.py --bug-at 17     (layer 17 forgets Megatron's copy_to_region)
     python examples/check_at_scale.py --layers 32 --d-model 4096 --ffn 14336   (8B-shaped)

The model is built on the meta device (shapes, no storage) inside
``spmd_types.testing.simulate``: a fake process group of 64 ranks, so every
collective returns a tensor of the right shape and moves nothing. Forward and
backward run op by op through the typechecker; a type error anywhere in the
80 layers stops the step at its source line.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import simulate

R, I, V, P = spmd.R, spmd.I, spmd.V, spmd.P


@dataclass(frozen=True)
class Config:
    layers: int = 80
    d_model: int = 8192
    ffn: int = 28672
    heads: int = 64
    kv_heads: int = 8
    seq: int = 4096
    micro_batch: int = 1
    dp: int = 8
    tp: int = 8
    bug_at: int = -1  # this layer forgets the I -> R conversion of its input


LLAMA_8B = Config(layers=32, d_model=4096, ffn=14336, heads=32, kv_heads=8)
LLAMA_70B = Config()


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight


class Block(nn.Module):
    """One Llama block, Megatron tensor-parallel: column-parallel in, row-parallel out."""

    def __init__(self, c: Config, index: int) -> None:
        super().__init__()
        self.c, self.index = c, index
        head_dim = c.d_model // c.heads
        self.q_local, self.kv_local = c.heads // c.tp, c.kv_heads // c.tp
        self.head_dim = head_dim
        self.norm1 = nn.Parameter(torch.ones(c.d_model))
        self.wqkv = nn.Parameter(torch.empty((self.q_local + 2 * self.kv_local) * head_dim, c.d_model))
        self.wo = nn.Parameter(torch.empty(c.d_model, self.q_local * head_dim))
        self.norm2 = nn.Parameter(torch.ones(c.d_model))
        self.w13 = nn.Parameter(torch.empty(2 * c.ffn // c.tp, c.d_model))
        self.w2 = nn.Parameter(torch.empty(c.d_model, c.ffn // c.tp))

    def type_parameters(self) -> None:
        for w in (self.wqkv, self.wo, self.w13, self.w2):
            spmd.assert_type(w, {"dp": R, "tp": V})  # each tp rank holds its slice
        for w in (self.norm1, self.norm2):
            spmd.assert_type(w, {"dp": R, "tp": I})  # replicated, gradient already summed on tp

    def column_in(self, h: torch.Tensor) -> torch.Tensor:
        if self.index == self.c.bug_at:
            return h
        return spmd.convert(h, "tp", src=I, dst=R, backward_options={"op_dtype": h.dtype})  # copy_to region, bf16 grad sum

    def row_out(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        partial = spmd.reinterpret(F.linear(h, w), "tp", src=V, dst=P)
        return spmd.all_reduce(partial, "tp", src=P, dst=I)  # reduce_from_tensor_model_parallel_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.column_in(rms_norm(x, self.norm1))
        qkv = F.linear(h, self.wqkv).view(b, s, self.q_local + 2 * self.kv_local, self.head_dim)
        q, k, v = qkv.split([self.q_local, self.kv_local, self.kv_local], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        group = self.q_local // self.kv_local
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.row_out(attn, self.wo)
        h = self.column_in(rms_norm(x, self.norm2))
        gate, up = F.linear(h, self.w13).chunk(2, dim=-1)
        return x + self.row_out(F.silu(gate) * up, self.w2)


class Stack(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.layers))

    def type_parameters(self) -> None:
        for block in self.blocks:
            block.type_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def train_step(model: Stack, c: Config, typed: bool) -> torch.Tensor:
    """One forward and backward; typed inside ``typecheck()``, erased (plain PyTorch) otherwise."""
    x = torch.empty(c.micro_batch, c.seq, c.d_model, dtype=torch.bfloat16)
    if typed:
        with spmd.typecheck():
            x = spmd.assert_type(x, {"dp": V, "tp": I})  # each dp rank its own batch
            loss = model(x).float().pow(2).mean()
    else:
        loss = model(x).float().pow(2).mean()
    loss.backward()
    return loss


def build(c: Config, typed: bool) -> Stack:
    model = Stack(c).to(torch.bfloat16)
    if typed:
        with spmd.typecheck():
            model.type_parameters()
    return model


def check(c: Config) -> float:
    """Build and run one typed step of ``c`` on the meta device; returns its wall time in seconds."""
    start = time.perf_counter()
    with simulate((c.dp, c.tp), ("dp", "tp"), ranks="fake", device="meta"):
        model = build(c, typed=True)
        loss = train_step(model, c, typed=True)
        assert spmd.get_type(model.blocks[0].wqkv.grad) == {"dp": P, "tp": V}, "grad types"
        assert loss.device.type == "meta"
    return time.perf_counter() - start


def main() -> None:
    from rich.console import Console

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=LLAMA_70B.layers)
    parser.add_argument("--d-model", type=int, default=LLAMA_70B.d_model)
    parser.add_argument("--ffn", type=int, default=LLAMA_70B.ffn)
    parser.add_argument("--dp", type=int, default=LLAMA_70B.dp)
    parser.add_argument("--tp", type=int, default=LLAMA_70B.tp)
    parser.add_argument("--bug-at", type=int, default=-1)
    args = parser.parse_args()
    c = Config(layers=args.layers, d_model=args.d_model, ffn=args.ffn, dp=args.dp, tp=args.tp, bug_at=args.bug_at)
    console = Console(soft_wrap=True)
    params = c.layers * (2 * c.d_model**2 * (1 + c.kv_heads / c.heads) + 3 * c.d_model * c.ffn)
    console.print(f"{c.layers} layers, d_model {c.d_model}, ffn {c.ffn}: ~{params / 1e9:.0f}B parameters, "
                  f"dp={c.dp} x tp={c.tp} = {c.dp * c.tp} ranks, on the meta device")
    try:
        with console.status("typechecking forward and backward..."):
            seconds = check(c)
    except spmd.SpmdTypeError as err:
        print(f"SpmdTypeError: {err.plain}")
        raise SystemExit(1) from None
    console.print(f"typechecked: one training step, forward and backward, in {seconds:.2f} s")


if __name__ == "__main__":
    main()
