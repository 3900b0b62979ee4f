"""A compiled typed training step against the same compiled step with checking off, and eager (issue 23, item 2).

Run: python benchmarks/compile.py [--backend aot_eager|inductor] [--rounds N] [--steps N] [--layers N] [--dim N]

The step is a tensor-parallel MLP stack (norm, convert I -> R, column linear, gelu, row linear, all_reduce
V -> I, residual) on a fake process group of 2 ranks, forward and backward. Variants, measured in one run,
interleaved round by round, in CPU time (medians):

* compiled typed: ``torch.compile(step)`` called inside ``spmd.typecheck()`` on typed inputs (the graph was
  checked once, when it compiled);
* compiled erased: the same code compiled and called outside ``typecheck()`` on plain tensors;
* eager typed / eager erased: the step uncompiled, with and without checking.

Per compile: the CPU time of the first call (trace, check, compile, run), typed and erased, and the time the
checker took inside it (``spmd_types._compile.backend.CHECKS``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd
from spmd_types import I, R, V
from spmd_types._compile.backend import CHECKS

SEQ = 64


def step(x, weights):
    """Forward and loss of the MLP stack; ``weights`` is a list of (norm, w1, w2) per layer."""
    for g, w1, w2 in weights:
        h = F.rms_norm(x, (x.shape[-1],), g)
        h = F.gelu(F.linear(spmd.convert(h, "tp", src=I, dst=R), w1))
        x = x + spmd.all_reduce(F.linear(h, w2), "tp", src=V, dst=I)
    return x.square().mean()


def make(layers: int, dim: int, typed: bool):
    torch.manual_seed(0)
    x = torch.randn(SEQ, dim)
    weights = [(torch.ones(dim, requires_grad=True), (torch.randn(2 * dim, dim) / dim ** 0.5).requires_grad_(),
                (torch.randn(dim, 2 * dim) / dim ** 0.5).requires_grad_()) for _ in range(layers)]
    if typed:
        x = spmd.assert_type(x, {"tp": I})
        for g, w1, w2 in weights:
            spmd.assert_type(g, {"tp": I})
            spmd.assert_type(w1, {"tp": V})
            spmd.assert_type(w2, {"tp": V})
    return x, weights


def run_step(fn, x, weights) -> None:
    loss = fn(x, weights)
    loss.backward()
    for layer in weights:
        for p in layer:
            p.grad = None


VARIANTS = ("compiled typed", "compiled erased", "eager typed", "eager erased")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch._dynamo.config.cache_size_limit = 64
    with spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            typed = make(args.layers, args.dim, True)
        erased = make(args.layers, args.dim, False)
        compiled = torch.compile(step, backend=args.backend, fullgraph=True)

        compile_cpu = {}
        start, checks = time.process_time(), len(CHECKS)
        with spmd.typecheck():
            run_step(compiled, *typed)
        compile_cpu["typed"] = time.process_time() - start
        check_cpu = sum(s for _, s in CHECKS[checks:])
        start = time.process_time()
        run_step(compiled, *erased)
        compile_cpu["erased"] = time.process_time() - start

        def measure(variant: str) -> float:
            fn = compiled if variant.startswith("compiled") else step
            inputs = typed if variant.endswith("typed") else erased
            checking = spmd.typecheck() if variant.endswith("typed") else _nothing()
            with checking:
                run_step(fn, *inputs)  # warm
                begin = time.process_time()
                for _ in range(args.steps):
                    run_step(fn, *inputs)
                return (time.process_time() - begin) / args.steps

        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                samples[v].append(measure(v))

        hand_over = _hand_over(args)

    med = {v: statistics.median(s) for v, s in samples.items()}
    base = samples["compiled erased"]
    # paired: each round's ratio to the compiled erased step measured beside it, then the median of the rounds
    paired = {v: statistics.median(a / b for a, b in zip(s, base)) for v, s in samples.items()}
    print(f"backend={args.backend} layers={args.layers} dim={args.dim} seq={SEQ} "
          f"rounds={args.rounds} steps/round={args.steps}; torch {torch.__version__}")
    print(f"{'variant':<18}{'ms/step (CPU)':>14}{'vs compiled erased (paired)':>29}")
    for v in VARIANTS:
        print(f"{v:<18}{med[v] * 1e3:>14.3f}{paired[v]:>28.3f}x")
    print()
    print("the fixed cost per compiled graph call (a one-op graph: x * w, 3 typed inputs), us per call (CPU):")
    for v, us in hand_over.items():
        print(f"  {v:<16}{us:>8.1f}")
    print()
    print(f"{'first call (compile)':<22}{'CPU s':>8}")
    print(f"{'  typed':<22}{compile_cpu['typed']:>8.2f}   of which checking {check_cpu * 1e3:.1f} ms "
          f"({len(CHECKS) - 0} graphs checked in this process)")
    print(f"{'  erased':<22}{compile_cpu['erased']:>8.2f}")


def tiny(x, w, b):
    return x * w + b


def _hand_over(args) -> dict[str, float]:
    """Median us per call of a compiled one-op graph, typed (checked) and erased: the runner's own cost."""
    torch.manual_seed(0)
    plain = [torch.randn(8, 8) for _ in range(3)]
    with spmd.typecheck():
        typed = [spmd.assert_type(t.clone(), {"tp": V}) for t in plain]
    fn = torch.compile(tiny, backend=args.backend, fullgraph=True)
    with spmd.typecheck():
        fn(*typed)
    fn(*plain)
    n = 2000
    out: dict[str, list[float]] = {"compiled typed": [], "compiled erased": []}
    for _ in range(args.rounds):
        for v, inputs, checking in (("compiled typed", typed, True), ("compiled erased", plain, False)):
            with spmd.typecheck() if checking else _nothing():
                begin = time.process_time()
                for _ in range(n):
                    fn(*inputs)
                out[v].append((time.process_time() - begin) / n * 1e6)
    return {v: statistics.median(s) for v, s in out.items()}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
