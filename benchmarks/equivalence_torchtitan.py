"""torchtitan 0.3.0's models through check_equivalence, with no rank shims: the table in docs/equivalence.md.

Run: PYTHONPATH=. python benchmarks/equivalence_torchtitan.py [--models llama3,qwen3,qwen3_moe] [--dtypes float32,bfloat16]
     [--layouts "FSDP dp2 x tp2,FSDP dp2 x tp2+SP"]   (the FSDP layouts apply torchtitan's fully_shard: torch 2.14)

Each row builds the model the trainer's way (``tests/_equivalence_torchtitan.py``: torchtitan's config,
``ParallelDims``, ``parallelize_fn``, the trainer's forward/backward body, the gradient reduction FSDP would do)
on simulated ranks and on one device, and prints: ``ok``, the false-alarm margin (the smallest tolerance / error
over the compared values: a false alarm needs an error that many times larger), how many values were compared
and not compared, and the wall and CPU seconds of the whole check. The CPU accommodations are
``tests/_torchtitan_shims.load``'s (CPU device, FlexAttention as dense math, the experts' grouped matmul in
float32, no ``fully_shard`` but in the FSDP layouts); nothing reads or fakes a rank.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

LAYOUTS = {  # name -> (mesh_shape (dp, tp), sequence parallel, FSDP applied)
    "tp2": ((1, 2), False, False),
    "tp2+SP": ((1, 2), True, False),
    "dp2 x tp2": ((2, 2), False, False),
    "dp2 x tp2+SP": ((2, 2), True, False),
    "FSDP dp2 x tp2": ((2, 2), False, True),  # torch 2.14: fully_shard applied, its reduce-scatter in the step
    "FSDP dp2 x tp2+SP": ((2, 2), True, True),
}
DEFAULT_LAYOUTS = ",".join(name for name, (_, _, fsdp) in LAYOUTS.items() if not fsdp)


def row(model: str, layout: str, dtype_name: str) -> tuple[str, ...]:
    import torch
    from _equivalence_torchtitan import Options, batch, build, step

    from spmd_types.testing import check_equivalence

    shape, sp, fsdp = LAYOUTS[layout]
    opts = Options(model=model, sp=sp, ep=2 if model == "qwen3_moe" else 1, fsdp=fsdp)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        report = check_equivalence(lambda mesh: build(mesh, opts), lambda m, b, mesh: step(m, b, mesh, opts),
                                   batch(opts, shape[0]), mesh_shape=shape, names=("dp", "tp"),
                                   dtype=getattr(torch, dtype_name))
    except Exception as err:  # a row says what broke; the table goes on
        text = str(err).strip().splitlines()[-1][:110] if str(err).strip() else type(err).__name__
        return (model, layout, dtype_name, f"error: {type(err).__name__}: {text}", "-", "-", "-", "-")
    margin = min((c.tolerance / c.max_abs_error if c.max_abs_error else math.inf) for c in report.compared)
    return (model + (" (ep=2)" if opts.ep > 1 else ""), layout, dtype_name, "ok" if report.ok else
            f"DIVERGED at {report.first.kind} {report.first.name}", f"{margin:.1f}",
            f"{len(report.compared)} / {len(report.not_compared)}", f"{time.perf_counter() - wall:.0f}",
            f"{time.process_time() - cpu:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3,qwen3,qwen3_moe")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    header = ("model", "layout", "dtype", "result", "margin", "compared / not", "wall s", "cpu s")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            for dtype in args.dtypes.split(","):
                print("| " + " | ".join(row(model, layout, dtype)) + " |", flush=True)


if __name__ == "__main__":
    main()
