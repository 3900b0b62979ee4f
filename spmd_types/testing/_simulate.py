"""Simulated ranks: ``simulate`` (a fake process group, a named mesh, optionally ``LocalTensorMode``) and per-rank values.

Kept apart from the package's ``__init__`` so that the modules of ``spmd_types.testing`` can import it
without importing each other in a cycle.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Literal

import torch

__all__ = ["simulate", "per_rank", "rank_values"]


def per_rank(fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A tensor whose value on rank ``r`` is ``fn(r)`` (a LocalTensor under LocalTensorMode)."""
    from torch.distributed._local_tensor import rank_map

    return rank_map(fn)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{global rank: plain tensor}`` of a LocalTensor (typed or not)."""
    with torch._C.DisableTorchFunctionSubclass(), _outside_simulation():
        return {r: v.detach() for r, v in t._local_tensors.items()}  # type: ignore[attr-defined]


def _outside_simulation():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

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


def _fake_world(size: int, rank: int = 0) -> bool:
    """Make the default process group a fake one of ``size`` ranks, this process ``rank``; True if this call created it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

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
    dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())
    return True
