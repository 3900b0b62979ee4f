"""Partition-spec redistribute planner: the cheapest sequence of collectives from one layout to another.

A layout is, per tensor dim, the mesh axes that shard it (major to minor), plus
the mesh axes on which the value is a pending sum (P). Every other mesh axis
holds a replicated copy. The planner searches (Dijkstra) over layouts, with
these moves, each a legal per-axis or flattened-group operation:

* ``all_gather(A, d)``: drop the minor-most axes ``A`` of dim ``d``.
* ``all_to_all(A, split d2, concat d)``: move the minor-most axes ``A`` of ``d`` to the minor end of ``d2``.
* ``all_reduce(A)`` / ``reduce_scatter(A, d)``: sum pending axes ``A`` (the latter appends ``A`` to ``d``).
* ``local_slice(A, d)``: shard dim ``d`` on replicated axes ``A`` (appended minor-most); no communication.
* ``local_partial(A)``: turn replicated axes, or the minor-most axes of one dim (zero-padding the
  local shard), into pending sums; only for axes the destination has as partial.

Only the minor-most axes of a dim can be gathered, moved or appended: a
rank's shard is contiguous only for those. Several axes run as one collective
on the flattened group when they are listed in mesh order (torch's
``mesh[axes]._flatten()`` needs ascending mesh dims; they need not be adjacent).
The search minimises bytes per rank, then the number of collectives, then steps.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator, Mapping, Sequence, overload

from .._core.spec import normalize

__all__ = ["Step", "Plan", "plan_redistribute"]

Layout = tuple[tuple[str, ...], ...]
_State = tuple[Layout, frozenset]
COMM = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
LOCAL = ("local_slice", "local_partial")


@dataclass(frozen=True)
class Step:
    """One step of a plan: a collective (or local op) over mesh ``axes`` (flattened if several).

    ``bytes`` is what one rank sends under the ring cost model (see :class:`Plan`).
    ``local_slice`` names its dim as ``scatter_dim``; ``local_partial`` zero-pads
    ``gather_dim`` (or, when None, keeps the value on coordinate 0 only).
    """

    collective: str
    axes: tuple[str, ...]
    gather_dim: int | None = None
    scatter_dim: int | None = None
    split_dim: int | None = None
    concat_dim: int | None = None
    bytes: float = 0.0
    in_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    after: str = ""

    def dims_text(self) -> str:
        if self.collective == "all_to_all":
            return f"split {self.split_dim} -> concat {self.concat_dim}"
        if self.gather_dim is not None:
            return f"{'pad' if self.collective == 'local_partial' else 'gather'} {self.gather_dim}"
        if self.scatter_dim is not None:
            return f"{'slice' if self.collective == 'local_slice' else 'scatter'} {self.scatter_dim}"
        return "-"


@dataclass(frozen=True)
class Plan(Sequence[Step]):
    """A redistribute plan: a sequence of steps (``len(plan)``, ``plan[0]``, ``for step in plan``, as
    ``print(plan)`` numbers them), and its communication volume per rank.

    Cost model (ring algorithms, bytes SENT per rank, n = size of the (flattened) group):
    all_gather and reduce_scatter move (n-1)/n of the full (gathered) buffer, all_reduce
    2(n-1)/n of the buffer, all_to_all (n-1)/n of the local buffer; local ops move 0.
    ``naive_bytes`` is the volume of the per-axis plan that all-reduces every pending
    axis it must remove, gathers every axis that changes, then slices locally.

    Example::

        >>> p = plan_redistribute((8,), (("dp", "tp"),), (None,), {"dp": 2, "tp": 4})
        >>> [(s.collective, s.axes) for s in p], len(p), p.total_bytes
        ([('all_gather', ('dp', 'tp'))], 1, 28.0)
    """

    steps: tuple[Step, ...]
    global_shape: tuple[int, ...]
    mesh_sizes: tuple[tuple[str, int], ...]
    itemsize: int
    src: str
    dst: str
    src_local_shape: tuple[int, ...]
    naive_steps: tuple[Step, ...] = ()

    def __len__(self) -> int:
        return len(self.steps)

    @overload
    def __getitem__(self, index: int) -> Step: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Step, ...]: ...

    def __getitem__(self, index: int | slice) -> Step | tuple[Step, ...]:
        return self.steps[index]

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    @property
    def total_bytes(self) -> float:
        return float(sum(s.bytes for s in self.steps))

    @property
    def naive_bytes(self) -> float:
        return float(sum(s.bytes for s in self.naive_steps))

    @property
    def collectives(self) -> list[tuple[str, tuple[str, ...]]]:
        """``[(collective, axes), ...]`` for the communicating steps only."""
        return [(s.collective, s.axes) for s in self.steps if s.collective in COMM]

    def __str__(self) -> str:
        return format_plan(self)


# ---------------------------------------------------------------------------
# validation: every error is a ValueError naming the culprit, raised before any communication


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """``{axis: size}`` in mesh order, from a ``{name: size}`` dict or a DeviceMesh with dim names."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError("plan_redistribute needs mesh axis names: pass a DeviceMesh with mesh_dim_names or a {name: size} dict")
    return {name: int(mesh.size(i)) for i, name in enumerate(names)}


def _normalize(spec: Sequence[Any], ndim: int, what: str, sizes: Mapping[str, int]) -> Layout:
    out = normalize(spec, ndim, what)
    for d, entry in enumerate(out):
        for axis in entry:
            if axis not in sizes:
                raise ValueError(f"{what} names mesh axis {axis!r} (dim {d}), which is not in the mesh; "
                                 f"mesh axes: {tuple(sizes)}")
    return out


def _check_unique(layout: Layout, partial: tuple[str, ...], side: str, sizes: Mapping[str, int]) -> frozenset:
    seen: dict[str, str] = {}
    places = [(a, f"{side}_spec dim {d}") for d, e in enumerate(layout) for a in e] + [(a, f"{side}_partial") for a in partial]
    for axis, where in places:
        if axis not in sizes:
            raise ValueError(f"{side}_partial names mesh axis {axis!r}, which is not in the mesh; mesh axes: {tuple(sizes)}")
        if axis in seen:
            raise ValueError(
                f"mesh axis {axis!r} is used twice ({seen[axis]} and {where}); "
                "a mesh axis shards at most one dim, once, or is partial"
            )
        seen[axis] = where
    return frozenset(partial)


def _check_divides(shape: Sequence[int], layout: Layout, what: str, sizes: Mapping[str, int]) -> None:
    for d, entry in enumerate(layout):
        f = _factor(entry, sizes)
        if shape[d] % f:
            axes = "*".join(f"{a}({sizes[a]})" for a in entry)
            raise ValueError(f"{what} shards dim {d} (size {shape[d]}) over {axes} = {f} ranks, which does not divide it")


def _factor(entry: Sequence[str], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in entry)


# ---------------------------------------------------------------------------
# the search


class _Problem:
    def __init__(self, shape, sizes, itemsize, src: _State, dst: _State):
        self.shape, self.sizes, self.itemsize = tuple(shape), dict(sizes), itemsize
        self.order = {a: i for i, a in enumerate(sizes)}
        self.src, self.dst = src, dst
        self.reducible = src[1] - dst[1]  # pending sums the plan must carry out
        self.creatable = dst[1] - src[1]  # pending sums only a local_partial may create

    def local_shape(self, layout: Layout) -> tuple[int, ...]:
        return tuple(n // _factor(e, self.sizes) for n, e in zip(self.shape, layout))

    def nbytes(self, layout: Layout) -> int:
        return math.prod(self.local_shape(layout)) * self.itemsize

    def fits(self, layout: Layout) -> bool:
        return all(n % _factor(e, self.sizes) == 0 for n, e in zip(self.shape, layout))

    def in_mesh_order(self, axes: Sequence[str]) -> bool:
        return all(self.order[a] < self.order[b] for a, b in zip(axes, axes[1:]))

    def text(self, state: _State) -> str:
        return layout_text(self.shape, state[0], state[1], self.order)


def layout_text(shape, layout: Layout, partial, order: Mapping[str, int]) -> str:
    """``[8@tp,dp] P(x)``: global sizes, the axes sharding each dim, pending-sum axes."""
    dims = ",".join(f"{n}@{','.join(e)}" if e else str(n) for n, e in zip(shape, layout))
    pend = sorted(partial, key=order.__getitem__)
    return f"[{dims}]" + (f" P({','.join(pend)})" if pend else "")


def _replace(layout: Layout, d: int, entry: tuple[str, ...]) -> Layout:
    return layout[:d] + (entry,) + layout[d + 1:]


def _sharded_moves(pb: _Problem, layout: Layout, partial: frozenset):
    """Moves on the minor-most axes of a dim: all_gather, all_to_all, local_partial (zero-pad)."""
    for d, entry in enumerate(layout):
        for k in range(1, len(entry) + 1):
            axes, rest = entry[-k:], entry[:-k]
            gathered = _replace(layout, d, rest)
            if set(axes) <= pb.creatable:
                yield Step("local_partial", axes, gather_dim=d), (gathered, partial | set(axes)), Fraction(0)
            if not pb.in_mesh_order(axes):
                continue
            n = _factor(axes, pb.sizes)
            yield Step("all_gather", axes, gather_dim=d), (gathered, partial), Fraction(n - 1, n) * pb.nbytes(gathered)
            for d2 in range(len(layout)):
                moved = _replace(gathered, d2, gathered[d2] + axes) if d2 != d else None
                if moved is not None and pb.fits(moved):
                    cost = Fraction(n - 1, n) * pb.nbytes(layout)
                    yield Step("all_to_all", axes, split_dim=d2, concat_dim=d), (moved, partial), cost


def _partial_moves(pb: _Problem, layout: Layout, partial: frozenset):
    """all_reduce / reduce_scatter on any mesh-ordered set of pending axes the destination does not keep."""
    pending = sorted(partial & pb.reducible, key=pb.order.__getitem__)
    for k in range(1, len(pending) + 1):
        for axes in itertools.combinations(pending, k):
            n, left = _factor(axes, pb.sizes), partial - set(axes)
            yield Step("all_reduce", axes), (layout, left), Fraction(2 * (n - 1), n) * pb.nbytes(layout)
            for d in range(len(layout)):
                scattered = _replace(layout, d, layout[d] + axes)
                if pb.fits(scattered):
                    yield Step("reduce_scatter", axes, scatter_dim=d), (scattered, left), Fraction(n - 1, n) * pb.nbytes(layout)


def _local_moves(pb: _Problem, layout: Layout, partial: frozenset):
    """Replicated axes: slice one onto a dim, or mark it pending (only if the destination wants it)."""
    used = {a for e in layout for a in e} | partial
    for axis in pb.sizes:
        if axis in used:
            continue
        if axis in pb.creatable:
            yield Step("local_partial", (axis,)), (layout, partial | {axis}), Fraction(0)
        for d in range(len(layout)):
            sliced = _replace(layout, d, layout[d] + (axis,))
            if pb.fits(sliced):
                yield Step("local_slice", (axis,), scatter_dim=d), (sliced, partial), Fraction(0)


def _search(pb: _Problem) -> list[tuple[Step, _State, Fraction]]:
    """Dijkstra over layouts; cost = (bytes, collectives, steps)."""
    start = (Fraction(0), 0, 0)
    best: dict[_State, tuple] = {pb.src: start}
    prev: dict[_State, tuple] = {}
    heap = [(start, 0, pb.src)]
    tick = itertools.count(1)
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == pb.dst:
            break
        if cost > best[state]:
            continue
        layout, partial = state
        moves = itertools.chain(_sharded_moves(pb, layout, partial), _partial_moves(pb, layout, partial),
                                _local_moves(pb, layout, partial))
        for step, nxt, nbytes in moves:
            c = (cost[0] + nbytes, cost[1] + (step.collective in COMM), cost[2] + 1)
            if nxt not in best or c < best[nxt]:
                best[nxt], prev[nxt] = c, (state, step, nbytes)
                heapq.heappush(heap, (c, next(tick), nxt))
    path, state = [], pb.dst
    while state != pb.src:
        before, step, nbytes = prev[state]
        path.append((step, state, nbytes))
        state = before
    return path[::-1]


def _naive(pb: _Problem) -> list[tuple[Step, _State, Fraction]]:
    """Per axis: all_reduce pending axes, gather what changes (minor first), mark partial, slice."""
    (src, partial), (dst, _) = pb.src, pb.dst
    keep = [len(list(itertools.takewhile(lambda p: p[0] == p[1], zip(s, t)))) for s, t in zip(src, dst)]
    layout, out = src, []
    for axis in sorted(pb.reducible, key=pb.order.__getitem__):
        n, partial = pb.sizes[axis], partial - {axis}
        out.append((Step("all_reduce", (axis,)), (layout, partial), Fraction(2 * (n - 1), n) * pb.nbytes(layout)))
    for d, k in enumerate(keep):
        for axis in reversed(src[d][k:]):
            layout, n = _replace(layout, d, layout[d][:-1]), pb.sizes[axis]
            out.append((Step("all_gather", (axis,), gather_dim=d), (layout, partial), Fraction(n - 1, n) * pb.nbytes(layout)))
    if pb.creatable:
        partial = partial | pb.creatable
        out.append((Step("local_partial", tuple(sorted(pb.creatable, key=pb.order.__getitem__))), (layout, partial), Fraction(0)))
    for d, k in enumerate(keep):
        if dst[d][k:]:
            layout = _replace(layout, d, dst[d])
            out.append((Step("local_slice", dst[d][k:], scatter_dim=d), (layout, partial), Fraction(0)))
    return out


def _finish(pb: _Problem, path) -> tuple[Step, ...]:
    """Fill in shapes and bytes, and merge runs of local steps of the same kind on the same dim."""
    steps: list[Step] = []
    state = pb.src
    for step, nxt, nbytes in path:
        last = steps[-1] if steps else None
        same = last is not None and step.collective in LOCAL and last.collective == step.collective and (
            last.gather_dim, last.scatter_dim) == (step.gather_dim, step.scatter_dim)
        in_shape = last.in_shape if same else pb.local_shape(state[0])
        # pads run minor first, so a merged pad lists its axes major to minor in reverse order of the steps
        pad = step.collective == "local_partial" and step.gather_dim is not None
        axes = ((step.axes + last.axes) if pad else (last.axes + step.axes)) if same else step.axes
        full = Step(step.collective, axes, step.gather_dim, step.scatter_dim, step.split_dim, step.concat_dim,
                    float(nbytes), in_shape, pb.local_shape(nxt[0]), pb.text(nxt))
        if same:
            steps[-1] = full
        else:
            steps.append(full)
        state = nxt
    return tuple(steps)


def plan_redistribute(x_or_shape: Any, src_spec: Sequence[Any], dst_spec: Sequence[Any], mesh: Any, *,
                      src_partial: Sequence[str] = (), dst_partial: Sequence[str] = (),
                      itemsize: int | None = None) -> Plan:
    """Plan the collectives that take a tensor from ``src_spec`` to ``dst_spec``; runs nothing.

    ``x_or_shape``: a tuple of ints is the GLOBAL shape; a tensor is a LOCAL shard laid out by
    ``src_spec`` (global shape = its shape times the sharding factors). ``mesh``: a DeviceMesh
    with dim names or a ``{name: size}`` dict. ``src_partial`` / ``dst_partial``: axes holding a
    pending sum. ``itemsize`` defaults to the tensor's element size, or 4 for a shape.
    Raises ValueError (naming the axis or dim) for unknown axes, an axis used twice, or a dim
    that does not divide.

    Example::

        >>> p = plan_redistribute((8, 4), ("tp", None), (None, "tp"), {"tp": 4})
        >>> p.collectives, p.total_bytes
        ([('all_to_all', ('tp',))], 24.0)
    """
    sizes = mesh_sizes(mesh)
    is_shape = isinstance(x_or_shape, (tuple, list)) or not hasattr(x_or_shape, "shape")
    ndim = len(x_or_shape) if is_shape else x_or_shape.dim()
    src = _normalize(src_spec, ndim, "src_spec", sizes)
    dst = _normalize(dst_spec, ndim, "dst_spec", sizes)
    src_partial = (src_partial,) if isinstance(src_partial, str) else tuple(src_partial)
    dst_partial = (dst_partial,) if isinstance(dst_partial, str) else tuple(dst_partial)
    src_p = _check_unique(src, src_partial, "src", sizes)
    dst_p = _check_unique(dst, dst_partial, "dst", sizes)
    if is_shape:
        shape = tuple(int(n) for n in x_or_shape)
    else:
        shape = tuple(int(n) * _factor(e, sizes) for n, e in zip(x_or_shape.shape, src))
    _check_divides(shape, src, "src_spec", sizes)
    _check_divides(shape, dst, "dst_spec", sizes)
    if itemsize is None:
        itemsize = 4 if is_shape else x_or_shape.element_size()
    pb = _Problem(shape, sizes, itemsize, (src, src_p), (dst, dst_p))
    return Plan(_finish(pb, _search(pb)), shape, tuple(sizes.items()), itemsize, pb.text(pb.src), pb.text(pb.dst),
                pb.local_shape(src), _finish(pb, _naive(pb)))


def format_plan(plan: Plan) -> str:
    """The plan as a table: one row per step, then the total against the naive plan."""
    mesh = ", ".join(f"{a}={n}" for a, n in plan.mesh_sizes)
    head = f"redistribute {plan.src} -> {plan.dst}  (mesh {mesh}; {plan.itemsize}-byte items)"
    rows = [("#", "collective", "axes", "dims", "local shape", "bytes/rank", "layout after")]
    for i, s in enumerate(plan.steps, 1):
        shapes = f"{tuple(s.in_shape)} -> {tuple(s.out_shape)}"
        rows.append((str(i), s.collective, ",".join(s.axes), s.dims_text(), shapes, f"{s.bytes:g}", s.after))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [head] + ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    if not plan.steps:
        lines.append("(nothing to do)")
    lines.append(f"total {plan.total_bytes:g} bytes/rank in {len(plan.collectives)} collective(s); "
                 f"naive per-axis plan {plan.naive_bytes:g}")
    return "\n".join(lines)
