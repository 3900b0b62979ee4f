"""Megatron-core and spmd_types, measured side by side (issue 7).

Run: python benchmarks/megatron.py [--tables abc]   (needs megatron-core; prints three tables)

(a) Typecheck cost: CPU seconds for one forward+backward of a Megatron-core
    GPTModel (local spec, tp=2, dp=2, sequence parallel) on a fake process
    group, typed (``spmd.typecheck()`` with the adapter's registrations, the
    parameters typed once before the loop as in a training loop; and again
    with ``type_parameters`` every step) vs untyped (a second model built
    alike, which typing never touched) and the floor (a third, run as the
    least subclass a typed tensor must be: what no checker can avoid);
    medians of repeats, interleaved; ratios paired within a repeat.
(b) Communication: each erased spmd call (plain tensors, outside
    ``typecheck()``) against the Megatron-core mapping that does the same
    work, forward+backward, on 2 and 4 gloo processes, a small (4 KB) and a
    1 MB tensor; the bare ``torch.distributed`` calls doing the same
    collectives are the floor. µs per forward+backward, median of repeats,
    the three variants interleaved inside each repeat.
(c) The floor: the same erased calls against the Megatron mappings on a
    fake process group (collectives move nothing), the axis named and given
    as the process group; µs of CPU time per forward+backward. The goal is
    1.05x Megatron's mapping for every call.

``--tables ac`` prints only (a) and (c); (b) starts gloo processes and takes minutes. ``REPEATS=N`` sets (a)'s
repeats (15), ``HIDDEN=N`` its model's hidden size (128: kernels of a few µs, as cheap as the subclass dispatch
itself; the typed step's cost is per op, so the ratio falls as the kernels grow).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types
import warnings

# This file is named megatron.py: drop its own folder from the import path, or it would shadow the package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import spmd_types as spmd  # noqa: E402

I, P, R, S = spmd.I, spmd.P, spmd.R, spmd.S
SIZES = {"4 KB": 1024, "1 MB": 256 * 1024}  # float32 elements
REPEATS, CALLS = 9, {"4 KB": 40, "1 MB": 10}


def _cpu() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="": contextlib.nullcontext()


# ---------------------------------------------------------------------------
# (a) typecheck cost on a fake process group


def _sibling(name: str) -> types.ModuleType:
    """A module of this folder, loaded by its path (the folder is off ``sys.path``: see above)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def typecheck_cost(repeats: int = 15, hidden: int = 128) -> dict[str, list[float]]:
    """CPU seconds of one forward+backward per variant and repeat (the order rotating between repeats).

    Models built alike: typing is in place (``type_parameters`` and ``assert_type`` give the parameters
    and tokens their types), so the untyped run gets a model and tokens that typing never touched. "typed" is
    the step a training loop runs: the parameters typed once before the loop (they keep their types), the
    tokens asserted and the forward and backward checked in ``spmd.typecheck()`` every step; "typed
    re-typing" also calls ``type_parameters`` inside every step (each parameter re-asserted). "floor" is the
    untyped model with its parameters and tokens the least subclass a typed tensor must be
    (``benchmarks/subclass_floor.py``): what any checker built on a ``torch.Tensor`` subclass pays.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, os.path.join(_HERE, "..", "examples"))
    import megatron_gpt
    from megatron.core import parallel_state as ps

    from spmd_types import megatron as spmd_megatron

    floor = _sibling("subclass_floor")
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    spmd_megatron.register()
    models = {}
    for name in ("untyped", "floor", "typed"):
        torch.manual_seed(0)
        models[name] = megatron_gpt.build(2, True, layers=4, hidden=hidden, heads=8)[1]
    floor.floor_parameters(models["floor"])
    models["typed re-typing"] = models["typed"]
    seq, vocab = megatron_gpt.SEQ, megatron_gpt.VOCAB
    tokens = torch.randint(0, vocab, (2, seq))
    positions = torch.arange(seq).expand(2, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
        spmd_megatron.type_parameters(models["typed"])

    def untyped() -> None:
        models["untyped"](tokens, positions, mask, labels=tokens).sum().backward()

    def floor_step() -> None:
        t, p = floor.as_floor(tokens.clone()), floor.as_floor(positions.clone())
        models["floor"](t, p, mask, labels=t).sum().backward()

    def typed(retype: bool = False) -> None:
        model = models["typed"]
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
            if retype:
                spmd_megatron.type_parameters(model)
            t = spmd.assert_type(tokens.clone(), {"dp": spmd.V, "tp": I})
            p = spmd.assert_type(positions.clone(), {"dp": spmd.V, "tp": I})
            model(t, p, mask, labels=t).sum().backward()

    variants = (("untyped", untyped), ("floor", floor_step), ("typed", typed),
                ("typed re-typing", lambda: typed(retype=True)))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _, fn in variants:  # warm-up
        fn()
    for i in range(repeats):
        for name, fn in variants[i % 4:] + variants[:i % 4]:  # the order rotates
            models[name].zero_grad(set_to_none=True)
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return times


# ---------------------------------------------------------------------------
# (b) erased spmd vs Megatron mappings vs bare torch.distributed, on gloo


def _pairs(group: dist.ProcessGroup, n: int, world: int) -> dict[str, dict[str, object]]:
    """{row: {variant: fn(x) -> output}}; every variant does the same collectives forward and backward."""
    from megatron.core.tensor_parallel import mappings as m

    def bare_ar(x):
        y = x.detach().clone()
        dist.all_reduce(y, group=group)
        return y

    def bare_ag(x):
        out = torch.empty((x.shape[0] * world, *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.detach().contiguous(), group=group)
        return out

    def bare_rs(x):
        out = torch.empty((x.shape[0] // world, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.detach().contiguous(), group=group)
        return out

    return {
        "reduce_from (all-reduce | -)": {
            "megatron": lambda x: m.reduce_from_tensor_model_parallel_region(x, group),
            "spmd": lambda x: spmd.all_reduce(x, "tp", src=P, dst=I),
            "bare": lambda x: bare_ar(x),
        },
        "copy_to (- | all-reduce)": {
            "megatron": lambda x: m.copy_to_tensor_model_parallel_region(x, group),
            "spmd": lambda x: spmd.reinterpret(x, "tp", src=I, dst=R),
            "bare": lambda x: x,  # backward: bare_ar below
        },
        "gather_from_sp (all-gather | reduce-scatter)": {
            "megatron": lambda x: m.gather_from_sequence_parallel_region(x, True, group),
            "spmd": lambda x: spmd.all_gather(x, "tp", src=S(0), dst=R),
            "bare": lambda x: bare_ag(x),
        },
        "reduce_scatter_to_sp (reduce-scatter | all-gather)": {
            "megatron": lambda x: m.reduce_scatter_to_sequence_parallel_region(x, group),
            "spmd": lambda x: spmd.reduce_scatter(x, "tp", src=P, dst=S(0)),
            "bare": lambda x: bare_rs(x),
        },
    }


_BARE_BACKWARD = {  # what the backward of each row communicates, done by hand for the "bare" variant
    "reduce_from (all-reduce | -)": None,
    "copy_to (- | all-reduce)": "all_reduce",
    "gather_from_sp (all-gather | reduce-scatter)": "reduce_scatter",
    "reduce_scatter_to_sp (reduce-scatter | all-gather)": "all_gather",
}


def _step(variant: str, row: str, fn, x: torch.Tensor, g: torch.Tensor, group, world: int) -> None:
    if variant == "bare":
        fn(x)
        kind = _BARE_BACKWARD[row]
        if kind == "all_reduce":
            y = g.clone()
            dist.all_reduce(y, group=group)
        elif kind == "reduce_scatter":
            out = torch.empty((g.shape[0] // world, *g.shape[1:]))
            dist.reduce_scatter_tensor(out, g, group=group)
        elif kind == "all_gather":
            out = torch.empty((g.shape[0] * world, *g.shape[1:]))
            dist.all_gather_into_tensor(out, g, group=group)
        return
    y = fn(x)
    y.backward(g)


def _worker(rank: int, world: int, init: str, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _cpu()
    with contextlib.suppress(Exception):
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    rows = []
    with spmd.set_current_mesh({"tp": group}):
        for size_name, n in SIZES.items():
            cols = n // 4  # 4 rows: the tensor holds n float32 elements (world x that for a reduce-scatter input)
            for row, variants in _pairs(group, n, world).items():
                shape_in = (world * 4, cols) if "reduce_scatter" in row.split(" ")[0] else (4, cols)
                x = torch.randn(shape_in, requires_grad=True)
                y0 = variants["megatron"](x)
                g = torch.randn_like(y0.detach())
                samples = {v: [] for v in variants}
                for _ in range(REPEATS):
                    for v, fn in variants.items():
                        dist.barrier(group)
                        start = time.perf_counter()
                        for _ in range(CALLS[size_name]):
                            _step(v, row, fn, x, g.clone(), group, world)
                        samples[v].append((time.perf_counter() - start) / CALLS[size_name] * 1e6)
                med = {v: statistics.median(s) for v, s in samples.items()}
                rows.append((world, size_name, row, med["megatron"], med["spmd"], med["bare"]))
    if rank == 0:
        with open(out_path, "a") as f:
            for r in rows:
                f.write("\t".join(str(c) for c in r) + "\n")
    dist.destroy_process_group()


def communication(worlds=(2, 4)) -> list[tuple]:
    import megatron.core.tensor_parallel  # noqa: F401  (imported once, inherited by the forked workers)

    out = tempfile.mkdtemp()
    path = os.path.join(out, "rows.tsv")
    for world in worlds:
        init = "file://" + os.path.join(out, f"store{world}")
        ctx = mp.start_processes(_worker, args=(world, init, path), nprocs=world, start_method="fork", join=False)
        while not ctx.join(timeout=1):
            pass
    rows = []
    with open(path) as f:
        for line in f:
            w, size, row, a, b, c = line.rstrip("\n").split("\t")
            rows.append((int(w), size, row, float(a), float(b), float(c)))
    return rows


# ---------------------------------------------------------------------------
# (c) erased spmd vs Megatron mappings on a fake process group: the Python and autograd floor


def _floor_rows(group: dist.ProcessGroup) -> dict[str, tuple[tuple[int, int], dict[str, object]]]:
    """{row: (input shape, {variant: fn(x) -> output})}: each erased spmd call beside the Megatron mapping
    doing the same work, with the axis named ("tp") and given as the process group."""
    from megatron.core.tensor_parallel import mappings as m

    def both(fn):
        return {"spmd 'tp'": lambda x: fn(x, "tp"), "spmd group": lambda x: fn(x, group)}

    return {
        "reduce_from | all_reduce(P->I)": ((4, 256), {
            "megatron": lambda x: m.reduce_from_tensor_model_parallel_region(x, group),
            **both(lambda x, a: spmd.all_reduce(x, a, src=P, dst=I))}),
        "copy_to | reinterpret(I->R)": ((4, 256), {
            "megatron": lambda x: m.copy_to_tensor_model_parallel_region(x, group),
            **both(lambda x, a: spmd.reinterpret(x, a, src=I, dst=R))}),
        "copy_to | convert(I->R)": ((4, 256), {
            "megatron": lambda x: m.copy_to_tensor_model_parallel_region(x, group),
            **both(lambda x, a: spmd.convert(x, a, src=I, dst=R))}),
        "gather_from_sp | all_gather(S(0)->R)": ((4, 256), {
            "megatron": lambda x: m.gather_from_sequence_parallel_region(x, True, group),
            **both(lambda x, a: spmd.all_gather(x, a, src=S(0), dst=R))}),
        "reduce_scatter_to_sp | reduce_scatter(P->S(0))": ((8, 256), {
            "megatron": lambda x: m.reduce_scatter_to_sequence_parallel_region(x, group),
            **both(lambda x, a: spmd.reduce_scatter(x, a, src=P, dst=S(0)))}),
    }


def overhead_on_fake_pg(calls: int = 200, repeats: int = 21) -> list[tuple]:
    """Each erased spmd call against the Megatron mapping on a fake process group of 2 ranks (4 KB tensors):
    the collectives move nothing, what is left is each variant's Python and autograd cost. µs of CPU time
    (``time.process_time``: time this process ran, which a shared machine's other load disturbs less than
    wall time) per forward+backward, median of ``repeats``, the variants interleaved in each repeat."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    group = dist.new_group([0, 1])
    rows = []
    with spmd.set_current_mesh({"tp": group}):
        for row, (shape, variants) in _floor_rows(group).items():
            x = torch.randn(shape, requires_grad=True)
            g = torch.randn_like(variants["megatron"](x).detach())
            samples: dict[str, list[float]] = {v: [] for v in variants}
            for fn in variants.values():  # warm-up: an erased call's first run checks and remembers it
                fn(x).backward(g.clone())
            for _ in range(repeats):
                for v, fn in variants.items():
                    start = time.process_time()
                    for _ in range(calls):
                        fn(x).backward(g.clone())  # a copy: Megatron's copy_to all-reduces its gradient in place
                    samples[v].append((time.process_time() - start) / calls * 1e6)
            med = {v: statistics.median(s) for v, s in samples.items()}
            rows.append((row, med["megatron"], med["spmd 'tp'"], med["spmd group"]))
    dist.destroy_process_group()
    return rows


def _floor_table(rows: list[tuple]) -> None:
    print(f"    {'Megatron mapping | erased spmd call':46} {'megatron':>9} {'spmd tp':>9} {'spmd pg':>9} "
          f"{'tp/meg':>7} {'pg/meg':>7}  goal <= 1.05")
    for row, meg, name, pg in rows:
        met = "met" if max(name, pg) / meg <= 1.05 else "not met"
        print(f"    {row:46} {meg:9.1f} {name:9.1f} {pg:9.1f} {name / meg:7.2f} {pg / meg:7.2f}  {met}")


def _table(rows: list[tuple]) -> None:
    print(f"    {'ranks':>5} {'size':>5}  {'row (forward | backward)':52} {'megatron':>9} {'spmd':>9} {'bare':>9} "
          f"{'spmd/megatron':>13}")
    for world, size, row, meg, sp, bare in rows:
        print(f"    {world:>5} {size:>5}  {row:52} {meg:9.0f} {sp:9.0f} {bare:9.0f} {sp / meg:13.2f}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", default="abc", help="which tables to print, e.g. 'ac' (b runs gloo: minutes)")
    tables = parser.parse_args().tables
    warnings.filterwarnings("ignore")
    _cpu()
    if "a" in tables:
        repeats, hidden = int(os.environ.get("REPEATS", "15")), int(os.environ.get("HIDDEN", "128"))
        times = typecheck_cost(repeats, hidden)
        floor = _sibling("subclass_floor")
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        print(f"(a) GPTModel (4 layers, hidden {hidden}, tp=2, dp=2, SP) one forward+backward on a fake process group, "
              f"CPU ms, median of {repeats}, rotating order; torch {torch.__version__}")
        print("    floor: the untyped model as the least subclass that keeps its class and one attribute through ops "
              "(benchmarks/subclass_floor.py); ratios: over the untyped step of the same repeat, median [quartiles]")
        for name in ("untyped", "floor", "typed", "typed re-typing"):
            ratio = "" if name == "untyped" else f"   / untyped {floor.paired_ratio(times, name)}"
            print(f"    {name:<16} {med[name]:8.1f} ms{ratio}")
        print()
    if "b" in tables:
        print("(b) µs per forward+backward (median of repeats); erased spmd vs the Megatron-core mapping; bare "
              "torch.distributed floor")
        _table(communication())
        print()
    if "c" in tables:
        print("(c) erased spmd calls vs the Megatron mapping on a fake process group (collectives free): Python + "
              "autograd, µs CPU per forward+backward (4 KB), median of 21 x 200")
        _floor_table(overhead_on_fake_pg())


if __name__ == "__main__":
    main()
