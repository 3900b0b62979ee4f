"""This package and its peer, meta-pytorch's ``spmd-types`` 0.2.3, side by side on one torchtitan step.

Run: python benchmarks/peer.py [--rounds N] [--steps K] [--case NAME] [--peer-dir DIR] [--ours DIR]

The peer is torchtitan 0.3.0's own ``spmd_types`` (the package called
``spmd-types`` on the package index). It is never a dependency of this project
and never committed: this script downloads the wheel with pip into a cache
folder (``--peer-dir``, default ``~/.cache/spmd_types_benchmarks/spmd-types-0.2.3``,
or ``$SPMD_PEER_DIR``) and installs it there with ``pip install --no-deps
--target``, then imports it from that folder only in a subprocess of its own.
Both packages answer ``import spmd_types``, so each run is a subprocess whose
``PYTHONPATH`` puts one of them first (the worker checks which one it got).

What is timed: one trainer step (forward, loss, backward) of torchtitan
0.3.0's llama3 debug model, one layer, as ``tests/_torchtitan_support.py``
builds it (its configs, ``parallelize_fn``, weight init, chunked loss and
``Trainer._forward_backward_body``), on rank 0 of a fake process group
(collectives move no data), dp=4 x tp=2 with sequence parallelism by default;
on torch 2.14 with torchtitan's own FSDP2 applied (``dp_mesh_dims``: FSDP reads
the parameters' spmd types), on torch 2.13 without it (it cannot take them).
"typed" has ``debug.spmd_typechecking`` on (the forward and loss inside
``spmd_types.checker.typecheck``), "erased" has it off: the same spmd calls,
run as plain PyTorch, as torchtitan runs them in production.

Each worker builds both models once, warms them up, then times ``--steps``
steps of each, alternating typed and erased; the parent alternates the two
packages' workers for ``--rounds`` rounds. The table gives medians of all
steps, in milliseconds of CPU time (``time.process_time`` of the worker, one
torch thread: on a shared machine the time others take from it does not
count), and the ratios the project aims at: typed ours /
typed peer <= 0.5, erased ours / erased peer <= 1.0, ours typed / ours erased
<= 1.2. Each ratio is also taken within every round (the two workers of a
round run back to back, so a machine that gets busier between rounds moves
both) and the verdict reads the median of those. A part that cannot run says
why in place of its number.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PEER = "spmd-types==0.2.3"
DEFAULT_CASE = "llama3 dp4 x tp2 (SP)"
GOALS = {"typed ours / typed peer": 0.5, "erased ours / erased peer": 1.0, "ours typed / ours erased": 1.2}


# ---------------------------------------------------------------------------
# the peer, installed into a side folder


def peer_dir(given: str | None) -> str:
    if given:
        return os.path.abspath(given)
    if os.environ.get("SPMD_PEER_DIR"):
        return os.path.abspath(os.environ["SPMD_PEER_DIR"])
    return os.path.join(os.path.expanduser("~"), ".cache", "spmd_types_benchmarks", "spmd-types-0.2.3")


def install_peer(folder: str) -> str:
    """The folder holding the peer's ``spmd_types`` (downloaded and installed there on first use)."""
    target = os.path.join(folder, "target")
    if os.path.exists(os.path.join(target, "spmd_types", "__init__.py")):
        return target
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as download:
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
        subprocess.run(pip + ["download", "--no-deps", PEER, "-d", download], check=True)
        wheels = glob.glob(os.path.join(download, "*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {PEER} gave {wheels or 'no wheel'}")
        subprocess.run(pip + ["install", "--no-deps", "--target", target, wheels[0]], check=True)
    return target


# ---------------------------------------------------------------------------
# one package, in its own process


def worker(which: str, expect: str, case_name: str, steps: int) -> dict:
    """Build the case typed and erased with whichever ``spmd_types`` is importable; time ``steps`` of each."""
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, TESTS)
    import torch

    import spmd_types

    found = os.path.abspath(spmd_types.__file__)
    if not found.startswith(os.path.abspath(expect) + os.sep):
        raise RuntimeError(f"{which}: imported spmd_types from {found}, expected under {expect}")
    torch.set_num_threads(1)
    import _torchtitan_support as tt

    c = tt.case(case_name)
    rows = c.dp * tt.LOCAL_BATCH
    result: dict = {"file": found, "times": {"typed": [], "erased": []}, "errors": {}, "loss": {}}
    with tt.environment("fake", c.world):
        built = {}
        for mode in ("typed", "erased"):
            try:
                _fresh_dtensor_caches()  # a second model gets its own meshes (FSDP checks its parameters' by identity)
                b = tt.build(c, checking=mode == "typed", world=c.world)
                for _ in range(2):  # warm-up
                    loss = _step(tt, b, rows)
                result["loss"][mode] = float(loss.detach())
                built[mode] = b
            except Exception as exc:  # reported in the table, in place of the number
                result["errors"][mode] = _why(exc)
        for i in range(steps):
            for mode in (("typed", "erased") if i % 2 == 0 else ("erased", "typed")):
                if mode not in built:
                    continue
                start = time.process_time()
                _step(tt, built[mode], rows)
                result["times"][mode].append(time.process_time() - start)
    return result


def _fresh_dtensor_caches() -> None:
    """DTensor's sharding caches key on meshes by value: clear them, so an equal mesh made again is not the old one."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # an older torch keeps no such cache
        return
    _clear_sharding_prop_cache()


def _step(tt, b, rows: int):
    b.model.zero_grad(set_to_none=True)
    return tt.train_step(b, "fake", rows)


def _why(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)
                  if "spmd_types" in f.filename or "torchtitan" in f.filename), "?")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__} at {where}: {text[:200]}"


def run_worker(which: str, path: str, case_name: str, steps: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([path, TESTS])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", which, "--expect", path, "--case", case_name,
           "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"times": {"typed": [], "erased": []}, "errors": {"typed": tail, "erased": tail}, "loss": {}}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------
# the table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--case", default=DEFAULT_CASE)
    parser.add_argument("--peer-dir", default=None)
    parser.add_argument("--ours", default=ROOT, help="the folder holding this package's spmd_types to time (another "
                        "checkout, e.g. before a change); default: this checkout")
    parser.add_argument("--worker", choices=("ours", "peer"))
    parser.add_argument("--expect", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.expect, args.case, args.steps)))
        return

    paths = {"ours": os.path.abspath(args.ours), "peer": install_peer(peer_dir(args.peer_dir))}
    merged = {w: {"times": {"typed": [], "erased": []}, "errors": {}, "loss": {}} for w in paths}
    per_round: list[dict[tuple[str, str], float]] = []  # each round's medians: the paired ratios
    for r in range(args.rounds):
        medians: dict[tuple[str, str], float] = {}
        for which in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
            got = run_worker(which, paths[which], args.case, args.steps)
            for mode in ("typed", "erased"):
                merged[which]["times"][mode] += got["times"][mode]
                if got["times"][mode]:
                    medians[which, mode] = statistics.median(got["times"][mode])
            merged[which]["errors"].update(got["errors"])
            merged[which]["loss"].update(got["loss"])
        per_round.append(medians)

    ms: dict[tuple[str, str], float | None] = {}
    import torch

    fsdp = "FSDP2 applied" if torch.__version__ >= "2.14" else "FSDP2 skipped (torch 2.13 cannot take typed parameters)"
    print(f"torchtitan 0.3.0 {args.case}, llama3 one layer, seq {16}, fake process group, rank 0, {fsdp}, torch "
          f"{torch.__version__}: one trainer step (forward + loss + backward), CPU ms, median of {args.rounds} x "
          f"{args.steps} steps per cell")
    print(f"    ours: {paths['ours']}; peer: meta-pytorch spmd-types 0.2.3 from {paths['peer']}")
    print(f"    {'package':8} {'mode':7} {'ms/step':>9}  {'loss':>8}  note")
    for which in ("ours", "peer"):
        for mode in ("typed", "erased"):
            times = merged[which]["times"][mode]
            error = merged[which]["errors"].get(mode)
            ms[which, mode] = statistics.median(times) * 1e3 if times else None
            loss = merged[which]["loss"].get(mode)
            shown = f"{ms[which, mode]:9.1f}" if ms[which, mode] is not None else f"{'-':>9}"
            loss_text = f"{loss:8.4f}" if loss is not None else f"{'-':>8}"
            print(f"    {which:8} {mode:7} {shown}  {loss_text}  {error or ''}")
    print()
    ratios = {
        "typed ours / typed peer": (("ours", "typed"), ("peer", "typed")),
        "erased ours / erased peer": (("ours", "erased"), ("peer", "erased")),
        "ours typed / ours erased": (("ours", "typed"), ("ours", "erased")),
    }
    print(f"    {'ratio':28} {'value':>6} {'paired':>7} {'rounds (min-max)':>17} {'goal':>7}")
    for name, (a, b) in ratios.items():
        if ms[a] is None or ms[b] is None:
            print(f"    {name:28} {'-':>6} {'-':>7} {'-':>17} {'<= ' + str(GOALS[name]):>7}  cannot be computed: a part did "
                  "not run")
            continue
        value = ms[a] / ms[b]
        # paired: the ratio within each round (the two workers ran back to back), median over rounds
        each = [m[a] / m[b] for m in per_round if a in m and b in m]
        paired = statistics.median(each)
        verdict = "met" if paired <= GOALS[name] else "not met"
        spread = f"{min(each):.2f}-{max(each):.2f}"
        print(f"    {name:28} {value:6.2f} {paired:7.2f} {spread:>17} {'<= ' + str(GOALS[name]):>7}  {verdict}")
    print("    value: ratio of the medians above; paired: median over rounds of each round's ratio (the verdict)")


if __name__ == "__main__":
    main()
