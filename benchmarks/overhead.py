"""Microseconds per op for plain torch, erased, typed, a minimal tagged subclass, and DTensor.

Run: python benchmarks/overhead.py [--repeat N]

All rows are measured in one run, interleaved, on a fake process group, so
ratios between rows are meaningful even on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd


class Tagged(torch.Tensor):
    """The floor for any subclass design: carries a dict, re-wraps outputs, checks nothing."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        meta = next(a.meta for a in args if isinstance(a, Tagged))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not isinstance(out, Tagged):
            out = out.as_subclass(Tagged)
            out.meta = dict(meta)
        return out


def tagged(t: torch.Tensor) -> Tagged:
    out = t.as_subclass(Tagged)
    out.meta = {"dp": "V", "tp": "R"}
    return out


def mlp(x, w1, w2, b1, g):
    """A 12-op MLP forward: norm, linear, act, linear, residual, reshapes, reduction over the hidden dim.

    Shapes come from the tensors themselves, so the same code runs on local shards and on DTensor.
    """
    h = F.layer_norm(x, (x.shape[-1],), g)
    h = F.linear(h, w1, b1)
    h = F.gelu(h)
    h = h * 0.5
    h = F.linear(h, w2)
    h = h + x
    shape = h.shape
    h = h.reshape(-1)
    h = h.view(shape)
    h = h.transpose(0, 1)
    h = h.contiguous()
    h = h.float()
    return h.sum(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    w1, w2, b1, g = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4), torch.randn(4)
    act = {"dp": spmd.V, "tp": spmd.R}
    par = {"dp": spmd.R, "tp": spmd.R}

    ctx_mesh = spmd.set_current_mesh(mesh)
    ctx_mesh.__enter__()
    with spmd.typecheck():
        ta, tb = spmd.assert_type(a, act), spmd.assert_type(b, act)
        tw1, tw2, tb1, tg = (spmd.assert_type(t, par) for t in (w1, w2, b1, g))
    ga, gb = tagged(a), tagged(b)
    gw1, gw2, gb1, gg = (tagged(t) for t in (w1, w2, b1, g))
    da, db = (DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False) for t in (a, b))
    dw1, dw2, db1, dg = (DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False) for t in (w1, w2, b1, g))

    cases = {
        "mul": {
            "plain torch": lambda: torch.mul(a, b),
            "erased": lambda: torch.mul(spmd.assert_type(a, act), spmd.assert_type(b, act)),
            "typed": lambda: torch.mul(ta, tb),
            "tagged floor": lambda: torch.mul(ga, gb),
            "DTensor": lambda: torch.mul(da, db),
        },
        "matmul": {
            "plain torch": lambda: torch.matmul(a, b),
            "erased": lambda: torch.matmul(spmd.assert_type(a, act), spmd.assert_type(b, act)),
            "typed": lambda: torch.matmul(ta, tb),
            "tagged floor": lambda: torch.matmul(ga, gb),
            "DTensor": lambda: torch.matmul(da, db),
        },
        "add": {
            "plain torch": lambda: a + b,
            "erased": lambda: spmd.assert_type(a, act) + spmd.assert_type(b, act),
            "typed": lambda: ta + tb,
            "tagged floor": lambda: ga + gb,
            "DTensor": lambda: da + db,
        },
        "mlp (12 ops)": {
            "plain torch": lambda: mlp(a, w1, w2, b1, g),
            "erased": lambda: mlp(spmd.assert_type(a, act), w1, w2, b1, g),
            "typed": lambda: mlp(ta, tw1, tw2, tb1, tg),
            "tagged floor": lambda: mlp(ga, gw1, gw2, gb1, gg),
            "DTensor": lambda: mlp(da, dw1, dw2, db1, dg),
        },
    }
    erased_assert = {"assert_type (erased)": lambda: spmd.assert_type(a, act)}

    def measure(fn, checking: bool) -> float:
        if checking:
            with spmd.typecheck():
                fn()
                times = timeit.repeat(fn, number=args.number, repeat=args.repeat)
        else:
            fn()
            times = timeit.repeat(fn, number=args.number, repeat=args.repeat)
        return statistics.median(times) / args.number * 1e6

    variants = ["plain torch", "erased", "typed", "tagged floor", "DTensor"]
    print(f"microseconds per call (median of {args.repeat} x {args.number}); torch {torch.__version__}")
    print(f"{'op':<14}" + "".join(f"{v:>14}" for v in variants) + f"{'typed/floor':>13}{'typed/DTensor':>15}")
    for op, fns in cases.items():
        row = {v: measure(fns[v], checking=(v == "typed")) for v in variants}
        print(
            f"{op:<14}" + "".join(f"{row[v]:>14.2f}" for v in variants)
            + f"{row['typed'] / row['tagged floor']:>13.2f}{row['typed'] / row['DTensor']:>15.2f}"
        )
    for name, fn in erased_assert.items():
        print(f"{name:<26}{measure(fn, checking=False):>8.3f} us")
    ctx_mesh.__exit__(None, None, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
