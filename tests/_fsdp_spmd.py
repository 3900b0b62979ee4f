"""torch 2.14's FSDP2 on spmd-typed parameters (``fully_shard(..., dp_mesh_dims=...)``): the model and the gloo worker.

A two-layer tensor-parallel MLP (column-parallel ``w1`` typed ``S(0)`` on tp,
row-parallel ``w2`` typed ``S(1)``) is typed outside ``typecheck()``, as
torchtitan types its parameters at parallelize time, then handed to torch's own
``fully_shard`` with ``dp_mesh_dims``: torch reads the types (``get_local_type``,
``get_partition_spec``, ``partition_spec_to_shard_types``, ``MeshAxis``,
``flatten_axes``) to build the DTensor storage, and restores them on the
unsharded parameters for compute inside ``typecheck()``. The worker runs one
step typed and one with checking off on two models built alike, and the same
step on one device, and writes what it saw to ``rank{r}.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import spmd_types as spmd

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
D, H, BATCH = 8, 16, 4  # model dim, hidden dim, rows per data-parallel rank
LAYOUTS = {  # name -> (mesh shape, mesh dim names, DataParallelMeshDims kwargs)
    "fsdp_tp": ((2, 2), ("dp_shard", "tp"), {"shard": "dp_shard"}),
    "hsdp_tp": ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"), {"shard": "dp_shard", "replicate": "dp_replicate"}),
}


def full_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(H, D, generator=g, dtype=torch.float64) / 3, torch.randn(D, H, generator=g, dtype=torch.float64) / 4


def full_batch(dp: int) -> torch.Tensor:
    return torch.randn(dp * BATCH, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


class MLP(nn.Module):
    """This rank's shards of the MLP; ``forward`` is written once, typed or erased alike."""

    def __init__(self, tp: int, tp_rank: int) -> None:
        super().__init__()
        w1, w2 = full_weights()
        self.w1 = nn.Parameter(w1.chunk(tp, 0)[tp_rank].clone())
        self.w2 = nn.Parameter(w2.chunk(tp, 1)[tp_rank].clone())
        self.seen: dict[str, str] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if spmd.is_type_checking():  # what FSDP restored on the unsharded parameters, and their gradients' types
            self.seen["w1"], self.seen["w2"] = str(spmd.get_type(self.w1)), str(spmd.get_type(self.w2))
            self.w1.register_hook(lambda g: self.seen.__setitem__("w1.grad", str(spmd.get_type(g))))
        x = spmd.convert(x, "tp", src=I, dst=R)  # Megatron's copy-to: all-reduce in backward
        h = F.relu(F.linear(x, self.w1))
        return spmd.all_reduce(F.linear(h, self.w2), "tp", src=V, dst=I)


def type_parameters(mlp: MLP) -> None:
    """As torchtitan does, outside typecheck(): the tp layout only (FSDP fills the dp axes with R)."""
    spmd.assert_type(mlp.w1, {"tp": S(0)})
    spmd.assert_type(mlp.w2, {"tp": S(1)})


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


def reference(dp: int) -> tuple[float, list[list[float]], list[list[float]]]:
    """The same step on one device: the full MLP on every data-parallel rank's rows (the mean over them all)."""
    w1, w2 = (w.clone().requires_grad_() for w in full_weights())
    loss = loss_of(F.linear(F.relu(F.linear(full_batch(dp), w1)), w2))
    loss.backward()
    return loss.item(), w1.grad.tolist(), w2.grad.tolist()


def run(rank: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    shape, names, dims = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    tp, tp_rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
    dp_names = tuple(n for n in names if n != "tp")
    dp, dp_rank = 1, 0
    for n in dp_names:  # this rank's index among the data-parallel ranks, row-major over the dp dims
        dp, dp_rank = dp * mesh[n].size(), dp_rank * mesh[n].size() + mesh[n].get_local_rank()
    x = full_batch(dp).chunk(dp)[dp_rank]
    row: dict = {"rank": rank}
    models = {}
    for run_kind in ("typed", "erased"):
        torch.set_default_dtype(torch.float64)
        mlp = MLP(tp, tp_rank)
        with spmd.set_current_mesh(mesh):
            type_parameters(mlp)
            fully_shard(mlp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
        with spmd.set_current_mesh(mesh), (spmd.typecheck() if run_kind == "typed" else _nothing()):
            xt = spmd.assert_type(x.clone(), {**{n: V for n in dp_names}, "tp": I})
            loss = loss_of(mlp(xt))
            row[f"{run_kind} loss type"] = str(spmd.get_type(loss))
            loss.backward()
        row[f"{run_kind} loss"] = loss.item()
        models[run_kind] = mlp
    typed = models["typed"]
    row["seen"] = typed.seen
    row["placements"] = {n: [str(p) for p in prm.placements] for n, prm in typed.named_parameters()}
    row["grad placements"] = {n: [str(p) for p in prm.grad.placements] for n, prm in typed.named_parameters()}
    row["grads"] = {n: p.grad.full_tensor().tolist() for n, p in typed.named_parameters()}
    row["erased grads"] = {n: p.grad.full_tensor().tolist() for n, p in models["erased"].named_parameters()}
    row["reference"] = reference(dp)
    return row


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def worker(rank: int, init_method: str, out_dir: str, layout: str) -> None:
    world = 1
    for n in LAYOUTS[layout][0]:
        world *= n
    os.environ.setdefault("SPMD_TYPES_ERRORS", "plain")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        row = run(rank, layout)
        row["error"] = None
    except Exception:  # written down for the test to show, instead of a hung peer
        row = {"rank": rank, "error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
