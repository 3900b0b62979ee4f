"""FSDP / ZeRO-3 with types: weights stored sharded, gathered to R for use, gradients reduce-scattered by the backward.

Run: python examples/fsdp_reduced.py       (4 simulated data-parallel ranks in this process)

Each rank stores rows [k*r, k*(r+1)) of every weight: S(0) on dp. Before use a
weight is all-gathered to R (the same on every rank). The gradient of an R value
is P, so the backward of that all-gather is a reduce-scatter: each rank gets its
own rows of the summed gradient, ready for its optimizer step on its shard. No
gradient all-reduce is written anywhere. The communication is counted per step
and the losses are checked against one device running the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import CommCounter, denote, per_rank, simulate

DP, D, HIDDEN, BATCH, STEPS, LR = 4, 8, 16, 12, 3, 0.1


def full_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(HIDDEN, D, generator=g) / D**0.5, torch.randn(D, HIDDEN, generator=g) / HIDDEN**0.5]


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)) for _ in range(STEPS)]


def loss_fn(weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, w2 = weights
    return (F.linear(F.gelu(F.linear(x, w1)), w2) - y).pow(2).sum() / BATCH


def reference() -> list[float]:
    ws = [w.clone().requires_grad_() for w in full_weights()]
    losses = []
    for x, y in data():
        loss = loss_fn(ws, x, y)
        loss.backward()
        with torch.no_grad():
            for w in ws:
                w.sub_(LR * w.grad)
                w.grad = None
        losses.append(float(loss.detach()))
    return losses


def train() -> tuple[list[float], list[dict[str, int]]]:
    per = BATCH // DP
    losses, comms_per_step = [], []
    weights0, batches = full_weights(), data()  # single-device values, made outside the simulation
    with simulate((DP,), ("dp",), ranks="local", device="cpu") as mesh:
        shards = []  # the model, built inside it: one shard per rank
        for w in weights0:
            rows = w.shape[0] // DP
            shards.append(torch.nn.Parameter(per_rank(lambda r, w=w, rows=rows: w[r * rows : (r + 1) * rows].clone())))
        for x, y in batches:
            with spmd.typecheck(), CommCounter() as comms:
                for s in shards:
                    spmd.assert_type(s, {"dp": spmd.S(0)})  # this rank's rows
                weights = [spmd.all_gather(s, "dp", src=spmd.S(0), dst=spmd.R) for s in shards]  # unshard
                xs = spmd.assert_type(per_rank(lambda r, x=x: x[r * per : (r + 1) * per].clone()), {"dp": spmd.V})
                ys = spmd.assert_type(per_rank(lambda r, y=y: y[r * per : (r + 1) * per].clone()), {"dp": spmd.V})
                local = loss_fn(weights, xs, ys)  # V: each rank's share of the loss
                loss = spmd.all_reduce(local, "dp", src=spmd.V, dst=spmd.I)  # the whole batch's loss
                losses.append(denote(loss.detach(), mesh, {"dp": spmd.I}))  # checked equal on every rank
                loss.backward()
                with torch.no_grad():
                    for s in shards:
                        assert spmd.get_type(s.grad) == {"dp": spmd.S(0)}  # my rows, already summed
                        s.sub_(LR * s.grad)
                        s.grad = None
            comms_per_step.append(comms.counts)
    return [float(v) for v in losses], comms_per_step


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    losses, comms = train()
    want = reference()
    table = Table(title=f"FSDP on {DP} simulated ranks: loss and communication per step")
    for col in ("step", "loss", "one device", "collectives (forward + backward)"):
        table.add_column(col)
    for step, (got, ref, counts) in enumerate(zip(losses, want, comms)):
        table.add_row(str(step), f"{got:.6f}", f"{ref:.6f}", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    Console(width=110).print(table)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    assert all(c == {"all_gather": 2, "all_reduce": 1, "reduce_scatter": 2} for c in comms), comms
    print("per step: 2 all-gathers (forward), 2 reduce-scatters (their backward), 1 all-reduce of the loss; "
          "losses match one device")


if __name__ == "__main__":
    main()
