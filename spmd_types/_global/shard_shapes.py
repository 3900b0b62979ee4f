"""Shard propagation for ops that move dims around: reshape, permute, cat, split, indexing, squeeze.

Shape arguments are local sizes: the runtime runs the local op, and the
partition spec says how the local results reassemble.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._core.errors import Rejection
from .._core.spec import Spec
from .shard_props import Ctx, _axes, _dim, gather_fix

__all__ = ["complex_view_rule", "gather_rule", "scatter_rule", "reshape_rule", "permute_rule", "transpose_rule",
           "concat_rule", "stack_rule", "split_rule", "index_rule", "unsqueeze_rule", "squeeze_rule", "expand_rule",
           "select_rule"]


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of shape ``a`` with runs of shape ``b`` that hold the same elements."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                ga.append(i - 1)
            elif j < len(b):
                pb, j = pb * b[j], j + 1
                gb.append(j - 1)
            else:
                break
        groups.append((ga, gb))
    if groups:
        groups[-1][0].extend(range(i, len(a)))
        groups[-1][1].extend(range(j, len(b)))
    else:
        groups.append((list(range(len(a))), list(range(len(b)))))
    return groups


def reshape_rule(ctx: Ctx) -> Spec | Rejection:
    """A sharded dim may merge with the dims after it, or split, if it is the major dim of its run."""
    op = ctx.first()
    a, b = tuple(op.tensor.shape), tuple(ctx.out.shape)
    out: list[tuple[str, ...]] = [() for _ in b]
    for ga, gb in _groups(a, b):
        sharded = [d for d in ga if op.spec[d]]
        if not sharded:
            continue
        major = next((d for d in ga if a[d] != 1 or op.spec[d]), ga[0])
        if len(sharded) > 1 or sharded[0] != major:
            d = sharded[-1]
            return ctx.reject(
                "a reshape can keep a sharded dim only as the major (first) dim of the dims it merges "
                "with or splits into; otherwise each rank's elements are not one block of the result.",
                f"dim {d} of {op.label} is sharded on {_axes(op.spec[d])} and is not the major dim of "
                f"dims {ga} (local sizes {[a[k] for k in ga]})",
                [gather_fix(op.label, op.spec[d], d)],
            )
        target = next((k for k in gb if b[k] != 1), gb[0])
        out[target] = op.spec[sharded[0]]
    return tuple(out)


def permute_rule(ctx: Ctx) -> Spec | Rejection:
    op = ctx.first()
    dims = ctx.args[1:] if len(ctx.args) > 1 else ctx.kwargs.get("dims", ())
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    n = op.tensor.dim()
    return tuple(op.spec[_dim(d, n)] for d in dims)


def transpose_rule(ctx: Ctx) -> Spec | Rejection:
    """transpose / swapaxes / t / .T / .mT / movedim."""
    op = ctx.first()
    n = op.tensor.dim()
    spec = list(op.spec)
    name = ctx.display
    if name.endswith(".T") or (name.endswith(".t") and n <= 2):
        return tuple(reversed(spec))
    if name.endswith(".mT") or name.endswith(".mH"):
        d0, d1 = n - 2, n - 1
    elif "movedim" in name or "moveaxis" in name:
        src, dst = ctx.arg(1, "source"), ctx.arg(2, "destination")
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        order = [d for d in range(n) if d not in {_dim(s, n) for s in src}]
        for s, d in sorted(zip((_dim(s, n) for s in src), (_dim(d, n) for d in dst)), key=lambda p: p[1]):
            order.insert(d, s)
        return tuple(op.spec[d] for d in order)
    else:
        d0, d1 = _dim(ctx.arg(1, "dim0", 0), n), _dim(ctx.arg(2, "dim1", 1), n)
    spec[d0], spec[d1] = spec[d1], spec[d0]
    return tuple(spec)


def _same_specs(ctx: Ctx, what: str) -> Spec | Rejection:
    first = ctx.operands[0]
    for other in ctx.operands[1:]:
        if other.spec != first.spec:
            d = next(k for k, (x, y) in enumerate(zip(first.spec, other.spec)) if x != y)
            culprit = first if first.spec[d] else other
            return ctx.reject(
                f"{what} needs every input sharded the same way.",
                f"dim {d} is sharded on {_axes(first.spec[d])} in {first.label} but on "
                f"{_axes(other.spec[d])} in {other.label}",
                [gather_fix(culprit.label, culprit.spec[d], d)],
            )
    return first.spec


def concat_rule(ctx: Ctx) -> Spec | Rejection:
    spec = _same_specs(ctx, "concatenation")
    if isinstance(spec, Rejection):
        return spec
    d = _dim(ctx.arg(1, "dim", 0), len(spec))
    if spec[d]:
        return ctx.reject(
            "concatenating along a sharded dim interleaves the shards: the local concatenation is not "
            "a block of the global one.",
            f"dim {d} is sharded on {_axes(spec[d])}",
            [gather_fix(ctx.first().label, spec[d], d)],
        )
    return spec


def stack_rule(ctx: Ctx) -> Spec | Rejection:
    spec = _same_specs(ctx, "stacking")
    if isinstance(spec, Rejection):
        return spec
    d = _dim(ctx.arg(1, "dim", 0), len(spec) + 1)
    return spec[:d] + ((),) + spec[d:]


def split_rule(ctx: Ctx) -> Spec | Rejection:
    """split / chunk / unbind / tensor_split along an unsharded dim."""
    op = ctx.first()
    unbind = "unbind" in ctx.display
    default = 0
    d = _dim(ctx.arg(1 if unbind else 2, "dim", default), op.tensor.dim())
    if op.spec[d]:
        return ctx.reject(
            "splitting along a sharded dim splits each rank's shard, not the global tensor.",
            f"dim {d} of {op.label} is sharded on {_axes(op.spec[d])}",
            [gather_fix(op.label, op.spec[d], d)],
        )
    return tuple(e for k, e in enumerate(op.spec) if k != d) if unbind else op.spec


def select_rule(ctx: Ctx) -> Spec | Rejection:
    """select / narrow / index_select / gather along an unsharded dim."""
    op = ctx.first()
    d = _dim(ctx.arg(1, "dim", 0), op.tensor.dim())
    if op.spec[d]:
        return ctx.reject(
            "selecting along a sharded dim picks from each rank's shard, not from the global tensor.",
            f"dim {d} of {op.label} is sharded on {_axes(op.spec[d])}",
            [gather_fix(op.label, op.spec[d], d)],
        )
    if ctx.out_ndim() < op.tensor.dim():
        return tuple(e for k, e in enumerate(op.spec) if k != d)
    return op.spec


def gather_rule(ctx: Ctx) -> Spec | Rejection:
    """gather / take_along_dim: the result has the index's layout; input and index are sharded alike off ``dim``,
    and ``dim`` is whole in the input (an index may point anywhere along it)."""
    if len(ctx.operands) < 2:
        return ctx.reject("gather needs its index as a tensor.", "one tensor operand", [])
    found = _indexed_along(ctx, "gather reads any position along its dim",
                           "gather pairs each index with the input at the same position off its dim: both sharded "
                           "alike.")
    return found if isinstance(found, Rejection) else ctx.operands[1].spec


def scatter_rule(ctx: Ctx) -> Spec | Rejection:
    """scatter / scatter_add / scatter_reduce: the result has the input's layout; index (and src) sharded like the
    input off ``dim``, which is whole in the input (an index may point anywhere along it)."""
    found = _indexed_along(ctx, "scatter writes to any position along its dim",
                           "scatter pairs each index (and value) with the input at the same position off its dim: "
                           "sharded alike.")
    return found if isinstance(found, Rejection) else ctx.operands[0].spec


def _indexed_along(ctx: Ctx, whole: str, alike: str) -> Rejection | None:
    """An op indexing the input along ``dim``: that dim whole in the input, every other operand sharded like it off it."""
    inp = ctx.operands[0]
    d = _dim(ctx.arg(1, "dim", 0), inp.tensor.dim())
    if inp.spec[d]:
        return ctx.reject(f"{whole}, which must be whole in the input.",
                          f"dim {d} of {inp.label} is sharded on {_axes(inp.spec[d])}",
                          [gather_fix(inp.label, inp.spec[d], d)])
    for other in ctx.operands[1:]:
        for k, (a, b) in enumerate(zip(inp.spec, other.spec)):
            if k != d and a != b:
                sharded = (inp, a) if a else (other, b)
                return ctx.reject(alike, f"dim {k} is sharded on {_axes(a)} in {inp.label} but on {_axes(b)} in "
                                  f"{other.label}", [gather_fix(sharded[0].label, sharded[1], k)])
    return None


def _index_items(index: object, ndim: int) -> list[object]:
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        k = items.index(Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[k:k + 1] = [slice(None)] * (ndim - used)
    used = sum(1 for i in items if i is not None)
    return items + [slice(None)] * (ndim - used)


def index_rule(ctx: Ctx) -> Spec | Rejection:
    """x[i]: full slices keep a dim's sharding; anything else must hit an unsharded dim."""
    op = ctx.first()
    items = _index_items(ctx.args[1], op.tensor.dim())
    out: list[tuple[str, ...]] = []
    d = 0
    for item in items:
        if item is None:
            out.append(())
            continue
        entry = op.spec[d]
        full = isinstance(item, slice) and item == slice(None)
        if entry and not full:
            return ctx.reject(
                "indexing a sharded dim indexes each rank's shard, not the global tensor.",
                f"dim {d} of {op.label} is sharded on {_axes(entry)}; the index there is {item!r:.40}",
                [gather_fix(op.label, entry, d)],
            )
        if isinstance(item, torch.Tensor):
            if any(getattr(item, "_spmd_spec", ()) or ()):
                return ctx.reject("an index tensor must be unsharded.", "the index is sharded", [])
            out.extend(() for _ in range(item.dim()))
        elif not isinstance(item, int):
            out.append(entry)
        d += 1
    if len(out) != ctx.out_ndim():
        return ctx.reject("this indexing pattern has no shard propagation rule yet.", f"index {ctx.args[1]!r:.60}",
                          ["index an unsharded tensor, or use spmd.local_map"])
    return tuple(out)


def unsqueeze_rule(ctx: Ctx) -> Spec | Rejection:
    op = ctx.first()
    d = _dim(ctx.arg(1, "dim", 0), op.tensor.dim() + 1)
    return op.spec[:d] + ((),) + op.spec[d:]


def squeeze_rule(ctx: Ctx) -> Spec | Rejection:
    """Dropping local size-1 dims: a sharded dim of local size 1 is not size 1 globally."""
    op = ctx.first()
    shape = tuple(op.tensor.shape)
    dim = ctx.arg(1, "dim", None)
    dims = range(len(shape)) if dim is None else [_dim(x, len(shape)) for x in ([dim] if isinstance(dim, int) else dim)]
    dropped = {d for d in dims if shape[d] == 1}
    for d in dropped:
        if op.spec[d]:
            return ctx.reject(
                "squeezing a sharded dim: it has size 1 locally but not globally.",
                f"dim {d} of {op.label} is sharded on {_axes(op.spec[d])}",
                [gather_fix(op.label, op.spec[d], d)],
            )
    return tuple(e for d, e in enumerate(op.spec) if d not in dropped)


def complex_view_rule(ctx: Ctx) -> Spec | Rejection:
    """view_as_complex folds a whole trailing pair of reals into one complex; view_as_real unfolds it."""
    op = ctx.first()
    if "complex" in ctx.display:
        if op.spec and op.spec[-1]:
            return ctx.reject(
                "view_as_complex reads the last dim as (real, imaginary) pairs, so it must be whole.",
                f"the last dim of {op.label} is sharded on {_axes(op.spec[-1])}",
                [gather_fix(op.label, op.spec[-1], len(op.spec) - 1)],
            )
        return op.spec[:-1]
    return op.spec + ((),)


def expand_rule(ctx: Ctx) -> Spec | Rejection:
    """expand / repeat / broadcast_to: dims that grow must be unsharded; new leading dims are unsharded."""
    op = ctx.first()
    a, b = tuple(op.tensor.shape), tuple(ctx.out.shape)
    lead = len(b) - len(a)
    for d, entry in enumerate(op.spec):
        if entry and b[lead + d] != a[d]:
            return ctx.reject(
                "growing a sharded dim repeats each rank's shard, not the global tensor.",
                f"dim {d} of {op.label} is sharded on {_axes(entry)}",
                [gather_fix(op.label, entry, d)],
            )
    return tuple(() for _ in range(lead)) + op.spec
