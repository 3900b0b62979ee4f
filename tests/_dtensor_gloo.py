"""Worker for tests/test_dtensor_model.py: the torchtitan-style Llama on 4 gloo processes (dp=2, tp=2).

Tensor + sequence parallel on tp (``parallelize_module``), ``fully_shard`` on
dp, run inside ``spmd.typecheck()`` (the attention core is a ``local_map``
region on DTensors, block inputs/outputs are asserted ``{tp: S(1)}``). Each
rank checks the loss and its shard of every parameter gradient (the
reference gradient cut by the gradient's own placements) against the model on one device with the whole batch, and
counts the collectives of the backward by kind: FSDP's (``c10d`` ops, on dp)
and DTensor's (functional collectives, on tp). One JSON line per rank.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import traceback
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import spmd_types as spmd

WORLD = 4
_FSDP_OPS = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
             "allreduce_": "all_reduce", "allgather_": "all_gather", "reduce_scatter_": "reduce_scatter"}


class _Comms(TorchDispatchMode):
    """Collectives by (who, kind): ``c10d`` in-place ops are FSDP's, functional ones are DTensor's."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func.overloadpacket.__name__
        if ns == "c10d" and name in _FSDP_OPS:
            self.counts["fsdp " + _FSDP_OPS[name]] += 1
        elif ns == "_c10d_functional" and name != "wait_tensor":
            self.counts["dtensor " + name.replace("_into_tensor", "").replace("_tensor", "")] += 1
        return func(*args, **(kwargs or {}))


def run(rank: int) -> dict:
    import _dtensor_llama as L
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = L.Llama()
    tokens, targets = L.batch()
    ref_loss, ref_grads = L.reference(copy.deepcopy(model), tokens, targets)
    m = L.apply_fsdp(L.apply_tp(model, mesh["tp"]), mesh["dp"])
    dp = mesh.get_local_rank("dp")
    mine = slice(dp * L.BATCH // 2, (dp + 1) * L.BATCH // 2)
    with spmd.typecheck():
        with _Comms() as fwd:
            loss = F.cross_entropy(m(tokens[mine]).flatten(0, 1), targets[mine].flatten())
        with _Comms() as bwd:
            loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group("dp"))
    torch.testing.assert_close(total / 2, ref_loss, rtol=1e-5, atol=1e-5)
    checked = ["loss"]
    for name, p in m.named_parameters():
        assert isinstance(p.grad, DTensor), name
        # The reference gradient cut to this rank's shard by the same placements (no communication).
        want = distribute_tensor(ref_grads[name], p.grad.device_mesh, p.grad.placements, src_data_rank=None)
        torch.testing.assert_close(p.grad.to_local(), want.to_local(), rtol=1e-4, atol=1e-5)
        checked.append(name)
    placements = {n: repr(p.placements) for n, p in m.named_parameters()}
    return {"checked": checked, "forward": dict(fwd.counts), "backward": dict(bwd.counts),
            "params": len(checked) - 1, "placements": placements}


def worker(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # 4 processes on 2 cores
    warnings.filterwarnings("ignore")  # FSDP and DTensor advice about their own internals
    row: dict = {"rank": rank, "error": None}
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        row.update(run(rank))
        dist.barrier()  # every rank done before gloo is torn down
        dist.destroy_process_group()
    except Exception:
        row["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump(row, out)
