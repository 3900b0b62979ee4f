"""Microseconds per op: global SPMD typed vs local SPMD typed vs DTensor, on a fake process group.

Run: python benchmarks/global_overhead.py [--repeat N]

Cases: a 4x4 ``mul`` of two S(0) tensors, a ``matmul`` S(0) @ R, and a 12-op
MLP forward with the batch sharded. All rows are measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch
import torch.distributed as dist
from overhead import mlp  # the same 12-op MLP (benchmarks/ is on sys.path when run as a script)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    w1, w2, b1, g = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4), torch.randn(4)

    def typed_inputs(local: bool):
        with spmd.set_current_mesh(mesh), spmd.typecheck(local=local):
            sa = spmd.assert_type(a, {"tp": spmd.S(0)})
            sb = spmd.assert_type(b, {"tp": spmd.S(0)})
            rep = [spmd.assert_type(t, {"tp": spmd.R}) for t in (b, w1, w2, b1, g)]
        return sa, sb, rep

    ga, gb, (gr, gw1, gw2, gb1, gg) = typed_inputs(local=False)
    la, lb, (lr, lw1, lw2, lb1, lg) = typed_inputs(local=True)
    da, db = (DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in (a, b))
    dr, dw1, dw2, db1, dg = (DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (b, w1, w2, b1, g))

    cases = {
        "mul S(0)*S(0)": {"global typed": lambda: ga * gb, "local typed": lambda: la * lb, "DTensor": lambda: da * db},
        "matmul S(0)@R": {"global typed": lambda: ga @ gr, "local typed": lambda: la @ lr, "DTensor": lambda: da @ dr},
        "mlp (12 ops)": {
            "global typed": lambda: mlp(ga, gw1, gw2, gb1, gg),
            "local typed": lambda: mlp(la, lw1, lw2, lb1, lg),
            "DTensor": lambda: mlp(da, dw1, dw2, db1, dg),
        },
    }
    modes = {"global typed": False, "local typed": True, "DTensor": None}

    def measure(fn, local):
        if local is None:
            fn()
            times = timeit.repeat(fn, number=args.number, repeat=args.repeat)
        else:
            with spmd.set_current_mesh(mesh), spmd.typecheck(local=local):
                fn()
                times = timeit.repeat(fn, number=args.number, repeat=args.repeat)
        return statistics.median(times) / args.number * 1e6

    print(f"microseconds per call (median of {args.repeat} x {args.number}); torch {torch.__version__}")
    print(f"{'op':<16}{'global typed':>14}{'local typed':>14}{'DTensor':>10}{'global/local':>14}{'global/DTensor':>16}")
    for op, fns in cases.items():
        row = {v: measure(fns[v], modes[v]) for v in modes}
        print(
            f"{op:<16}{row['global typed']:>14.2f}{row['local typed']:>14.2f}{row['DTensor']:>10.2f}"
            f"{row['global typed'] / row['local typed']:>14.2f}{row['global typed'] / row['DTensor']:>16.2f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
