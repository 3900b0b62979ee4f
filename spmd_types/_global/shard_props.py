"""Shard propagation functions for global SPMD, one per op family.

Each function takes a :class:`Ctx` (the op, its operands with their specs,
the local result) and returns the result's spec, or a :class:`Rejection`
naming the communication that would make local and global semantics agree.
The question each answers is seed 003's: is there an ``out_spec`` with
``map(f, in_spec(x)) == out_spec(f(x))``?
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .._core.errors import Rejection
from .._core.spec import Spec, format_shape, short_dtype
from .._core.types import R, S, TypeMap

__all__ = ["Ctx", "Operand"]


@dataclass
class PendingSum(Rejection):
    """A contraction over a dim sharded on ``axes``: a pending sum there, usable once claimed P."""

    axes: tuple[str, ...] = ()


@dataclass
class Operand:
    label: str
    tensor: torch.Tensor
    spec: Spec


@dataclass
class Ctx:
    display: str
    args: Sequence[Any]
    kwargs: dict[str, Any]
    operands: list[Operand]
    sizes: dict[str, int]
    out: Any
    partial: frozenset[str] = field(default_factory=frozenset)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if index < len(self.args) else default

    def first(self) -> Operand:
        return self.operands[0]

    def out_ndim(self) -> int:
        if not isinstance(self.out, (torch.Tensor, tuple, list)):  # the op has not run: as for elementwise
            return max((op.tensor.dim() for op in self.operands), default=0)
        out = self.out[0] if isinstance(self.out, (tuple, list)) else self.out
        return out.dim() if isinstance(out, torch.Tensor) else 0

    def reject(self, rule: str, detail: str, fixes: Sequence[str]) -> Rejection:
        shown = "\n".join(
            f"{op.label}: {_dtype(op.tensor)}[{format_shape(tuple(op.tensor.shape), op.spec, self.sizes)}] "
            f"{_types(op.tensor)}"
            for op in self.operands
        )
        return Rejection(
            f"Global SPMD: {rule}",
            [("op", self.display), ("operands", shown), ("why", detail)],
            list(fixes),
        )


def _dtype(t: torch.Tensor) -> str:
    return short_dtype(t.dtype)


def _types(t: torch.Tensor) -> str:
    types: TypeMap | None = getattr(t, "_spmd_types", None)
    return types.format() if types is not None else "untyped"


def gather_fix(label: str, axes: Sequence[str], dim: int) -> str:
    """The all-gather that makes dim ``dim`` of ``label`` unsharded (last axis first)."""
    return "; ".join(f"spmd.all_gather({label}, '{a}', src={S(dim).code()}, dst={R.code()})" for a in reversed(axes))


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


# ---------------------------------------------------------------------------
# layout-preserving and elementwise


def same(ctx: Ctx) -> Spec | Rejection:
    """The result has its input's layout (casts, copies, unary elementwise functions)."""
    if not ctx.operands:
        return tuple(() for _ in range(ctx.out_ndim()))
    if len(ctx.operands) > 1:
        return elementwise(ctx)
    spec = ctx.first().spec
    if len(spec) != ctx.out_ndim():
        return tuple(() for _ in range(ctx.out_ndim())) if not any(spec) else ctx.reject(
            "the result's rank differs from its input's, and no rule says where the sharded dims go.",
            f"input has {len(spec)} dims, result has {ctx.out_ndim()}", [])
    return spec


def elementwise(ctx: Ctx) -> Spec | Rejection:
    """Broadcasting elementwise: operands that have a dim must shard it the same way."""
    ndim = ctx.out_ndim()
    out: list[tuple[str, ...]] = []
    for j in range(ndim):
        pos = ndim - 1 - j
        found: list[tuple[Operand, tuple[str, ...], int]] = []
        for op in ctx.operands:
            k = op.tensor.dim() - 1 - j
            if k < 0:
                continue
            entry, size = op.spec[k], op.tensor.shape[k]
            if size != 1 or entry:
                found.append((op, entry, k))
        entries = {e for _, e, _ in found}
        if len(entries) > 1:
            sharded = next((o, e, k) for o, e, k in found if e)
            other = next((o, e, k) for o, e, k in found if e != sharded[1])
            o, e, k = sharded
            fixes = [gather_fix(o.label, e, k)]
            if not other[1]:
                fixes.append(
                    "; ".join(f"spmd.convert({other[0].label}, '{a}', src={R.code()}, dst={S(other[2]).code()})" for a in e)
                )
            return ctx.reject(
                "an elementwise op needs its operands sharded the same way on every dim they share.",
                f"dim {pos - ndim} is sharded on {_axes(e)} in {o.label} but on {_axes(other[1])} in {other[0].label}",
                fixes,
            )
        out.insert(0, found[0][1] if found else ())
    return tuple(out)


def _axes(entry: tuple[str, ...]) -> str:
    return ", ".join(f"'{a}'" for a in entry) if entry else "no axis"


# ---------------------------------------------------------------------------
# reductions and ops along one dim


def _reduced_dims(ctx: Ctx, ndim: int) -> list[int]:
    dim = ctx.arg(1, "dim", None)
    if dim is None:
        dim = ctx.kwargs.get("axis", None)
    if dim is None:
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({_dim(d, ndim) for d in dims})


def reduction(ctx: Ctx, linear: bool) -> Spec | Rejection:
    """sum/mean/amax/...: a reduced dim must be unsharded, or (sum) become a pending sum explicitly."""
    op = ctx.first()
    ndim = op.tensor.dim()
    reduced = _reduced_dims(ctx, ndim)
    keepdim = bool(ctx.arg(2, "keepdim", False))
    summed: list[str] = []  # a sum over sharded dims: the pending sum it is (claimed before use, see tensor.py)
    for d in reduced:
        entry = op.spec[d] if ndim else ()
        pending = [a for a in entry if a not in ctx.partial]
        if pending:
            fixes = [gather_fix(op.label, pending, d)]
            if linear:
                fixes.insert(0, f"spmd.sum({op.label}, {d}, out_partial_axes={_tuple_code(pending)})")
            found = ctx.reject(
                "a reduction over a sharded dim adds up only this rank's shard; the global result needs "
                "the shards combined.",
                f"{ctx.display} reduces dim {d}, which is sharded on {_axes(entry)}",
                fixes,
            )
            if not linear:
                return found
            summed.extend(pending)
    if summed:
        return PendingSum(found.rule, found.seen, found.fixes, found.notes, tuple(summed))
    if keepdim or ctx.out_ndim() == ndim:
        return tuple(() if d in reduced else e for d, e in enumerate(op.spec))
    return tuple(e for d, e in enumerate(op.spec) if d not in reduced)


def _tuple_code(axes: Sequence[str]) -> str:
    return f"'{axes[0]}'" if len(axes) == 1 else "(" + ", ".join(f"'{a}'" for a in axes) + ")"


def along_dim(ctx: Ctx, index: int = 1, name: str = "dim", default: int | None = -1) -> Spec | Rejection:
    """softmax, cumsum, sort, topk...: the op mixes values along one dim, which must be unsharded."""
    op = ctx.first()
    dim = ctx.arg(index, name, default)
    if dim is None or op.tensor.dim() == 0:
        return op.spec
    d = _dim(dim, op.tensor.dim())
    if op.spec[d]:
        return ctx.reject(
            f"{ctx.display} mixes values along dim {d}, which is sharded: each rank would see only its shard.",
            f"dim {d} of {op.label} is sharded on {_axes(op.spec[d])}",
            [gather_fix(op.label, op.spec[d], d)],
        )
    if ctx.out_ndim() != op.tensor.dim():
        return tuple(e for k, e in enumerate(op.spec) if k != d)
    return op.spec


def normalize_last(ctx: Ctx) -> Spec | Rejection:
    """layer_norm / rms_norm over the trailing ``normalized_shape`` dims: those must be unsharded."""
    op = ctx.first()
    shape = ctx.arg(1, "normalized_shape", ())
    k = 1 if isinstance(shape, int) else len(shape)
    ndim = op.tensor.dim()
    for d in range(ndim - k, ndim):
        if op.spec[d]:
            return ctx.reject(
                f"{ctx.display} normalizes over dim {d}, which is sharded: the statistics would be per shard.",
                f"dim {d} of {op.label} is sharded on {_axes(op.spec[d])}",
                [gather_fix(op.label, op.spec[d], d)],
            )
    for other in ctx.operands[1:]:
        if any(other.spec):
            return ctx.reject(
                f"{ctx.display}'s weight and bias cover the normalized dims, which are unsharded.",
                f"{other.label} is sharded", [gather_fix(other.label, next(e for e in other.spec if e), 0)])
    return op.spec
