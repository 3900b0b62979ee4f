"""A typed training step on simulated ranks (LocalTensorMode) against the same step untyped.

Run: python benchmarks/simulated.py [--repeat N] [--blocks B]

Four Megatron-style transformer blocks (tensor-parallel attention and MLP)
on a (dp=2, tp=2) mesh of simulated ranks: forward, backward from the loss,
the data-parallel gradient all-reduce and an SGD step. "untyped" is the same
code outside ``spmd.typecheck()`` (the typed calls erased); "typed" checks
every op. Runs alternate (untyped, typed, untyped, ...) so that a noisy,
shared machine slows both alike; the table shows medians and their ratio.

The last rows time an optimizer step alone on plain tensors (no simulation):
64 parameters, foreach AdamW and for-loop SGD, typed against untyped. A
typed foreach step checks each kernel's element types once (cached by the
element types), so it costs one key build per kernel call, not a rule
inference per parameter.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd
from spmd_types import I, P, R, V
from spmd_types.testing import random_value

B, S, H, HEADS, TP = 2, 16, 64, 4, 2


def make_params(mesh, blocks: int) -> list[dict[str, torch.Tensor]]:
    """Per block: norms replicated (I on tp), attention and MLP weights sharded on tp (V)."""
    hl, fl = H // TP, 4 * H // TP
    shapes = {"ln1": ((H,), I), "qkv": ((3 * hl, H), V), "o": ((H, hl), V),
              "ln2": ((H,), I), "w1": ((fl, H), V), "b1": ((fl,), V), "w2": ((H, fl), V)}
    params = []
    for b in range(blocks):
        block = {}
        for i, (name, (shape, tp)) in enumerate(shapes.items()):
            value = random_value(mesh, {"dp": R, "tp": tp if tp is V else R}, shape, seed=100 * b + i) * 0.1
            block[name] = torch.nn.Parameter(value)
            block[name]._spmd_tp = tp
        params.append(block)
    return params


def type_params(params) -> None:
    for block in params:
        for p in block.values():
            spmd.assert_type(p, {"dp": R, "tp": p._spmd_tp})


def block_forward(x, p):
    """One pre-norm transformer block, Megatron-style: x is V on dp, I on tp."""
    h = F.layer_norm(x, (H,), p["ln1"])
    h = spmd.reinterpret(h, "tp", src=I, dst=R)  # backward: all-reduce of the input gradient
    qkv = F.linear(h, p["qkv"]).view(B, S, 3, HEADS // TP, H // HEADS)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = F.linear(a.transpose(1, 2).reshape(B, S, H // TP), p["o"])
    x = x + spmd.all_reduce(a, "tp", src=V, dst=I)
    h = spmd.reinterpret(F.layer_norm(x, (H,), p["ln2"]), "tp", src=I, dst=R)
    u = F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"])
    return x + spmd.all_reduce(u, "tp", src=V, dst=I)


def train_step(x, params, opt) -> None:
    h = x
    for p in params:
        h = block_forward(h, p)
    loss = spmd.all_reduce(h.square().mean(), "dp", src=V, dst=I)
    loss.backward()
    for block in params:
        for p in block.values():
            p.grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R)
    opt.step()
    opt.zero_grad()


def optimizer_rows(mesh, n: int = 64) -> dict:
    """An optimizer step on ``n`` (64, 64) parameters with gradients, typed and untyped."""
    types = {"dp": R, "tp": V}
    plain = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(n)]
    typed = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(n)]
    with spmd.typecheck():
        for p, q in zip(plain, typed):
            p.grad = torch.randn(64, 64)
            spmd.assert_type(q, types)
            q.grad = spmd.assert_type(torch.randn(64, 64), types)
    rows = {}
    for name, make in (("AdamW foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
                       ("SGD for-loop", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=False))):
        plain_opt, typed_opt = make(plain), make(typed)
        rows[f"step: {name}"] = (plain_opt.step, typed_opt.step)
    return rows


def _timed(fn, checking: bool) -> float:
    ctx = spmd.typecheck() if checking else contextlib.nullcontext()
    with ctx:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2 * TP, store=FakeStore())
    mesh = init_device_mesh("cpu", (2, TP), mesh_dim_names=("dp", "tp"))
    with LocalTensorMode(2 * TP), spmd.set_current_mesh(mesh):
        x_plain = random_value(mesh, {"dp": V, "tp": R}, (B, S, H), seed=7)
        plain_params = make_params(mesh, args.blocks)
        typed_params = make_params(mesh, args.blocks)
        with spmd.typecheck():
            type_params(typed_params)
            x_typed = spmd.assert_type(x_plain, {"dp": V, "tp": I})
        plain_opt = torch.optim.SGD([p for b in plain_params for p in b.values()], lr=1e-3, foreach=True)
        typed_opt = torch.optim.SGD([p for b in typed_params for p in b.values()], lr=1e-3, foreach=True)
        rows = {
            "training step": (lambda: train_step(x_plain, plain_params, plain_opt),
                              lambda: train_step(x_typed, typed_params, typed_opt)),
            "forward only": (lambda: [block_forward(x_plain, p) for p in plain_params],
                             lambda: [block_forward(x_typed, p) for p in typed_params]),
        }
        print(f"{args.blocks} transformer blocks (B={B}, S={S}, H={H}), dp=2 x tp={TP} simulated ranks, "
              f"median of {args.repeat} alternating runs; torch {torch.__version__}")
        print(f"{'':<22}{'untyped ms':>12}{'typed ms':>12}{'typed/untyped':>15}")
        _table(rows, args.repeat)
    with spmd.set_current_mesh(mesh):
        _table(optimizer_rows(mesh), args.repeat * 4)


def _table(rows: dict, repeat: int) -> None:
    for name, (untyped, typed) in rows.items():
        _timed(untyped, False), _timed(typed, True)  # warm caches
        u_times, t_times = [], []
        for _ in range(repeat):
            u_times.append(_timed(untyped, False))
            t_times.append(_timed(typed, True))
        u, t = statistics.median(u_times) * 1e3, statistics.median(t_times) * 1e3
        print(f"{name:<22}{u:>12.1f}{t:>12.1f}{t / u:>15.2f}")


if __name__ == "__main__":
    main()
