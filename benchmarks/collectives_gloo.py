"""Overhead of spmd collectives vs the raw functional collective, on 2 real gloo processes (issue 3, item 10).

Run: python benchmarks/collectives_gloo.py   (rank 0 prints a table; µs per call, median of repeats)

Every variant of one op and shape is timed back to back inside each repeat
(interleaved), so drift in the machine's speed hits them alike. Columns:

* floor: the bare ``_c10d_functional`` op + ``wait_tensor``, what spmd calls;
* raw: ``torch.distributed._functional_collectives`` + ``wait_tensor``, what users call;
* erased: ``spmd.<op>(x, "tp", src=, dst=)`` outside ``typecheck()`` on a plain tensor;
* typed: the same call inside ``typecheck()`` on a typed tensor.

Both ranks run the identical sequence of calls: a collective cannot finish
until its peer joins it, so the two processes stay in lockstep.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import spmd_types as spmd

P, R, S = spmd.P, spmd.R, spmd.S
WORLD = 2
SHAPES = ((1, 1024), (256, 1024))
REPEATS = 15
TARGETS = {"erased": 1.15, "typed": 1.3}


def _calls_per_repeat(shape: tuple[int, int]) -> int:
    """Enough calls that one timed batch lasts ~100 ms (a gloo call costs ~1-2 ms here)."""
    return 100 if shape[0] == 1 else 50


def _cases(x: torch.Tensor, group: dist.ProcessGroup) -> dict[str, dict[str, object]]:
    """{op: {variant: zero-argument callable}}; the typed variants are called inside typecheck()."""
    ops, name = torch.ops._c10d_functional, group.group_name
    # A 1-row tensor cannot be scattered on dim 0 over 2 ranks: scatter dim 1 there (raw and spmd alike).
    sd = 0 if x.shape[0] % WORLD == 0 else 1
    with spmd.typecheck():
        xp = spmd.assert_type(x, {"tp": P})
        xs = spmd.assert_type(x, {"tp": S(0)})
    return {
        "all_reduce": {
            "floor": lambda: ops.wait_tensor(ops.all_reduce(x, "sum", name)),
            "raw": lambda: fc.wait_tensor(fc.all_reduce(x, "sum", group)),
            "erased": lambda: spmd.all_reduce(x, "tp", src=P, dst=R),
            "typed": lambda: spmd.all_reduce(xp, "tp", src=P, dst=R),
        },
        "all_gather": {
            "floor": lambda: ops.wait_tensor(ops.all_gather_into_tensor(x, WORLD, name)),
            "raw": lambda: fc.wait_tensor(fc.all_gather_single(x, 0, group)),
            "erased": lambda: spmd.all_gather(x, "tp", src=S(0), dst=R),
            "typed": lambda: spmd.all_gather(xs, "tp", src=S(0), dst=R),
        },
        "reduce_scatter": {
            "floor": (lambda: ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", WORLD, name))) if sd == 0 else None,
            "raw": lambda: fc.wait_tensor(fc.reduce_scatter_single(x, "sum", sd, group)),
            "erased": lambda: spmd.reduce_scatter(x, "tp", src=P, dst=S(sd)),
            "typed": lambda: spmd.reduce_scatter(xp, "tp", src=P, dst=S(sd)),
        },
    }


def _batch(fn, n: int, typed: bool) -> tuple[float, float]:
    """(wall µs, this thread's CPU µs) per call over ``n`` back-to-back calls (typed ones inside typecheck()).

    gloo moves the bytes on its own threads and the caller sleeps in wait_tensor, so
    the caller's CPU time is the Python/dispatch work where the spmd wrapper's cost lives,
    without the loopback latency's jitter that dominates the wall time.
    """
    with spmd.typecheck() if typed else contextlib.nullcontext():
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            fn()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return wall / n * 1e6, cpu / n * 1e6


def _measure(variants: dict, n: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) over REPEATS of each variant's batch, the variants interleaved within each repeat."""
    live = {k: fn for k, fn in variants.items() if fn is not None}
    for name, fn in live.items():  # warm up: first-call setup, caches, gloo buffers
        _batch(fn, max(n // 10, 5), name == "typed")
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in live}
    for _ in range(REPEATS):
        for name, fn in live.items():
            runs[name].append(_batch(fn, n, name == "typed"))
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}


def _row(op: str, shape: tuple[int, int], t: dict[str, tuple[float, float]], which: int) -> tuple[str, bool]:
    """One table line for wall (which=0) or CPU (which=1) figures, and whether it misses a target."""
    m = {k: v[which] for k, v in t.items()}
    e, ty = m["erased"] / m["raw"], m["typed"] / m["raw"]
    floor = f"{m['floor']:>9.1f}" if "floor" in m else f"{'-':>9}"
    line = (f"{op:<15}{'x'.join(map(str, shape)):>9}{floor}{m['raw']:>9.1f}{m['erased']:>9.1f}{m['typed']:>9.1f}"
            f"{e:>12.2f}{ty:>11.2f}")
    return line, e > TARGETS["erased"] or ty > TARGETS["typed"]


def _table(rows: list) -> str:
    """Two blocks: wall µs per call (the targets' measure) and the caller's CPU µs per call."""
    head = f"{'op':<15}{'shape':>9}{'floor':>9}{'raw':>9}{'erased':>9}{'typed':>9}{'erased/raw':>12}{'typed/raw':>11}"
    lines = []
    for which, title in ((0, "wall µs per call (median)"), (1, "caller's CPU µs per call (median)")):
        lines += ["", title, head]
        over = False
        for op, shape, t in rows:
            line, miss = _row(op, shape, t, which)
            lines.append(line + ("   <- over target" if miss else ""))
            over |= miss
        lines.append(f"targets erased/raw <= {TARGETS['erased']}, typed/raw <= {TARGETS['typed']}: "
                     + ("some missed" if over else "all met"))
    return "\n".join(lines)


def _worker(rank: int, init_method: str) -> None:
    torch.set_num_threads(1)  # 2 processes on 2 cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")
    rows = []
    with spmd.set_current_mesh(mesh):
        for shape in SHAPES:
            x = torch.randn(*shape)
            for op, variants in _cases(x, group).items():
                rows.append((op, shape, _measure(variants, _calls_per_repeat(shape))))
    if rank == 0:
        print(f"torch {torch.__version__}, gloo, {WORLD} processes, {os.cpu_count()} cores, fp32, no grad")
        print(_table(rows))
        sys.stdout.flush()
    dist.destroy_process_group()


def main() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(_worker, args=(f"tcp://127.0.0.1:{port}",), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
