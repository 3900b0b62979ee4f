"""The local work of every typed communication op, on plain tensors.

Each kernel takes plain tensors (or LocalTensors under the single-process
simulator) and an :class:`AxisComm`, and knows nothing about types or
autograd. ``dim=None`` means the V layout "stacked on a new dim 0"; an int
means the S(d) layout "concatenated on tensor dim d". ``sizes`` gives uneven
shard sizes (one per rank) on that dim.

Collectives call the ``_c10d_functional`` ops directly with the group name
(what ``torch.distributed._functional_collectives`` does after resolving its
``group`` argument), then ``wait_tensor``, so the result is a plain tensor.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .._torch.private import c10d_functional, functional_collectives, prepare_collective_groups, simulator_or_none

__all__ = [
    "AxisComm", "group_rank", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven",
    "take_slice", "keep_on_first", "place_slice", "scaled",
]

_c10d = c10d_functional
# The overloads themselves (what the op packets resolve to on every call): one Python call less each.
_ALL_REDUCE = _c10d.all_reduce.default
_ALL_GATHER = _c10d.all_gather_into_tensor.default
_REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
_ALL_TO_ALL = _c10d.all_to_all_single.default
_WAIT = _c10d.wait_tensor.default


class AxisComm(NamedTuple):
    """One (possibly flattened) mesh axis: the typed axes it runs over, process group, group name and size.

    ``names`` are the axes whose types the op changes: none for a group of one
    rank (an identity in types). ``shown`` is how the user named the axis, when
    that differs (an axis of size 1, a group outside the mesh).
    """

    names: tuple[str, ...]
    group: dist.ProcessGroup
    group_name: str
    size: int
    shown: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        """``'tp'`` or ``('dp', 'tp')``, as the user would write it."""
        names = self.shown if self.shown is not None else self.names
        return f"'{names[0]}'" if len(names) == 1 else "(" + ", ".join(f"'{n}'" for n in names) + ")"

    @property
    def first_name(self) -> str:
        """The axis to name in a fix."""
        return (self.names or self.shown or ("axis",))[0]


# async_op=True outside checking (async_op.py): a forward collective's result waits when first read
DEFER = [False]


def _wait(t: torch.Tensor) -> torch.Tensor:
    if DEFER[0]:
        return functional_collectives().AsyncCollectiveTensor(t)
    return _WAIT(t)


# ---------------------------------------------------------------------------
# this rank's index on an axis (per simulated rank under LocalTensorMode)


_SIMULATOR: list = []  # [the torch.distributed._local_tensor module, or None], loaded on first use


def _simulator():
    if not _SIMULATOR:
        _SIMULATOR.append(simulator_or_none())
    return _SIMULATOR[0]


def _local_mode():
    sim = _simulator()
    return None if sim is None else sim.enabled_local_tensor_mode()


_SIM_RANKS: dict[tuple[dist.ProcessGroup, frozenset], object] = {}  # keeps the group alive: ids stay unique


def group_rank(comm: AxisComm) -> int | torch.SymInt:
    """This rank's index in ``comm``'s group.

    Under ``LocalTensorMode`` it is a per-rank SymInt (``dist.get_rank`` would
    answer for the fake rank 0 only), laid out the way the simulator lays out
    the group's peers.
    """
    lm = _local_mode()
    if lm is None:
        return dist.get_rank(comm.group)
    key = (comm.group, frozenset(lm.ranks))
    found = _SIM_RANKS.get(key)
    if found is None:
        ranks, offsets, _ = prepare_collective_groups(comm.group)
        index = {o + r: i for o in offsets for i, r in enumerate(ranks)}
        found = _SIM_RANKS[key] = torch.SymInt(_simulator().LocalIntNode({r: index[r] for r in lm.ranks}))
    return found  # type: ignore[return-value]


def _per_rank(fn):
    """Run pure per-rank ``fn(x, index, ...)`` once per simulated rank, or once for real."""
    if _local_mode() is None:
        return fn
    return _simulator().maybe_run_for_local_tensor(fn)


# ---------------------------------------------------------------------------
# scaling (op="avg" on ops that have no fused average)


def scaled(x: torch.Tensor, reduce: str, size: int) -> torch.Tensor:
    """``x / size`` for ``reduce="avg"``; a fresh alias of ``x`` for ``"sum"``."""
    if reduce == "avg":
        return x / size
    return x.view_as(x)


# ---------------------------------------------------------------------------
# collectives


def all_reduce(x: torch.Tensor, comm: AxisComm, reduce: str) -> torch.Tensor:
    return _wait(_ALL_REDUCE(x, reduce, comm.group_name))


def _gather0(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    return _wait(_ALL_GATHER(x.contiguous(), comm.size, comm.group_name))


def all_gather(x: torch.Tensor, comm: AxisComm, dim: int | None, sizes: Sequence[int] | None) -> torch.Tensor:
    """Stack (``dim=None``) or concatenate on ``dim`` every rank's ``x``."""
    if dim is None:
        return _gather0(x.unsqueeze(0), comm)
    if sizes is not None:
        return _all_gather_uneven(x, comm, dim, sizes)
    if dim == 0:
        return _gather0(x, comm)
    return _gather0(x.unsqueeze(0), comm).movedim(0, dim).flatten(dim, dim + 1)


def _all_gather_uneven(x: torch.Tensor, comm: AxisComm, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    most = max(sizes)
    padded = _pad_to(x, dim, most)
    full = all_gather(padded, comm, dim, None)
    return torch.cat([full.narrow(dim, r * most, s) for r, s in enumerate(sizes)], dim)


def _pad_to(x: torch.Tensor, dim: int, most: int) -> torch.Tensor:
    return _per_rank(_pad_one)(x, dim, most)


def _pad_one(x: torch.Tensor, dim: int, most: int) -> torch.Tensor:
    missing = most - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim)


def reduce_scatter(
    x: torch.Tensor, comm: AxisComm, dim: int | None, reduce: str, sizes: Sequence[int] | None
) -> torch.Tensor:
    """Sum (or average) over ranks, keep this rank's part: index ``rank`` of dim 0, or its shard of ``dim``."""
    n = comm.size
    if dim is None:
        out = _REDUCE_SCATTER(x.contiguous(), reduce, n, comm.group_name)
        return _wait(out).squeeze(0)
    if sizes is not None:
        most = max(sizes)
        offsets = _offsets(sizes)
        x = torch.cat([_pad_one(x.narrow(dim, o, s), dim, most) for o, s in zip(offsets, sizes)], dim)
        out = reduce_scatter(x, comm, dim, reduce, None)
        return _per_rank(_narrow_own)(out, group_rank(comm), dim, tuple(sizes))
    if dim == 0:
        return _wait(_REDUCE_SCATTER(x.contiguous(), reduce, n, comm.group_name))
    x = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0)  # [n, ...k...]: rank blocks first
    return _wait(_REDUCE_SCATTER(x.contiguous(), reduce, n, comm.group_name)).squeeze(0)


def _narrow_own(x: torch.Tensor, index: int, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
    return x.narrow(dim, 0, sizes[index])


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def all_to_all_uneven(x: torch.Tensor, comm: AxisComm, in_splits: Sequence[int], out_splits: Sequence[int]) -> torch.Tensor:
    """Send rows ``in_splits[j]`` of dim 0 to rank j; receive ``out_splits[j]`` rows from rank j, in rank order."""
    return _wait(_ALL_TO_ALL(x.contiguous(), list(out_splits), list(in_splits), comm.group_name))


def all_to_all(x: torch.Tensor, comm: AxisComm, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``x`` on ``split_dim`` into one piece per rank, send piece j to rank j, concat on ``concat_dim``."""
    n = comm.size
    k = x.shape[split_dim] // n
    y = x.movedim(split_dim, 0).contiguous()
    splits = [k] * n
    out = _wait(_ALL_TO_ALL(y, splits, splits, comm.group_name))
    out = out.view(n, k, *out.shape[1:]).movedim(1, split_dim + 1)  # [n, ...piece...]
    return out.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


# ---------------------------------------------------------------------------
# local (no communication) kernels for convert


def take_slice(x: torch.Tensor, comm: AxisComm, dim: int | None, sizes: Sequence[int] | None) -> torch.Tensor:
    """This rank's part of a replicated value: ``x[rank]``, or its shard of ``dim``.

    A new contiguous tensor, never a view of ``x`` (as the published package): a
    parameter sharded this way owns its storage, which FSDP requires (it refuses
    non-contiguous parameters), and does not keep the whole value alive.
    """
    index = group_rank(comm)
    if dim is None:
        part = x.select(0, index)
    elif sizes is not None:
        part = _per_rank(_take_uneven)(x, index, dim, tuple(sizes))
    else:
        k = x.shape[dim] // comm.size
        part = x.narrow(dim, index * k, k)
    return part.clone(memory_format=torch.contiguous_format)


def _take_uneven(x: torch.Tensor, index: int, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[:index]), sizes[index])


def keep_on_first(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """``x`` on rank 0 of the axis, zeros elsewhere: the pending sum is ``x``."""
    return _per_rank(_keep_if_first)(x, group_rank(comm))


def _keep_if_first(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.clone() if index == 0 else torch.zeros_like(x)


def place_slice(x: torch.Tensor, comm: AxisComm, dim: int | None, sizes: Sequence[int] | None) -> torch.Tensor:
    """Zeros of the full shape with this rank's ``x`` in its place: the pending sum is the whole."""
    return _per_rank(_place_one)(x, group_rank(comm), comm.size, dim, None if sizes is None else tuple(sizes))


def _place_one(x: torch.Tensor, index: int, n: int, dim: int | None, sizes: tuple[int, ...] | None) -> torch.Tensor:
    if dim is None:
        out = x.new_zeros((n, *x.shape))
        out.select(0, index).copy_(x)
        return out
    shape = list(x.shape)
    if sizes is None:
        shape[dim] = n * x.shape[dim]
        start = index * x.shape[dim]
    else:
        shape[dim] = sum(sizes)
        start = sum(sizes[:index])
    out = x.new_zeros(shape)
    out.narrow(dim, start, x.shape[dim]).copy_(x)
    return out
