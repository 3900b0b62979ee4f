"""A typed Megatron-style tensor-parallel MLP on a fake (dp=2, tp=4) process group.

Run: python examples/quickstart.py

1. The buggy version forgets Megatron's copy_to_tensor_model_parallel_region
   (the I -> R conversion of the input): typechecking stops it and says how
   to fix it.
2. The fixed version typechecks, and its types are printed at the module
   boundary.
3. The same code runs erased (no typecheck) as plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd

HIDDEN, FFN, TP = 16, 64, 4


class TensorParallelMLP(nn.Module):
    """Column-parallel fc1, row-parallel fc2: each tp rank holds 1/TP of both weights."""

    def __init__(self, forget_copy_to_region: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Parameter(torch.randn(FFN // TP, HIDDEN) / HIDDEN**0.5)  # rows of W1: V on tp
        self.fc2 = nn.Parameter(torch.randn(HIDDEN, FFN // TP) / FFN**0.5)  # columns of W2: V on tp
        self.bias = nn.Parameter(torch.zeros(HIDDEN))  # replicated on tp, gradient all-reduced: I
        self.forget_copy_to_region = forget_copy_to_region

    def type_parameters(self) -> None:
        # dp: R, the same on every dp rank; its gradient is a pending sum that DDP all-reduces.
        spmd.assert_type(self.fc1, {"dp": spmd.R, "tp": spmd.V})
        spmd.assert_type(self.fc2, {"dp": spmd.R, "tp": spmd.V})
        spmd.assert_type(self.bias, {"dp": spmd.R, "tp": spmd.I})

    @spmd.typed_boundary(in_types=[{"dp": spmd.V, "tp": spmd.I}], out_types={"dp": spmd.V, "tp": spmd.I})
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.forget_copy_to_region:
            # Megatron's copy_to_tensor_model_parallel_region: no-op forward, all-reduce backward.
            x = spmd.convert(x, "tp", src=spmd.I, dst=spmd.R)
        h = F.gelu(F.linear(x, self.fc1))  # local: V on tp
        y = F.linear(h, self.fc2)  # each rank's partial product: still V
        y = spmd.reinterpret(y, "tp", src=spmd.V, dst=spmd.P)  # "I mean the global matmul": a pending sum
        y = spmd.all_reduce(y, "tp", src=spmd.P, dst=spmd.I)  # reduce_from_tensor_model_parallel_region
        return y + self.bias


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=2 * TP, store=FakeStore())
    mesh = init_device_mesh("cpu", (2, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    x = torch.randn(8, HIDDEN, requires_grad=True)  # an activation: its gradient flows back to earlier layers

    with spmd.set_current_mesh(mesh):
        print("1. The bug: the input is never converted from I to R before the column-parallel matmul.\n")
        buggy = TensorParallelMLP(forget_copy_to_region=True)
        with spmd.typecheck():
            buggy.type_parameters()
            try:
                buggy(x)
            except spmd.SpmdTypeError as err:
                print(f"SpmdTypeError: {err}\n")

        print("2. Fixed: the module typechecks. Types at its boundary:\n")
        model = TensorParallelMLP()
        with spmd.typecheck():
            model.type_parameters()
            x_typed = spmd.assert_type(x, {"dp": spmd.V, "tp": spmd.I})
            y = model(x_typed)
            loss = y.pow(2).mean()
            print(f"   input   {x_typed!r}")
            print(f"   output  {y!r}")
            print(f"   loss    {loss!r}")
        loss.backward()
        print(f"   grad of fc1  {model.fc1.grad!r}   (V on tp, pending sum on dp for DDP)")
        print(f"   grad of bias {model.bias.grad!r}   (I on tp: already the same on every tp rank, no all-reduce needed)\n")

        print("3. Erased: the same code outside typecheck() runs as plain PyTorch.\n")
        plain = TensorParallelMLP()
        out = plain(x)
        print(f"   output is a {type(out).__module__}.{type(out).__name__} of shape {tuple(out.shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
