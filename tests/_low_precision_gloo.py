"""An FSDP step in low precision, run on simulated ranks and on real gloo processes (tests/test_low_precision_gloo.py).

Each dp rank holds a dp shard of an fp32 weight (the master copy). The forward
gathers it in bf16 (``all_gather(..., op_dtype=torch.bfloat16)``), the model
runs in bf16, and the backward reduce-scatters the weight's gradient in fp32
(``backward_options={"op_dtype": torch.float32}``) into the fp32 shard: FSDP's
mixed precision.

The data make every number exact, so the two runs can be compared bit for bit
with each other and with the single-device meaning computed in float64:
the weight is ``j/4`` (``j != 0``) plus bits below bf16 (which the bf16 gather drops), the
batch is ``k/4`` on dp rank 0 and ``k/4 * 2**-9`` on dp rank 1, the targets
``l/4`` (``|j|, |k|, |l| <= 3``). Every bf16 matmul result is then exact, and
the gradient's sum over the two ranks is exact in fp32 but not in bf16: a
reduce-scatter in bf16 would change it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import spmd_types as spmd

WORLD = 2
OUT, HIDDEN, BATCH = 4, 4, 4
MODES = ("erased", "typed")
BF16, F32 = torch.bfloat16, torch.float32


class CommDtypes(TorchDispatchMode):
    """Records the dtype of the tensor each functional collective runs on (under the simulator, enter it inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name != "wait_tensor":
            self.seen.append((name, args[0].dtype))
        return func(*args, **(kwargs or {}))

    @property
    def dtypes(self) -> set[torch.dtype]:
        return {d for _, d in self.seen}


def full_tensors() -> dict[str, torch.Tensor]:
    """The whole weight, batch and targets (every process and the reference build the same ones)."""
    with maybe_disable_local_tensor_mode():  # plain tensors, also when called on simulated ranks
        return _full_tensors()


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def grid(*shape: int) -> torch.Tensor:
        return torch.randint(-3, 4, shape, generator=g) / 4

    sign = torch.randint(0, 2, (OUT, HIDDEN), generator=g) * 2 - 1
    w = sign * (torch.randint(1, 4, (OUT, HIDDEN), generator=g) / 4  # nonzero j/4, and bits below bf16's
                + torch.randint(1, 8, (OUT, HIDDEN), generator=g) * 2.0**-17)
    scale = torch.tensor([1.0] * (BATCH // 2) + [2.0**-9] * (BATCH // 2)).unsqueeze(1)  # dp rank 1's rows are tiny
    return {"w": w.float(), "x": (grid(BATCH, HIDDEN) * scale).float(), "t": grid(BATCH, OUT).float()}


def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the weight's gradient on one device, in float64, with the weight rounded to bf16 as gathered."""
    full = full_tensors()
    w = full["w"].to(BF16).double().requires_grad_()
    loss = (F.linear(full["x"].double(), w) * full["t"].double()).sum()
    loss.backward()
    return loss.detach(), w.grad


def fsdp_step(typed: bool, local: Callable[[Callable[[int], torch.Tensor]], torch.Tensor]) -> dict:
    """One FSDP step on the current mesh's "dp" axis; ``local(f)`` is this rank's ``f(rank)`` (or every rank's)."""
    full = full_tensors()
    w_shard = local(lambda r: full["w"].chunk(WORLD, 0)[r].clone()).requires_grad_()  # fp32 master shard
    x = local(lambda r: full["x"].chunk(WORLD, 0)[r].to(BF16))
    t = local(lambda r: full["t"].chunk(WORLD, 0)[r].to(BF16))
    with spmd.typecheck() if typed else contextlib.nullcontext(), CommDtypes() as comms:
        if typed:
            spmd.assert_type(w_shard, {"dp": spmd.S(0)})
            x = spmd.assert_type(x, {"dp": spmd.S(0)})
            t = spmd.assert_type(t, {"dp": spmd.S(0)})
        w = spmd.all_gather(w_shard, "dp", src=spmd.S(0), dst=spmd.R, op_dtype=BF16,
                            backward_options={"op_dtype": F32})
        y = F.linear(x, w)  # bf16
        loss = spmd.all_reduce((y.float() * t.float()).sum(), "dp", src=spmd.V, dst=spmd.I)
        loss.backward()
    grad = w_shard.grad
    return {"loss": loss.detach(), "grad": grad, "gathered_dtype": w.dtype, "grad_dtype": grad.dtype,
            "grad_type": spmd.get_type(grad), "comms": comms.seen}


def to_json(result: dict, values: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The result as JSON: tensors as (this rank's) lists of exact floats, dtypes and types as text."""
    return {
        "loss": values(result["loss"]).double().tolist(),
        "grad": values(result["grad"]).double().tolist(),
        "gathered_dtype": str(result["gathered_dtype"]),
        "grad_dtype": str(result["grad_dtype"]),
        "grad_type": str(result["grad_type"]),
        "comms": [[name, str(d)] for name, d in result["comms"]],
    }


def _plain(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(torch.Tensor, t.detach())


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One rank of a dp=2 gloo mesh: the FSDP step erased and typed, one JSON line each (or the error)."""
    torch.set_num_threads(1)
    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w") as out:
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                                    timeout=datetime.timedelta(seconds=60))
            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
            for mode in MODES:
                try:
                    with spmd.set_current_mesh(mesh):
                        row = to_json(fsdp_step(mode == "typed", lambda f: f(rank)), _plain)
                    row.update(key=mode, error=None)
                except Exception:
                    row = {"key": mode, "error": traceback.format_exc()}
                out.write(json.dumps(row) + "\n")
                out.flush()
            dist.barrier()  # every rank done before gloo is torn down
            dist.destroy_process_group()
        except Exception:
            out.write(json.dumps({"key": "__worker__", "error": traceback.format_exc()}) + "\n")
