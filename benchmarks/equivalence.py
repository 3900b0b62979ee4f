"""One ``check_equivalence`` of the 2-layer GPT (hidden 64) on 4 simulated ranks, against the two steps bare.

Run: python benchmarks/equivalence.py [--repeat N] [--hidden H] [--dtype float64|float32]

"check" is ``check_equivalence`` of examples/check_equivalence.py's GPT (dp=2 x tp=2, no bug): the
reference built and stepped on a one-device mesh, the parallel model built, loaded from it and
stepped on the simulated mesh, every module output, the loss, the gradients and the updated
weights recorded and compared. "bare" is the same two builds and steps with nothing recorded: one
``simulate`` of each mesh, ``build``, the step inside ``spmd.typecheck()`` (below float64 the check
also runs the reference in float64, so bare runs it too). Runs alternate (bare, check, bare, ...)
so that a noisy shared machine slows both alike; the table shows medians, wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

import spmd_types as spmd
from spmd_types.testing import simulate

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "check_equivalence.py"


def _example():
    spec = importlib.util.spec_from_file_location("check_equivalence_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bare(gpt, hidden: int, dtype: torch.dtype) -> None:
    """The runs check_equivalence makes, with nothing recorded, loaded or compared."""
    runs = [((1, 1), dtype), ((2, 2), dtype)] + ([((1, 1), torch.float64)] if dtype != torch.float64 else [])
    batch = gpt.make_batch()
    before = torch.get_default_dtype()
    for shape, run_dtype in runs:
        torch.set_default_dtype(run_dtype)
        try:
            with simulate(shape, ("dp", "tp"), ranks="local", device="cpu") as mesh:
                with spmd.typecheck():
                    model = gpt.GPT(mesh.size(1), False, hidden)
                    pieces = {}
                    for key, (full, types) in batch.items():
                        n = mesh.size(0)
                        pieces[key] = spmd.assert_type(_per_dp_rank(full, n), types)
                    gpt.train_step(model, pieces, mesh)
        finally:
            torch.set_default_dtype(before)


def _per_dp_rank(full: torch.Tensor, dp: int) -> torch.Tensor:
    from spmd_types.testing import per_rank

    rows = full.shape[0] // dp
    return per_rank(lambda r: full[(r // 2 if dp > 1 else 0) * rows:][:rows].clone())


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gpt = _example()
    gpt.check("none", hidden=args.hidden, dtype=dtype)  # warm-up: imports, caches
    bare(gpt, args.hidden, dtype)
    times: dict[str, list[tuple[float, float]]] = {"bare": [], "check": []}
    for _ in range(args.repeat):
        times["bare"].append(_timed(lambda: bare(gpt, args.hidden, dtype)))
        times["check"].append(_timed(lambda: gpt.check("none", hidden=args.hidden, dtype=dtype)))
    from rich.console import Console
    from rich.table import Table

    console = Console(width=100)
    console.print(f"check_equivalence, 2-layer GPT (hidden {args.hidden}), dp=2 x tp=2 simulated, {args.dtype}, "
                  f"median of {args.repeat}")
    table = Table()
    for col in ("", "wall s", "cpu s"):
        table.add_column(col, justify="right")
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    table.add_row("bare: the steps alone", f"{med['bare'][0]:.2f}", f"{med['bare'][1]:.2f}")
    table.add_row("check_equivalence", f"{med['check'][0]:.2f}", f"{med['check'][1]:.2f}")
    table.add_row("overhead (check / bare)", f"{med['check'][0] / med['bare'][0]:.2f}x",
                  f"{med['check'][1] / med['bare'][1]:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
