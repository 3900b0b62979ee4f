"""A small GPT trained with tensor, sequence and data parallelism, written with spmd calls, on real processes.

Run: torchrun --nproc-per-node 4 examples/megatron_tp_sp_dp.py      (dp=2 x tp=2, gloo backend, CPU)

Megatron-style: column-parallel QKV and MLP-in, row-parallel out, activations
sharded on the sequence dim between layers (sequence parallelism: all-gather
before a column-parallel matmul, reduce-scatter after a row-parallel one), the
batch split over dp, gradients all-reduced over dp after backward. Three SGD
steps run typed (inside spmd.typecheck()), then three from the same start
erased (plain PyTorch); rank 0 checks every loss against one device running
the whole batch with the whole weights, and prints them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import spmd_types as spmd

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
VOCAB, D, HEADS, FFN, LAYERS, SEQ, BATCH, STEPS, LR = 64, 32, 4, 64, 2, 8, 4, 3, 0.5


def full_weights() -> dict[str, torch.Tensor]:
    """The single-device weights, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(0)
    w = {"wte": torch.randn(VOCAB, D, generator=g) * 0.5, "wpe": torch.randn(SEQ, D, generator=g) * 0.1,
         "lnf": torch.ones(D), "head": torch.randn(VOCAB, D, generator=g) / D**0.5}
    for i in range(LAYERS):
        w[f"{i}.ln1"], w[f"{i}.ln2"] = torch.ones(D), torch.ones(D)
        w[f"{i}.qkv"] = torch.randn(3 * D, D, generator=g) / D**0.5
        w[f"{i}.o"] = torch.randn(D, D, generator=g) / D**0.5
        w[f"{i}.fc1"] = torch.randn(FFN, D, generator=g) / D**0.5
        w[f"{i}.fc2"] = torch.randn(D, FFN, generator=g) / FFN**0.5
    return w


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    return [(b[:, :-1], b[:, 1:]) for b in data]


def shard(w: dict[str, torch.Tensor], t: int, tp: int) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank t's slices: QKV and fc1 by output rows (heads), o and fc2 by input columns."""
    out = dict(w)
    hd, hl, fl = D // HEADS, HEADS // tp, FFN // tp
    for i in range(LAYERS):
        out[f"{i}.qkv"] = w[f"{i}.qkv"].view(3, HEADS, hd, D)[:, t * hl : (t + 1) * hl].reshape(-1, D)
        out[f"{i}.o"] = w[f"{i}.o"][:, t * hl * hd : (t + 1) * hl * hd]
        out[f"{i}.fc1"] = w[f"{i}.fc1"][t * fl : (t + 1) * fl]
        out[f"{i}.fc2"] = w[f"{i}.fc2"][:, t * fl : (t + 1) * fl]
    return {k: v.clone().requires_grad_() for k, v in out.items()}


def _tp_sharded(name: str) -> bool:
    return name.split(".")[-1] in ("qkv", "o", "fc1", "fc2")


def type_parameters(w: dict[str, torch.Tensor]) -> None:
    for name, p in w.items():
        spmd.assert_type(p, {"dp": R, "tp": V if _tp_sharded(name) else I})


def layer_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The weight is I on tp (its gradient is summed over the sequence shards): R at its use.
    return F.layer_norm(x, (D,), spmd.convert(weight, "tp", src=I, dst=R))


def attention(h: torch.Tensor, qkv_w: torch.Tensor) -> torch.Tensor:
    b, s, _ = h.shape
    q, k, v = F.linear(h, qkv_w).view(b, s, 3, -1, D // HEADS).unbind(2)  # this rank's heads
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


def forward(w: dict[str, torch.Tensor], ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss over the whole global batch: I on every axis."""
    x = F.embedding(ids, spmd.convert(w["wte"], "tp", src=I, dst=R)) + spmd.convert(w["wpe"], "tp", src=I, dst=R)
    x = spmd.convert(x, "tp", src=R, dst=S(1))  # scatter_to_sequence_parallel_region: keep my positions
    for i in range(LAYERS):
        h = spmd.all_gather(layer_norm(x, w[f"{i}.ln1"]), "tp", src=S(1), dst=R)  # gather_from_sp_region
        x = x + spmd.reduce_scatter(F.linear(attention(h, w[f"{i}.qkv"]), w[f"{i}.o"]), "tp", src=V, dst=S(1))
        h = spmd.all_gather(layer_norm(x, w[f"{i}.ln2"]), "tp", src=S(1), dst=R)
        x = x + spmd.reduce_scatter(F.linear(F.gelu(F.linear(h, w[f"{i}.fc1"])), w[f"{i}.fc2"]), "tp", src=V, dst=S(1))
    logits = F.linear(layer_norm(x, w["lnf"]), spmd.convert(w["head"], "tp", src=I, dst=R))
    mine = spmd.convert(targets, "tp", src=I, dst=S(1))  # the targets of my positions
    total = F.cross_entropy(logits.flatten(0, 1), mine.flatten(), reduction="sum")
    total = spmd.all_reduce(spmd.all_reduce(total, "tp", src=V, dst=I), "dp", src=V, dst=I)
    return total / (BATCH * SEQ)


def sgd_step(w: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for p in w.values():
            grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R)  # data parallel: sum the ranks' shares
            p.sub_(LR * grad)
            p.grad = None


def train(mesh, typed: bool) -> list[float]:
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    dp, tp = mesh.size(0), mesh.size(1)
    w = shard(full_weights(), tp_rank, tp)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)  # my share of the batch
    losses = []
    from rich.progress import track

    steps = track(batches(), description=f"{'typed' if typed else 'erased'} steps", total=STEPS,
                  disable=dist.get_rank() != 0, transient=True)
    with spmd.set_current_mesh(mesh):
        for ids, targets in steps:
            if typed:
                with spmd.typecheck():
                    type_parameters(w)
                    ids_t = spmd.assert_type(ids[rows], {"dp": V, "tp": I})
                    targets_t = spmd.assert_type(targets[rows], {"dp": V, "tp": I})
                    loss = forward(w, ids_t, targets_t)
                    loss.backward()
                    sgd_step(w)
            else:
                loss = forward(w, ids[rows], targets[rows])
                loss.backward()
                sgd_step(w)
            losses.append(float(loss.detach()))
    return losses


def reference() -> list[float]:
    """One device, the whole batch, the whole weights: the same model in plain PyTorch."""
    w = {k: v.clone().requires_grad_() for k, v in full_weights().items()}
    losses = []
    for ids, targets in batches():
        x = F.embedding(ids, w["wte"]) + w["wpe"]
        for i in range(LAYERS):
            x = x + F.linear(attention(F.layer_norm(x, (D,), w[f"{i}.ln1"]), w[f"{i}.qkv"]), w[f"{i}.o"])
            h = F.layer_norm(x, (D,), w[f"{i}.ln2"])
            x = x + F.linear(F.gelu(F.linear(h, w[f"{i}.fc1"])), w[f"{i}.fc2"])
        logits = F.linear(F.layer_norm(x, (D,), w["lnf"]), w["head"])
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        with torch.no_grad():
            for p in w.values():
                p.sub_(LR * p.grad)
                p.grad = None
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    tp = int(os.environ.get("TP", "2"))
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    typed, erased = train(mesh, typed=True), train(mesh, typed=False)
    if dist.get_rank() == 0:
        from rich.console import Console
        from rich.table import Table

        want = reference()
        table = Table(title=f"loss, dp={world // tp} x tp={tp} (sequence parallel) vs one device")
        for col in ("step", "typed", "erased", "one device"):
            table.add_column(col, justify="right")
        for step, row in enumerate(zip(typed, erased, want)):
            table.add_row(str(step), *(f"{v:.10f}" for v in row))
        Console(width=100).print(table)
        torch.testing.assert_close(torch.tensor(typed), torch.tensor(want), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(torch.tensor(erased), torch.tensor(want), rtol=1e-9, atol=1e-9)
        print("losses match the single-device run, typed and erased")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
