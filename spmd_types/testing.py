"""Test helpers: count communication, build per-rank values, compute denotations.

For single-process simulations with torch's ``LocalTensorMode`` (every rank
in one process, real values) on a fake process group::

    from spmd_types.testing import CommCounter, denote, per_rank
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        x = per_rank(lambda r: torch.full((2,), float(r)))
        with CommCounter() as comms:
            y = spmd.all_reduce(x, "tp", src=spmd.P, dst=spmd.R)
        assert comms.counts == {"all_reduce": 1}
        torch.testing.assert_close(denote(y, mesh, {"tp": spmd.R}), denote(x, mesh, {"tp": spmd.P}))
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any, Callable, Iterator, Literal, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._types import I, P, R, SpmdType, V, backward_type

__all__ = ["CommCounter", "per_rank", "rank_values", "denote", "pair", "same_on_ranks", "random_value", "simulate"]

# ``_c10d_functional`` op name -> the short name the counter reports.
_SHORT = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
_SKIP = ("wait_tensor", "_wrap_tensor_autograd")


class CommCounter(TorchDispatchMode):
    """Count functional collectives by kind: ``{"all_reduce": 1, "reduce_scatter": 2}``.

    Counts what runs inside the ``with`` block, forward and backward. Under
    ``LocalTensorMode`` enter it *inside* that mode (outside it sees nothing).
    It cannot be active while a ``torch.compile``'d function runs.

    Example::

        with LocalTensorMode(4), CommCounter() as comms:
            spmd.all_gather(x, "tp", src=spmd.V, dst=spmd.R).sum().backward()
        assert comms.counts == {"all_gather": 1, "reduce_scatter": 1}
    """

    def __init__(self) -> None:
        super().__init__()
        self._counts: Counter[str] = Counter()

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def reset(self) -> None:
        self._counts.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d_functional"):
            name = func.overloadpacket.__name__
            if name not in _SKIP:
                self._counts[_SHORT.get(name, name)] += 1
        return func(*args, **(kwargs or {}))


def per_rank(fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A tensor whose value on rank ``r`` is ``fn(r)`` (a LocalTensor under LocalTensorMode)."""
    from torch.distributed._local_tensor import rank_map

    return rank_map(fn)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{global rank: plain tensor}`` of a LocalTensor (typed or not)."""
    with torch._C.DisableTorchFunctionSubclass(), _outside_simulation():
        return {r: v.detach() for r, v in t._local_tensors.items()}  # type: ignore[attr-defined]


def same_on_ranks(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One value ``fn()`` held by every rank (an R or I value)."""
    value = fn()
    return per_rank(lambda r: value.clone())


def _combine(values: list[torch.Tensor], t: SpmdType, axis: str) -> torch.Tensor:
    if t is R or t is I:
        for v in values[1:]:
            if v.shape != values[0].shape or not torch.equal(v, values[0]):
                raise AssertionError(f"a {t} value differs across ranks of axis '{axis}'")
        return values[0]
    if t is P:
        return torch.stack(values).sum(0)
    if t is V:
        return torch.stack(values)
    return torch.cat(values, t.dim)  # type: ignore[attr-defined]


def denote(t: torch.Tensor, mesh: Any, types: Mapping[str, SpmdType], *, first: str | None = None) -> torch.Tensor:
    """What per-rank ``t`` of ``types`` means on one device (CONTRACT section 1).

    R/I: the one value (checked equal on every rank); V: the values stacked on a
    new dim 0; S(d): concatenated on dim d; P: summed. Axes are folded
    innermost first (``first`` folds that axis before all others), so an op on
    one axis compares per slice of the others.
    """
    with _outside_simulation():
        return _denote(rank_values(t), mesh, types, first)


def _outside_simulation():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()


def _denote(values: dict[int, torch.Tensor], mesh: Any, types: Mapping[str, SpmdType], first: str | None) -> torch.Tensor:
    names = list(mesh.mesh_dim_names)
    layout = mesh.mesh
    table: dict[tuple[int, ...], torch.Tensor] = {}
    for coord in _coords(layout.shape):
        table[coord] = values[int(layout[coord])]
    order = list(reversed(range(len(names))))
    if first is not None:
        order.remove(names.index(first))
        order.insert(0, names.index(first))
    alive = list(range(len(names)))
    for k in order:
        pos = alive.index(k)
        groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for coord in sorted(table):
            groups.setdefault(coord[:pos] + coord[pos + 1:], []).append(table[coord])
        table = {key: _combine(vals, types[names[k]], names[k]) for key, vals in groups.items()}
        alive.pop(pos)
    return table[()]


def _coords(shape: torch.Size) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [c + (i,) for c in out for i in range(n)]
    return out


def pair(primal: torch.Tensor, cotangent: torch.Tensor, mesh: Any, types: Mapping[str, SpmdType]) -> torch.Tensor:
    """The inner product of a value of ``types`` with a gradient of the backward types, on denotations.

    For a P or V value (and an R value, whose gradient is P) this is the sum
    over ranks of the local inner products; for I it is one copy's.
    """
    back = {a: backward_type(t) for a, t in types.items()}
    a, b = denote(primal, mesh, types), denote(cotangent, mesh, back)
    with _outside_simulation():
        return (a.double() * b.double()).sum()


def random_value(mesh: Any, types: Mapping[str, SpmdType], shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A random per-rank value of ``types``: equal across an axis where the type is R or I.

    Rank ``r``'s value depends only on its coordinates along the axes where it
    may differ (V, S(d), P), so an R/I value really is the same on every rank.
    """
    names = list(mesh.mesh_dim_names)
    layout = mesh.mesh
    keep = [i for i, a in enumerate(names) if types[a] not in (R, I)]
    by_rank: dict[int, torch.Tensor] = {}
    for coord in _coords(layout.shape):
        key = tuple(coord[i] for i in keep)
        g = torch.Generator().manual_seed(seed * 1000003 + hash(key) % 1000003)
        by_rank[int(layout[coord])] = torch.randn(shape, generator=g)
    return per_rank(lambda r: by_rank[r].clone())


@contextlib.contextmanager
def simulate(
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    *,
    ranks: Literal["fake", "local"] = "fake",
    device: Literal["meta", "cpu"] = "meta",
) -> Iterator[Any]:
    """Run a whole mesh's program in this one process, with no GPU; yields the ``DeviceMesh``.

    Sets up a fake process group of ``prod(mesh_shape)`` ranks, the named mesh
    on it, and makes it the current mesh (:func:`spmd_types.set_current_mesh`).
    ``ranks="fake"`` runs rank 0's program only: collectives return tensors of
    the right shape without moving data, so with ``device="meta"`` (tensors
    with shapes and no storage) a production-sized model typechecks in
    seconds. ``ranks="local"`` also enters torch's ``LocalTensorMode``: every
    rank's values are computed (``device="cpu"`` only), so numerics can be
    compared with :func:`denote`. Build the model *inside* the block: a
    parameter created outside is one plain tensor, not one per rank, and on
    the wrong device. On exit the mode, the mesh and a process group this
    call created are torn down.

    Example::

        with simulate((8, 8), ("dp", "tp")) as mesh, spmd.typecheck():
            model = build_model()          # on the meta device, 8 x 8 ranks
            loss = model(batch).sum()
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ._mesh import set_current_mesh

    if ranks not in ("fake", "local"):
        raise ValueError(f"simulate: ranks must be 'fake' or 'local', got {ranks!r}")
    if device not in ("meta", "cpu"):
        raise ValueError(f"simulate: device must be 'meta' or 'cpu', got {device!r}")
    if ranks == "local" and device == "meta":
        raise ValueError("simulate: ranks='local' computes every rank's values, so it needs device='cpu'")
    if len(mesh_shape) != len(names):
        raise ValueError(f"simulate: {len(mesh_shape)} mesh sizes but {len(names)} axis names")
    world = math.prod(mesh_shape)
    created = _fake_world(world)
    try:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=tuple(names))
        with contextlib.ExitStack() as stack:
            if ranks == "local":
                from torch.distributed._local_tensor import LocalTensorMode

                stack.enter_context(LocalTensorMode(world))
            stack.enter_context(torch.device(device))
            stack.enter_context(set_current_mesh(mesh))
            yield mesh
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _fake_world(size: int) -> bool:
    """Make the default process group a fake one of ``size`` ranks; True if this call created it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        backend = dist.get_backend()
        if backend == "fake" and dist.get_world_size() == size:
            return False
        if backend != "fake":
            raise RuntimeError(
                f"simulate: a real process group ({backend!r}) is already initialized; "
                "simulate before init_process_group or after destroy_process_group"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    return True
