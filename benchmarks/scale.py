"""Seconds for one training step of 8B- and 70B-shaped Llama stacks on the meta device: typed vs untyped.

Run: python benchmarks/scale.py [--repeat N] [--only 70B]

Each configuration runs in ``spmd_types.testing.simulate`` (a fake process
group, the meta device), at dp=8 x tp=8 (64 ranks) and dp=64 x tp=8 (512
ranks). "cold" is the first typed step in a fresh process: building the
model, typing its parameters, forward and backward. "warm" is the median of
``--repeat`` further steps on the built model, typed (inside ``typecheck()``)
and untyped (the same code erased: plain tensors, no checking), alternating.
Seconds are CPU seconds of the measuring process (``time.process_time``), which
other processes on a shared machine do not inflate; the cold step's wall time
is shown too. The model is the one in ``examples/check_at_scale.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

from check_at_scale import LLAMA_8B, LLAMA_70B, Config, build, train_step  # noqa: E402

from spmd_types.testing import simulate  # noqa: E402

SHAPES = {"8B": LLAMA_8B, "70B": LLAMA_70B}
MESHES = [(8, 8), (64, 8)]


def measure(c: Config, repeat: int) -> dict[str, float]:
    """Cold typed step, then warm typed and untyped steps (median seconds), in this process."""
    out: dict[str, float] = {}
    with simulate((c.dp, c.tp), ("dp", "tp"), ranks="fake", device="meta"):
        start, cpu = time.perf_counter(), time.process_time()
        typed_model = build(c, typed=True)
        train_step(typed_model, c, typed=True)
        out["cold"], out["cold_cpu"] = time.perf_counter() - start, time.process_time() - cpu
        plain_model = build(c, typed=False)
        train_step(plain_model, c, typed=False)
        runs: dict[str, list[float]] = {"typed": [], "untyped": []}
        for _ in range(repeat):
            for name, model, typed in (("typed", typed_model, True), ("untyped", plain_model, False)):
                start = time.process_time()
                train_step(model, c, typed=typed)
                runs[name].append(time.process_time() - start)
    out.update({name: statistics.median(v) for name, v in runs.items()})
    return out


def one(shape: str, dp: int, tp: int, repeat: int) -> None:
    """Measure one configuration and print its row's numbers (run in a fresh process by main)."""
    c = dataclasses.replace(SHAPES[shape], dp=dp, tp=tp)
    r = measure(c, repeat)
    print(f"{r['cold']:.3f} {r['cold_cpu']:.3f} {r['typed']:.3f} {r['untyped']:.3f}")


def main() -> None:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=sorted(SHAPES))
    parser.add_argument("--one", nargs=3, metavar=("SHAPE", "DP", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one[0], int(args.one[1]), int(args.one[2]), args.repeat)
        return
    table = Table(title="one training step (forward + backward), meta device, fake process group")
    for col in ("shape", "mesh", "cold wall s", "cold cpu s", "warm typed cpu s", "warm untyped cpu s", "typed / untyped"):
        table.add_column(col, justify="right")
    jobs = [(s, dp, tp) for s in SHAPES if args.only in (None, s) for dp, tp in MESHES]
    for shape, dp, tp in track(jobs, description="measuring (a fresh process each)"):
        cmd = [sys.executable, __file__, "--repeat", str(args.repeat), "--one", shape, str(dp), str(tp)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        cold, cold_cpu, typed, untyped = map(float, out.split())
        table.add_row(shape, f"dp={dp} x tp={tp}", f"{cold:.2f}", f"{cold_cpu:.2f}", f"{typed:.3f}", f"{untyped:.3f}",
                      f"{typed / untyped:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
