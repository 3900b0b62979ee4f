"""Overhead of spmd collectives vs the raw functional collective, on a fake process group.

Run: python benchmarks/collectives.py   (prints a table; median of repeats, µs per call)
The fake PG does no communication, so this measures pure Python/dispatch overhead,
the worst case for the wrapper's relative cost.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd
from spmd_types._comm.collectives import all_gather, all_reduce, reduce_scatter


def _time(fn, n: int = 2000, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    tp = mesh.get_group("tp")
    x = torch.randn(64, 64)
    ops, name_ = torch.ops._c10d_functional, tp.group_name
    floors = {
        "all_reduce": lambda: ops.wait_tensor(ops.all_reduce(x, "sum", name_)),
        "all_gather": lambda: ops.wait_tensor(ops.all_gather_into_tensor(x, 4, name_)),
        "reduce_scatter": lambda: ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", 4, name_)),
    }
    rows = []
    with spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            xp = spmd.assert_type(x, {"tp": spmd.P})
            xv = spmd.assert_type(x, {"tp": spmd.S(0)})
        cases = [
            ("all_reduce", lambda: fc.wait_tensor(fc.all_reduce(x, "sum", tp)),
             lambda: all_reduce(x, "tp", src=spmd.P, dst=spmd.R),
             lambda: all_reduce(xp, "tp", src=spmd.P, dst=spmd.R)),
            ("all_gather", lambda: fc.wait_tensor(fc.all_gather_single(x, 0, tp)),
             lambda: all_gather(x, "tp", src=spmd.S(0), dst=spmd.R),
             lambda: all_gather(xv, "tp", src=spmd.S(0), dst=spmd.R)),
            ("reduce_scatter", lambda: fc.wait_tensor(fc.reduce_scatter_single(x, "sum", 0, tp)),
             lambda: reduce_scatter(x, "tp", src=spmd.P, dst=spmd.S(0)),
             lambda: reduce_scatter(xp, "tp", src=spmd.P, dst=spmd.S(0))),
        ]
        for name, raw, erased, typed in cases:
            t_raw = _time(raw)
            t_erased = _time(erased)
            with spmd.typecheck():
                t_typed = _time(typed)
            rows.append((name, _time(floors[name]), t_raw, t_erased, t_typed))
    # floor: the bare _c10d_functional op + wait_tensor (what spmd calls); raw: the fc.* wrapper users call.
    print(f"{'op':<16}{'floor µs':>9}{'raw µs':>9}{'erased µs':>11}{'typed µs':>10}{'erased/raw':>12}{'typed/raw':>11}")
    for name, f, r, e, t in rows:
        print(f"{name:<16}{f:>9.1f}{r:>9.1f}{e:>11.1f}{t:>10.1f}{e / r:>12.2f}{t / r:>11.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
