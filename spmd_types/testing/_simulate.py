"""Simulated ranks: ``simulate`` (a fake process group, a named mesh, optionally ``LocalTensorMode``) and per-rank values.

Kept apart from the package's ``__init__`` so that the modules of ``spmd_types.testing`` can import it
without importing each other in a cycle.
"""

from __future__ import annotations

import builtins
import contextlib
import math
from typing import Any, Callable, Iterator, Literal

import torch

from .._torch.private import (
    DisableTorchFunctionSubclass,
    SymNode,
    clear_sharding_cache,
    fake_store,
    int_on_rank,
    local_dist_class,
    local_tensors_of,
    simulator,
)
from ._rank_ints import group_index as _group_index
from ._rank_ints import per_rank_int as _per_rank_int
from ._simulate_fsdp import fsdp_on_simulated_ranks

__all__ = ["simulate", "per_rank", "rank_values", "ranks_read_per_rank"]


def per_rank(fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A tensor whose value on rank ``r`` is ``fn(r)`` (a LocalTensor under LocalTensorMode)."""
    rank_map = simulator().rank_map

    return rank_map(fn)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{global rank: plain tensor}`` of a LocalTensor (typed or not)."""
    with DisableTorchFunctionSubclass(), _outside_simulation():
        return {r: v.detach() for r, v in local_tensors_of(t).items()}  # type: ignore[union-attr]


def _outside_simulation():
    maybe_disable_local_tensor_mode = simulator().maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()


def _coords(shape: torch.Size) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [c + (i,) for c in out for i in range(n)]
    return out


@contextlib.contextmanager
def simulate(
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    *,
    ranks: Literal["fake", "local"] = "fake",
    device: Literal["meta", "cpu"] = "meta",
    rank: int = 0,
) -> Iterator[Any]:
    """Run a whole mesh's program in this one process, with no GPU; yields the ``DeviceMesh``.

    Sets up a fake process group of ``prod(mesh_shape)`` ranks, the named mesh
    on it, and makes it the current mesh (:func:`spmd_types.set_current_mesh`).
    ``ranks="fake"`` runs one rank's program (rank 0, or ``rank``): collectives return tensors of
    the right shape without moving data, so with ``device="meta"`` (tensors
    with shapes and no storage) a production-sized model typechecks in
    seconds. ``ranks="local"`` also enters torch's ``LocalTensorMode``: every
    rank's values are computed (``device="cpu"`` only), so numerics can be
    compared with :func:`denote`. Build the model *inside* the block: a
    parameter created outside is one plain tensor, not one per rank, and on
    the wrong device. On exit the mode, the mesh and a process group this
    call created are torn down.

    With ``ranks="local"``, code that reads its rank reads each simulated rank's own:
    ``dist.get_rank(group)`` and ``group.rank()`` of a sub-group answer a per-rank int
    (:func:`ranks_read_per_rank`), so torchtitan's vocab-parallel embedding and Megatron's
    vocabulary slicing run as on real ranks. ``dist.get_world_size(group)`` is the group's size.
    FSDP2 (``fully_shard``) runs too: its storage resizing and shard picking run per simulated rank
    (:func:`~spmd_types.testing._simulate_fsdp.fsdp_on_simulated_ranks`), its all-gather and
    reduce-scatter on every rank's values.

    ``rank`` (with ``ranks="fake"``) is the rank whose program runs: this
    process joins the fake group as that rank, so its coordinates on the mesh,
    its groups' ranks and ``spmd.axis_index`` are that rank's. A program that
    differs per rank, such as a pipeline stage, is checked by running it as one
    of its ranks (a stage's first rank, say).

    Example::

        with simulate((8, 8), ("dp", "tp")) as mesh, spmd.typecheck():
            model = build_model()          # on the meta device, 8 x 8 ranks
            loss = model(batch).sum()

        with simulate((2, 4), ("pp", "tp"), rank=4) as mesh:  # rank 4: pipeline stage 1's first rank
            assert tuple(mesh.get_coordinate()) == (1, 0)
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .._core.mesh import set_current_mesh

    if ranks not in ("fake", "local"):
        raise ValueError(f"simulate: ranks must be 'fake' or 'local', got {ranks!r}")
    if device not in ("meta", "cpu"):
        raise ValueError(f"simulate: device must be 'meta' or 'cpu', got {device!r}")
    if ranks == "local" and device == "meta":
        raise ValueError("simulate: ranks='local' computes every rank's values, so it needs device='cpu'")
    if len(mesh_shape) != len(names):
        raise ValueError(f"simulate: {len(mesh_shape)} mesh sizes but {len(names)} axis names")
    world = math.prod(mesh_shape)
    if ranks == "local" and rank != 0:
        raise ValueError(f"simulate: ranks='local' runs every rank at once, so it takes no rank= (got {rank!r})")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"simulate: rank must be one of the mesh's {world} ranks (0 to {world - 1}), got {rank!r}")
    created = _fake_world(world, rank)
    clear_sharding_cache()  # DTensor's cached specs name the meshes of earlier simulations (equal, not the same)
    try:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=tuple(names))
        with contextlib.ExitStack() as stack:
            if ranks == "local":
                LocalTensorMode = simulator().LocalTensorMode

                stack.enter_context(LocalTensorMode(world))
                stack.enter_context(ranks_read_per_rank())
                stack.enter_context(_per_rank_ints_have_hints())
                stack.enter_context(fsdp_on_simulated_ranks())
            stack.enter_context(torch.device(device))
            stack.enter_context(set_current_mesh(mesh))
            yield mesh
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _fake_world(size: int, rank: int = 0) -> bool:
    """Make the default process group a fake one of ``size`` ranks, this process ``rank``; True if this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        backend = dist.get_backend()
        if backend == "fake" and dist.get_world_size() == size and dist.get_rank() == rank:
            return False
        if backend != "fake":
            raise RuntimeError(
                f"simulate: a real process group ({backend!r}) is already initialized; "
                "simulate before init_process_group or after destroy_process_group"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=size, store=fake_store()())
    return True


# ---------------------------------------------------------------------------
# ranks read from process groups, per simulated rank


@contextlib.contextmanager
def ranks_read_per_rank() -> Iterator[None]:
    """Inside, under ``LocalTensorMode``: ``group.rank()`` and ``dist.get_rank(group)`` answer per simulated rank.

    The answer is a per-rank ``SymInt``: arithmetic, slicing, ``min`` and ``max`` run per rank (inside,
    the builtins ``min`` and ``max`` fall back to picking rank by rank where the ranks' ints compare
    differently), as do comparisons that come out the same on every rank; a Python branch that
    differs per rank (``if dist.get_rank(group) == 0``) cannot be simulated. Asked without a group,
    or through the default group's own ``rank()``, the answer stays this process's rank: code that
    makes process groups by membership asks so (``torch.distributed`` itself,
    Megatron's ``initialize_model_parallel``); ``dist.get_rank(group)`` names the group as an axis
    (a 1-D mesh's group is the default group) and is answered per rank. torch 2.14's simulator
    answers ``dist.get_rank`` itself, the default group per rank too; here, asked with no group, it
    answers this process's rank as on 2.13, and a plain int where every rank has the same one.
    """
    cache: dict[tuple[int, frozenset], Any] = {}
    with _group_rank(cache), _dist_get_rank(cache), _builtin_extremes():
        yield


def _index_in(group: Any, cache: dict[tuple[int, frozenset], Any]) -> Any:
    enabled_local_tensor_mode = simulator().enabled_local_tensor_mode

    ranks = frozenset(enabled_local_tensor_mode().ranks)
    key = (id(group), ranks)
    if key not in cache:
        cache[key] = (group, _group_index(group, ranks))  # the group kept alive: ids stay unique
    return cache[key][1]


@contextlib.contextmanager
def _group_rank(cache: dict[tuple[int, frozenset], Any]) -> Iterator[None]:
    """``ProcessGroup.rank`` of a sub-group: each simulated rank's index in it."""
    import torch.distributed as dist
    enabled_local_tensor_mode = simulator().enabled_local_tensor_mode

    saved = vars(dist.ProcessGroup)["rank"]  # the class attribute itself (a pybind method), restored as it was
    original = dist.ProcessGroup.rank

    def rank(self: Any) -> Any:
        if enabled_local_tensor_mode() is None or self is dist.group.WORLD or self.size() == 1:
            return original(self)
        return _index_in(self, cache)

    dist.ProcessGroup.rank = rank  # type: ignore[method-assign]
    try:
        yield
    finally:
        dist.ProcessGroup.rank = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def _dist_get_rank(cache: dict[tuple[int, frozenset], Any]) -> Iterator[None]:
    """``dist.get_rank(group)`` per simulated rank (torch 2.13), or torch 2.14's answer as an int where it is one."""
    import torch.distributed as dist
    local = simulator()
    local_dist = local_dist_class()
    if local_dist is not None:  # torch 2.14: LocalTensorMode patches dist.get_rank with this class's
        from torch.distributed.distributed_c10d import get_rank as process_rank

        torchs = vars(local_dist)["get_rank"]

        def one_int(group: Any = None) -> Any:
            if group is None:  # as on 2.13: code that makes groups by membership asks so (Megatron)
                return process_rank()
            found = torchs.__func__(group)  # a one-rank simulation (the reference) gets an int to seed with
            return found.node.val if isinstance(getattr(found, "node", None), local.ConstantIntNode) else found

        current = dist.get_rank  # torch's, put there when LocalTensorMode was entered (and on every re-entry)
        local_dist.get_rank, dist.get_rank = staticmethod(one_int), one_int
        try:
            yield
        finally:
            local_dist.get_rank, dist.get_rank = torchs, current
        return
    original = dist.get_rank

    def get_rank(group: Any = None) -> Any:
        lm = local.enabled_local_tensor_mode()
        if lm is None or not dist.is_initialized() or group is None or group.size() == 1:
            return original(group)
        if group is dist.group.WORLD:  # named as an axis (a 1-D mesh's group is the default one)
            return _per_rank_int({r: r for r in lm.ranks})
        return _index_in(group, cache)

    dist.get_rank = get_rank
    try:
        yield
    finally:
        dist.get_rank = original


@contextlib.contextmanager
def _builtin_extremes() -> Iterator[None]:
    """The builtins ``min`` and ``max`` pick rank by rank where per-rank ints compare differently."""
    saved = builtins.min, builtins.max
    builtins.min, builtins.max = _per_rank_extreme(saved[0]), _per_rank_extreme(saved[1])
    try:
        yield
    finally:
        builtins.min, builtins.max = saved


def _per_rank_extreme(pick: Callable[..., Any]) -> Callable[..., Any]:
    """``min`` or ``max`` that, where per-rank ints compare differently on different ranks, picks rank by rank.

    torchtitan's loss takes ``min(vocab_size, start + chunk)`` of a per-rank ``start``: the last rank's
    bound is the vocabulary size, the others' their chunk's end. Other calls run the builtin unchanged.
    """
    def extreme(*args: Any, **kwargs: Any) -> Any:
        try:
            return pick(*args, **kwargs)
        except AssertionError:  # a LocalIntNode comparison that differs per rank
            sim = simulator()
            LocalIntNode, enabled_local_tensor_mode = sim.LocalIntNode, sim.enabled_local_tensor_mode  # noqa: N806

            lm = enabled_local_tensor_mode()
            items = list(args[0]) if len(args) == 1 else list(args)
            nodes = [x.node if isinstance(x, torch.SymInt) else x for x in items]
            if lm is None or kwargs or not any(isinstance(n, LocalIntNode) for n in nodes):
                raise
            return _per_rank_int({r: pick(int_on_rank(n, r) for n in nodes) for r in lm.ranks})

    return extreme


@contextlib.contextmanager
def _per_rank_ints_have_hints() -> Iterator[None]:
    """Per-rank ints answer what torch asks of concrete sizes (``has_hint``, ``statically_known_true``).

    A per-rank int (``LocalIntNode``) holds concrete values, so it has a hint: an expert-parallel token
    exchange makes tensors whose length differs per rank, and indexing one asks its size for a hint.
    Slicing with per-rank bounds (Megatron's experts: ``routing_map[:, first:last]`` with ``first``
    from the ep rank) compares them, and torch asks the comparison (a constant bool node) whether it is
    statically known true. Neither torch 2.13's nor 2.14's simulator answers; both are added for the
    simulation and taken away after it.
    """
    LocalIntNode = simulator().LocalIntNode

    added = []
    if not hasattr(LocalIntNode, "has_hint"):
        LocalIntNode.has_hint = lambda self: True  # type: ignore[attr-defined]
        added.append((LocalIntNode, "has_hint"))
    node = SymNode
    if not hasattr(node, "statically_known_true"):
        node.statically_known_true = lambda self, file, line: self.guard_or_false(file, line)  # type: ignore[attr-defined]
        added.append((node, "statically_known_true"))
    try:
        yield
    finally:
        for owner, name in added:
            delattr(owner, name)
