"""DTensor in, typed local code inside, DTensor out: FSDP x TP on 4 simulated ranks (dp=2, tp=2).

Run: python examples/dtensor_local_map.py

The weights are DTensors sharded on both axes: ``w1`` is column-parallel on
tp (``Shard(0)``), ``w2`` row-parallel (``Shard(1)``), and each is FSDP-sharded
on dp along its other dim. Before use each weight is gathered on dp with
``spmd.all_gather(w, "dp", src=S(d), dst=R)``: the result is ``Reduced()`` on
dp, so its gradient comes back with one reduce-scatter (not an all-reduce).
The MLP body is a ``spmd.local_map`` region: it receives typed local tensors
(the types read off the placements), is checked op by op, and returns a
DTensor with the declared placements. The loss and the gradients are checked
against one device, and the communication is counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import spmd_types as spmd
from spmd_types.testing import CommCounter, per_rank, rank_values, simulate

I, P, R, S = spmd.I, spmd.P, spmd.R, spmd.S
BATCH, DIM, FFN = 4, 8, 16


@spmd.local_map(
    in_types=[{"dp": S(0), "tp": I}, {"dp": R, "tp": S(0)}, {"dp": R, "tp": S(1)}],
    out_types={"dp": S(0), "tp": P},
)
def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    x = spmd.reinterpret(x, "tp", src=I, dst=R)  # Megatron's copy-to region: backward all-reduces on tp
    h = F.gelu(F.linear(x, w1))  # column-parallel: V on tp
    return spmd.reinterpret(F.linear(h, w2), "tp", src=spmd.V, dst=P)  # row-parallel: a pending sum


def run() -> dict:
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(BATCH, DIM, generator=g)
    w1_full, w2_full = torch.randn(FFN, DIM, generator=g), torch.randn(DIM, FFN, generator=g)
    ref = [t.clone().requires_grad_() for t in (x_full, w1_full, w2_full)]
    F.linear(F.gelu(F.linear(ref[0], ref[1])), ref[2]).square().sum().backward()

    with simulate((2, 2), ("dp", "tp"), ranks="local", device="cpu") as mesh:
        w1 = distribute_tensor(w1_full, mesh, [Shard(1), Shard(0)], src_data_rank=None).requires_grad_()
        w2 = distribute_tensor(w2_full, mesh, [Shard(0), Shard(1)], src_data_rank=None).requires_grad_()
        x = DTensor.from_local(per_rank(lambda r: x_full.chunk(2)[r // 2].clone()), mesh, [Shard(0), Replicate()])
        x = x.detach().requires_grad_()  # rank r holds batch rows of dp coordinate r // 2
        with spmd.typecheck(), CommCounter() as comms:
            w1_used = spmd.all_gather(w1, "dp", src=S(1), dst=R)  # FSDP's gather: (Reduced(), Shard(0))
            w2_used = spmd.all_gather(w2, "dp", src=S(0), dst=R)
            out = mlp(x, w1_used, w2_used)  # DTensor (Shard(0), Partial())
            y = spmd.all_reduce(out, "tp", src=P, dst=I)  # (Shard(0), Replicate())
            loss = y.square().sum()
            forward = comms.counts
            comms.reset()
            loss.backward()
            backward = comms.counts
        full = lambda t: rank_values(t.full_tensor())[0]  # noqa: E731
        torch.testing.assert_close(full(w1.grad), ref[1].grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(full(w2.grad), ref[2].grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(full(x.grad), ref[0].grad, rtol=1e-4, atol=1e-4)
        result = {"gathered": repr(w1_used.placements), "out": repr(out.placements), "forward": forward,
                  "backward": backward, "grad": repr(w1.grad.placements)}
    return result


if __name__ == "__main__":
    RESULT = run()
    print(f"w1 gathered on dp:         {RESULT['gathered']}")
    print(f"local_map output:          {RESULT['out']}")
    print(f"forward communication:     {RESULT['forward']}")
    print(f"backward communication:    {RESULT['backward']}  (w1, w2: one reduce-scatter each; x: tp all-reduce)")
    print(f"w1's gradient:             {RESULT['grad']}  (the same placements as w1)")
    print("gradients equal one device's")
