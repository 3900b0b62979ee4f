"""Erased ``spmd.assert_type`` (outside ``typecheck()``) against a bare Python function call (issue 22 item 6).

Run: python benchmarks/erased_assert.py [--rounds N] [--calls N]

Outside ``typecheck()`` ``assert_type`` returns its tensor and records the type for a later
``typecheck()``; the goal is at most 1 µs a call over a bare call ("minus bare"). Each variant calls
its function ``--calls`` times in a loop; the variants are interleaved in every round (the order rotating), timed in CPU time
(``time.process_time``), and the table gives medians over rounds. "bare call" is a Python function of the
same signature that returns its tensor: the floor of any call. The rows with a fresh tensor make one
``torch.empty(0)`` per call (a batch annotated every step) and are paired with the bare call on a fresh
tensor. The last rows: a process where no mesh is current and no process group exists.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd


def bare(t: Any, types: Any, partition_spec: Any = None) -> Any:
    """The floor: a Python function of assert_type's signature that returns its tensor."""
    return t


def _loops(mesh_types: dict, pg_types: dict, spec: Any) -> dict[str, Callable[[int], None]]:
    """{variant: run(n)}: n calls in a loop; same loop shape for every variant."""
    # each variant asserts its own tensor, as a model does (a tensor re-asserted with another type dict joins the
    # two records: its own row)
    w, w_pg, w_spec, w_join = (torch.randn(4, 4) for _ in range(4))
    assert_type, empty = spmd.assert_type, torch.empty

    def bare_same(n: int) -> None:
        for _ in range(n):
            bare(w, mesh_types)

    def erased_same(n: int) -> None:
        for _ in range(n):
            assert_type(w, mesh_types)

    def erased_pg(n: int) -> None:
        for _ in range(n):
            assert_type(w_pg, pg_types)

    def erased_spec(n: int) -> None:
        for _ in range(n):
            assert_type(w_spec, mesh_types, partition_spec=spec)

    def erased_join(n: int) -> None:
        for _ in range(n // 2):
            assert_type(w_join, mesh_types)
            assert_type(w_join, pg_types)

    def bare_fresh(n: int) -> None:
        for _ in range(n):
            bare(empty(0), mesh_types)

    def erased_fresh(n: int) -> None:
        for _ in range(n):
            assert_type(empty(0), mesh_types)

    return {
        "bare call": bare_same,
        "assert_type": erased_same,
        "assert_type, keyed by ProcessGroup": erased_pg,
        "assert_type, with partition_spec": erased_spec,
        "assert_type, two type dicts in turn": erased_join,
        "bare call, fresh tensor": bare_fresh,
        "assert_type, fresh tensor": erased_fresh,
    }


def measure(loops: dict[str, Callable[[int], None]], rounds: int, calls: int) -> dict[str, float]:
    """Median µs per call of each variant; variants interleaved (rotating order) in every round, CPU time."""
    names = list(loops)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for fn in loops.values():  # warm-up
        fn(calls // 10 or 1)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            start = time.process_time()
            loops[name](calls)
            samples[name].append((time.process_time() - start) / calls * 1e6)
    return {n: statistics.median(s) for n, s in samples.items()}


def _print(title: str, got: dict[str, float], pairs: dict[str, str]) -> None:
    print(title)
    print(f"    {'variant':38} {'µs/call':>8} {'minus bare':>11} {'/ bare':>7}  goal: minus bare <= 1 µs")
    for name, us in got.items():
        floor = pairs.get(name)
        if floor is None:
            print(f"    {name:38} {us:8.3f}")
            continue
        met = "met" if us - got[floor] <= 1.0 else "not met"  # assert_type's own cost, over the bare call
        print(f"    {name:38} {us:8.3f} {us - got[floor]:11.3f} {us / got[floor]:7.2f}  {met}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    V, R, PS = spmd.V, spmd.R, spmd.PartitionSpec
    print(f"erased spmd.assert_type, µs of CPU per call, median of {args.rounds} rounds x {args.calls} calls; "
          f"torch {torch.__version__}; spmd_types from {os.path.dirname(spmd.__file__)}")

    # A process that never checks and has no process group: the record holds the raw arguments only.
    loops = _loops({"dp": V, "tp": R}, {"dp": V, "tp": R}, PS("dp", None))
    loops = {k: v for k, v in loops.items() if "ProcessGroup" not in k}
    pairs = {n: ("bare call, fresh tensor" if "fresh" in n else "bare call") for n in loops if "bare" not in n}
    _print("no process group, no current mesh", measure(loops, args.rounds, args.calls), pairs)

    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with spmd.set_current_mesh(mesh):
        loops = _loops({"dp": V, "tp": R}, {mesh.get_group("dp"): V, mesh.get_group("tp"): R}, PS("dp", None))
        pairs = {n: ("bare call, fresh tensor" if "fresh" in n else "bare call") for n in loops if "bare" not in n}
        _print("a fake process group of 8, mesh dp=2 x tp=4 current", measure(loops, args.rounds, args.calls), pairs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
