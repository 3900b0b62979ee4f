"""Gradient types through Megatron-core's gradient buffers: ``spmd_megatron.track_grad_sync``.

Megatron's ``DistributedDataParallel`` accumulates each parameter's gradient
into ``param.main_grad``, a view of one flat buffer, and syncs the buffer with
raw in-place collectives (``finish_grad_sync``: all-reduce over dp;
``finalize_model_grads``: also all-reduce the sequence-parallel parameters'
gradients over tp, flattened into one tensor). Collectives on a flat buffer
carry no types, so this module keeps them:

* every ``main_grad`` becomes a typed view whose type is the gradient's
  (``backward_type`` of the parameter's: R on dp gives P);
* a dispatch mode watches the collectives; a sum over axis ``a`` that covers a
  parameter's ``main_grad`` (directly, or through a tensor flattened from it)
  turns its type from P to R on ``a``, and summing a gradient that is not P
  there (already summed, or a shard) is an error at that collective;
* the optimizer step then sees typed gradients: one still P (a forgotten sync)
  is rejected by the package's optimizer checks, naming the parameter.

Run the syncs outside ``spmd.typecheck()`` (Megatron's raw in-place all-reduce
would otherwise be refused as an in-place type change) and inside this
context manager; run the forward, backward and optimizer step inside
``typecheck()``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from ..._checker.tensor import make_typed
from ..._core.axes import MeshAxis, flatten, orthogonal, region_of_group
from ..._core.errors import Rejection, SpmdTypeError, user_source_line
from ..._core.types import P, R, TypeMap
from ..._guards.optim_checks import mark_grad
from ..._torch.private import TorchDispatchMode

__all__ = ["GradSyncTracker"]

_SUMS = {"allreduce_", "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
         "allreduce_coalesced_"}


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _tensors(e)]
    return []


def _is_sum(args: tuple) -> bool:
    """Whether a c10d reduction's ReduceOp (wherever it sits in the schema) is SUM or AVG."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                op = a.op()  # a boxed ReduceOp (a boxed ProcessGroup has no op())
            except (AttributeError, RuntimeError):
                continue
            return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    return True


def _group_of(args: tuple) -> Any:
    """The ProcessGroup of a c10d op (boxed as a ScriptObject at dispatch)."""
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
    return None


class GradSyncTracker(TorchDispatchMode):
    """Types Megatron's ``main_grad`` buffers and follows the collectives that sum them (see the module doc)."""

    def __init__(self, model: torch.nn.Module, mesh: dict[str, Any]) -> None:
        super().__init__()
        self.mesh = dict(mesh)
        self.params: dict[str, torch.nn.Parameter] = {}
        self.flattened: list[tuple[tuple[int, int], list[str]]] = []  # tensors flattened from main_grads
        for name, p in model.named_parameters():
            types = getattr(p, "_spmd_types", None)
            grad = getattr(p, "main_grad", None)
            if types is None or grad is None:
                continue
            typed = make_typed(grad, types.backward())
            mark_grad(typed, p)
            p.main_grad = typed
            self.params[name] = p

    def grad_type(self, name: str) -> dict[str, Any]:
        """The current type of parameter ``name``'s ``main_grad``, ``{axis: type}``."""
        return self.params[name].main_grad._spmd_types.as_dict()

    def reset(self) -> None:
        """Back to unsynced gradients (call after the optimizer step, before the next backward)."""
        for p in self.params.values():
            p.main_grad._spmd_types = p._spmd_types.backward()
        self.flattened.clear()

    def unsynced(self) -> dict[str, list[str]]:
        """``{name: [axes where the gradient is still P]}`` for every parameter with a pending sum."""
        out = {}
        for name, p in self.params.items():
            axes = [a for a, t in p.main_grad._spmd_types.items if t is P]
            if axes:
                out[name] = axes
        return out

    # -- the dispatch mode --------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" and name in _SUMS and _is_sum(args):
            self._summed(name, args)
        out = func(*args, **kwargs)
        if func.namespace == "aten" and name == "cat":
            self._flattened(_tensors(args[0]), out)
        return out

    def _flattened(self, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        names = [n for n, p in self.params.items()
                 if any(_overlaps(_span(p.main_grad), _span(t)) for t in inputs)]
        if names:
            self.flattened.append((_span(out), names))

    def _covered(self, t: torch.Tensor) -> list[str]:
        span = _span(t)
        names = [n for n, p in self.params.items() if _overlaps(_span(p.main_grad), span)]
        for fspan, fnames in self.flattened:
            if _overlaps(fspan, span):
                names.extend(n for n in fnames if n not in names)
        return names

    def _summed(self, op: str, args: tuple) -> None:
        group = _group_of(args[1:])
        if group is None:
            return
        region = region_of_group(group)
        for t in _tensors(args[0]):
            for name in self._covered(t):
                p = self.params[name]
                have = p.main_grad._spmd_types
                axes = _axes_in(have, region)
                if axes is None:
                    raise _not_an_axis(name, have, region)
                for axis in axes:
                    if have.get(axis) is not P:
                        raise _double_sum(name, axis, have)
                    have = have.replace(axis, R)
                p.main_grad._spmd_types = have


def _axes_in(types: TypeMap, region: MeshAxis) -> tuple[str, ...] | None:
    """The axes of the gradient's own mesh (dense or expert) a group over ``region`` sums over; None if no
    set of them flattens to it. A group of one rank sums over none."""
    if region.size() == 1:
        return ()
    pairs = types.space.pairs if types.space is not None else ()
    for k in range(1, len(pairs) + 1):
        for chosen in itertools.combinations(pairs, k):
            regions = [r for _, r in chosen]
            if orthogonal(regions) and flatten(regions) == region:
                return tuple(n for n, _ in chosen)
    return None


def _not_an_axis(name: str, have: TypeMap, region: MeshAxis) -> SpmdTypeError:
    axes = ", ".join(f"{n}={r.layout_str()}" for n, r in (have.space.pairs if have.space is not None else ()))
    return SpmdTypeError(
        Rejection(
            f"A gradient is summed over a group (ranks {region.layout_str()}) that is neither an axis of its mesh nor a "
            "flattening of its axes; the sum covers part of an axis and mixes what it should not.",
            [("parameter", name), ("gradient", have.format()), ("its mesh", axes)],
            [f"sum {name} over the group of the axes where it is P (an expert parameter: the expert data-parallel "
             "group)"],
        ),
        user_source_line(),
    )


def _double_sum(name: str, axis: str, have: TypeMap) -> SpmdTypeError:
    t = have.get(axis)
    why = ("it was already summed there" if t is R else
           f"it is {t} there: each rank's gradient is complete for its own shard or copy")
    return SpmdTypeError(
        Rejection(
            f"A gradient is summed over {axis!r}, but {why}; the sum multiplies or mixes it.",
            [("parameter", name), ("gradient", have.format()), ("axis", axis)],
            [f"sum only the gradients that are P on {axis!r}: leave {name} out of this all-reduce"],
        ),
        user_source_line(),
    )
