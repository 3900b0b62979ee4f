"""What a checked op costs, split into torch's subclass dispatch and this package's check (issue 22 item 7).

Run: python benchmarks/subclass_floor.py [--rounds N] [--length N]

One chain of small ops (``linear``, ``relu``, a multiply: three ops a link, with autograd recording) run on
four inputs, interleaved in every round, CPU time, medians over rounds:

* a plain tensor (the untyped step);
* a ``torch.Tensor`` subclass whose ``__torch_function__`` does the least any such subclass can: run the op
  with subclass dispatch off (the one C call LTensor uses) and give the result the subclass ("floor, class
  only");
* the same, also setting one attribute on the result, as a subclass carrying types must ("floor");
* an LTensor under ``spmd.typecheck()``: the floor plus this package's check (the cached rule answer).

"floor" minus "plain" is paid by any ``__torch_function__`` subclass: torch's C++ finding the override and
calling into Python, and the op's arguments parsed a second time. "LTensor" minus "floor" is this package's
share. A typed step's overhead is about (checked ops) x (LTensor - plain) plus its registered Functions.
(``benchmarks/overhead.py``'s "tagged floor" re-wraps each result with ``as_subclass``, a new Python object:
heavier than the floor here, which sets the result's class in place as LTensor does.)

``floor_parameters`` and ``as_floor`` run a whole model as the floor: ``benchmarks/megatron.py`` (a) and
``benchmarks/megatron_moe.py`` time their steps that way beside the untyped and the typed step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_types as spmd

# the one C call LTensor runs an op with: func(*args, **kwargs) with subclass dispatch off
_OFF_CALL = torch._C._disabled_torch_function_impl
_SEQUENCES = (tuple, list)


def _floor(name: str, with_attribute: bool) -> type:
    """The least a subclass that keeps its class through ops can do (and, ``with_attribute``, set one attribute on
    every result, where a typed subclass keeps its types). A result is of this class even when an operand is the
    parameter class below (``cls`` is then that class)."""

    def __torch_function__(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = _OFF_CALL(func, (), args, kwargs) if kwargs else _OFF_CALL(func, (), args)
        if type(out) is torch.Tensor:
            out.__class__ = floor
            if with_attribute:
                out._types = None
        elif type(out) in _SEQUENCES:  # split, topk, ...: each tensor in it
            for item in out:
                if type(item) is torch.Tensor:
                    item.__class__ = floor
                    if with_attribute:
                        item._types = None
        return out

    floor = type(name, (torch.Tensor,), {"__torch_function__": classmethod(__torch_function__)})
    return floor


ClassOnly = _floor("ClassOnly", with_attribute=False)
WithAttribute = _floor("WithAttribute", with_attribute=True)


class WithAttributeParameter(WithAttribute, torch.nn.Parameter):
    """A parameter of the floor class (as a typed parameter is an LTensor and a Parameter)."""


def as_floor(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a plain tensor) viewed as the floor class, with its one attribute."""
    out = t.as_subclass(WithAttribute)
    out._types = None
    return out


def floor_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its parameters made the floor's parameter class, in place (as typing a model is).

    Example::

        model = floor_parameters(build())
        model(as_floor(tokens)).sum().backward()   # the model run as the floor subclass
    """
    for p in model.parameters():
        p.__class__ = WithAttributeParameter
        p._types = None
    return model


def paired_ratio(times: dict[str, list[float]], name: str) -> str:
    """``name``'s time over the untyped step's in the same repeat (``times[name][i] / times["untyped"][i]``):
    the median and quartiles of those ratios. The machine's speed drifts between repeats more than within one."""
    ratios = [t / u for t, u in zip(times[name], times["untyped"])]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return f"{median:.2f} [{q1:.2f}-{q3:.2f}]"


def _chain(x: torch.Tensor, w: torch.Tensor, links: int) -> torch.Tensor:
    for _ in range(links):
        x = torch.nn.functional.linear(x, w).relu() * 0.5
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--length", type=int, default=200, help="links in the chain (three ops each)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    weights = {k: torch.randn(16, 16, requires_grad=True) for k in ("plain", "class", "attr", "typed")}
    ops = 3 * opts.length

    def run(name: str, make: Callable[[], torch.Tensor]) -> Callable[[], float]:
        def timed() -> float:
            x = make()
            start = time.process_time()
            _chain(x, weights[name], opts.length)
            return time.process_time() - start

        return timed

    times: dict[str, list[float]] = {"plain": [], "floor, class only": [], "floor": [], "LTensor": []}
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd.assert_type(weights["typed"], {"tp": spmd.R})
        variants = {
            "plain": run("plain", lambda: torch.randn(8, 16)),
            "floor, class only": run("class", lambda: torch.randn(8, 16).as_subclass(ClassOnly)),
            "floor": run("attr", lambda: torch.randn(8, 16).as_subclass(WithAttribute)),
            "LTensor": run("typed", lambda: spmd.assert_type(torch.randn(8, 16), {"tp": spmd.R})),
        }
        for fn in variants.values():  # warm-up (the typed variant fills its result cache)
            fn()
        names = list(variants)
        for r in range(opts.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:  # the order rotates
                times[name].append(variants[name]())
    plain = statistics.median(times["plain"]) / ops * 1e6
    print(f"a chain of {ops} ops (linear, relu, multiply), µs of CPU per op, median of {opts.rounds} rounds; "
          f"torch {torch.__version__}")
    print(f"    {'input':<20} {'µs/op':>7} {'over plain':>11}")
    for name, ts in times.items():
        per_op = statistics.median(ts) / ops * 1e6
        print(f"    {name:<20} {per_op:7.2f} {per_op - plain:11.2f}")


if __name__ == "__main__":
    main()
