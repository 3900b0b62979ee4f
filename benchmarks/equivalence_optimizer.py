"""The optimizer-step table of docs/equivalence.md: how far a learning rate divided by tp shows, and correct steps.

Run: PYTHONPATH=. python benchmarks/equivalence_optimizer.py [--models mlp,embedding,llama3] [--dtypes float32,float64]

Each row checks one optimizer step at lr 1e-4 twice with ``check_equivalence``: with the planted bug (the
sharded weights' learning rate divided by tp, an optimizer configured for the whole model applied to
shards) and without it. It prints the bug's margin (the smallest error / tolerance over the diverging
values), the update that sets it, and the correct step's false-alarm margin (the smallest tolerance /
error over every compared value) with the value that sets it. The models are the tests': the MLP of
``tests/test_equivalence_optimizer.py`` (dp=2 x tp=2, AdamW and SGD), its embedding whose batch reaches 11
of 64 rows (the embedding's learning rate alone divided by tp), and torchtitan's llama3 at tp=2 through
``tests/_equivalence_torchtitan.py`` (AdamW, the loss in float32 as torchtitan computes it).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _check(model: str, optimizer: str, dtype, bug: bool):
    if model == "mlp":
        import test_equivalence_optimizer as T

        return T._check(optimizer, 1e-4, dtype, lr_over_tp=bug)
    if model == "embedding":
        import test_equivalence_optimizer as T

        return T._check_embedding(dtype, lr_over_tp=bug)
    import _equivalence_torchtitan as E
    from test_torchtitan_equivalence import _adamw, _check

    return _check(E.Options(model="llama3", lr=1e-4, optimizer=_adamw(lr_over_tp=bug)), (1, 2), dtype)


def row(model: str, optimizer: str, dtype_name: str) -> tuple[str, ...]:
    import torch

    dtype = getattr(torch, dtype_name)
    bug = _check(model, optimizer, dtype, bug=True)
    if bug.divergences:
        worst = min(bug.divergences, key=lambda d: d.max_abs_error / d.tolerance)
        caught = f"{worst.max_abs_error / worst.tolerance:.3g} ({worst.kind} {worst.name})"
    else:
        skipped = [n.name for n in bug.not_compared if n.kind == "update"]
        plural = "s" if len(skipped) != 1 else ""
        caught = f"not caught ({len(skipped)} update{plural} not compared)" if skipped else "not caught"
    ok = _check(model, optimizer, dtype, bug=False)
    closest = min(ok.compared, key=lambda c: c.tolerance / c.max_abs_error if c.max_abs_error else math.inf)
    margin = closest.tolerance / closest.max_abs_error if closest.max_abs_error else math.inf
    correct = f"{'ok' if ok.ok else 'DIVERGED'}, {margin:.3g} ({closest.kind} {closest.name})"
    return model, optimizer, dtype_name, caught, correct


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,embedding,llama3")
    parser.add_argument("--dtypes", default="float32,float64")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    header = ("model", "optimizer", "dtype", "bug: margin (where)", "correct step: false-alarm margin (where)")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for model in args.models.split(","):
        for optimizer in ("adamw", "sgd") if model == "mlp" else ("adamw",):
            for dtype in args.dtypes.split(","):
                print("| " + " | ".join(row(model, optimizer, dtype)) + " |", flush=True)


if __name__ == "__main__":
    main()
