"""The erased path with op_dtype / out_dtype / backward_options, vs plain torch.distributed, on a fake process group.

Run: python benchmarks/low_precision.py [--size N]   (prints a table; median of repeats, µs per call)

Each row is one call as torchtitan or an FSDP loop writes it. Columns:

* plain: the same casts and collective with nothing else: ``x.to(op_dtype)``, the bare
  ``torch.ops._c10d_functional`` op and ``wait_tensor`` (what ``torch.distributed._functional_collectives``
  runs after resolving its group, and what spmd runs), ``.to(out_dtype)``;
* erased: the spmd call with checking off and no dtype options (the same collective, no casts);
* erased+dtypes: the spmd call with the row's dtype options (the same work as plain);
* +grad: the same erased call on a tensor that requires grad (through the op's autograd Function).

The fake PG does no communication, so the table shows the wrapper's overhead at its worst
relative to the real cost of a collective; the casts themselves cost the same in every column that
does them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd

BF16, F32 = torch.bfloat16, torch.float32
R, P, S = spmd.R, spmd.P, spmd.S


def _time(fn, x: torch.Tensor, n: int = 1000, repeats: int = 7) -> float:
    for _ in range(100):
        fn(x)
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn(x)
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def _rows(tp, x32, xb16):
    """(name, plain, erased without options, erased with options, the input of the +grad column)."""
    fsdp = {"op_dtype": BF16, "backward_options": {"op_dtype": F32}}
    c10d, name, n = torch.ops._c10d_functional, tp.group_name, tp.size()

    def gather(x):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, name))

    def reduce_scatter(x):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", n, name))

    def all_reduce(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", name))

    return [
        ("all_gather S(0)->R, op bf16, bw fp32",
         lambda x: gather(x.to(BF16)),
         lambda x: spmd.all_gather(x, "tp", src=S(0), dst=R),
         lambda x: spmd.all_gather(x, "tp", src=S(0), dst=R, **fsdp), x32),
        ("reduce_scatter P->S(0), bf16 in, op fp32, out bf16",
         lambda x: reduce_scatter(x.to(F32)).to(BF16),
         lambda x: spmd.reduce_scatter(x, "tp", src=P, dst=S(0)),
         lambda x: spmd.reduce_scatter(x, "tp", src=P, dst=S(0), op_dtype=F32, out_dtype=BF16), xb16),
        ("all_reduce P->R, op bf16, out fp32, bw fp32",
         lambda x: all_reduce(x.to(BF16)).to(F32),
         lambda x: spmd.all_reduce(x, "tp", src=P, dst=R),
         lambda x: spmd.all_reduce(x, "tp", src=P, dst=R, op_dtype=BF16, out_dtype=F32,
                                   backward_options={"op_dtype": F32}), x32),
        ("redistribute S(0)->R, bw op x.dtype (torchtitan)",
         lambda x: gather(x),
         lambda x: spmd.redistribute(x, tp, src=S(0), dst=R),
         lambda x: spmd.redistribute(x, tp, src=S(0), dst=R, backward_options={"op_dtype": x.dtype}), xb16),
        ("redistribute P->R, bw op x.dtype (torchtitan)",
         lambda x: all_reduce(x),
         lambda x: spmd.redistribute(x, tp, src=P, dst=R),
         lambda x: spmd.redistribute(x, tp, src=P, dst=R, backward_options={"op_dtype": x.dtype}), xb16),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=64, help="the local tensor is size x size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    tp = mesh.get_group("tp")
    x32 = torch.randn(args.size, args.size)
    xb16 = x32.to(BF16)
    results = []
    with spmd.set_current_mesh(mesh):
        for name, plain, erased, with_dtypes, x in _rows(tp, x32, xb16):
            with torch.no_grad():
                t_plain, t_erased, t_dtypes = _time(plain, x), _time(erased, x), _time(with_dtypes, x)
            t_grad = _time(with_dtypes, x.detach().requires_grad_())
            results.append((name, t_plain, t_erased, t_dtypes, t_grad))
    print(f"local tensor {args.size}x{args.size}, fake process group of 4 ranks, µs per call (median)")
    print(f"{'call':<52}{'plain':>8}{'erased':>9}{'erased+dtypes':>15}{'+grad':>8}{'dtypes/plain':>14}")
    for name, p, e, d, g in results:
        print(f"{name:<52}{p:>8.1f}{e:>9.1f}{d:>15.1f}{g:>8.1f}{d / p:>14.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
