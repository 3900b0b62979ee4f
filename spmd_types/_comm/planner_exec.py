"""Run a redistribute :class:`~spmd_types._comm.planner.Plan` on a plain tensor with functional collectives.

Rank-dependent choices (which slice to keep, where to put a shard in zeros) use the
rank's mesh coordinate, ``mesh.get_local_rank(axis)``, which is per-rank inside
``LocalTensorMode`` (``dist.get_rank`` is not). Collectives over several axes run on
the flattened group ``mesh[axes]._flatten()``. No autograd.Function: the functional
collectives carry their own (sum) autograd, and the local ops are differentiable.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._torch.private import functional_collectives
from .planner import Plan, Step, mesh_sizes

fc = functional_collectives()  # torch.distributed._functional_collectives

__all__ = ["execute_plan"]


def _group(mesh: Any, axes: tuple[str, ...]) -> Any:
    return mesh[axes[0]] if len(axes) == 1 else mesh[axes]._flatten()


def _coordinate(mesh: Any, axes: tuple[str, ...]) -> Any:
    """This rank's index in the group ``axes`` flattened in the given order (first axis major)."""
    coord: Any = 0
    for axis in axes:
        coord = coord * mesh[axis].size() + mesh.get_local_rank(axis)
    return coord


def _all_to_all(x: torch.Tensor, step: Step, mesh: Any) -> torch.Tensor:
    """Split ``split_dim`` into n chunks, chunk k to group rank k; concatenate what arrives on ``concat_dim``."""
    n = math.prod(mesh[a].size() for a in step.axes)
    stacked = torch.stack(x.chunk(n, dim=step.split_dim), 0).contiguous()
    out = fc.wait_tensor(fc.all_to_all_single(stacked, None, None, _group(mesh, step.axes)))
    return torch.cat(out.unbind(0), dim=step.concat_dim)


def _local_slice(x: torch.Tensor, step: Step, mesh: Any) -> torch.Tensor:
    for axis in step.axes:  # major to minor: each narrows the previous chunk
        size = x.shape[step.scatter_dim] // mesh[axis].size()
        x = x.narrow(step.scatter_dim, mesh.get_local_rank(axis) * size, size)
    return x


def _local_partial(x: torch.Tensor, step: Step, mesh: Any) -> torch.Tensor:
    """R -> P: coordinate 0 keeps the value, others zero. S -> P: the shard in zeros at its offset."""
    n = math.prod(mesh[a].size() for a in step.axes)
    coord = _coordinate(mesh, step.axes)
    if step.gather_dim is None:
        onehot = torch.zeros(n, dtype=torch.bool, device=x.device)
        onehot[0] = True
        keep = onehot.narrow(0, coord, 1).reshape(())
        return torch.where(keep, x, torch.zeros_like(x))
    d, size = step.gather_dim, x.shape[step.gather_dim]
    pad_shape = list(x.shape)
    pad_shape[d] = (n - 1) * size
    pad = x.new_zeros(pad_shape)
    padded = torch.cat([pad, x, pad], dim=d)
    return padded.narrow(d, (n - 1) * size - coord * size, n * size)


def run_step(x: torch.Tensor, step: Step, mesh: Any) -> torch.Tensor:
    """Run one step of a plan on this rank's shard ``x``."""
    kind = step.collective
    if kind == "all_gather":
        return fc.wait_tensor(fc.all_gather_single(x.contiguous(), step.gather_dim, _group(mesh, step.axes)))
    if kind == "reduce_scatter":
        return fc.wait_tensor(fc.reduce_scatter_single(x.contiguous(), "sum", step.scatter_dim, _group(mesh, step.axes)))
    if kind == "all_reduce":
        return fc.wait_tensor(fc.all_reduce(x, "sum", _group(mesh, step.axes)))
    if kind == "all_to_all":
        return _all_to_all(x, step, mesh)
    if kind == "local_slice":
        return _local_slice(x, step, mesh)
    if kind == "local_partial":
        return _local_partial(x, step, mesh)
    raise ValueError(f"unknown plan step {kind!r}")


def execute_plan(x: torch.Tensor, plan: Plan, mesh: Any) -> torch.Tensor:
    """Run ``plan`` on this rank's shard ``x`` (a plain tensor) over ``mesh``; return the new shard.

    Checks, before any communication, that ``mesh`` has the plan's axes and sizes and that
    ``x`` has the plan's source local shape.

    Example::

        plan = plan_redistribute(x, ("tp", None), (None, "tp"), mesh)   # one all_to_all
        y = execute_plan(x, plan, mesh)
    """
    sizes = tuple(mesh_sizes(mesh).items())
    if sizes != plan.mesh_sizes:
        raise ValueError(f"execute_plan: the plan was made for mesh {dict(plan.mesh_sizes)}, got {dict(sizes)}")
    if tuple(x.shape) != plan.src_local_shape:
        raise ValueError(
            f"execute_plan: the plan expects a local shard of shape {plan.src_local_shape} ({plan.src}), got {tuple(x.shape)}"
        )
    for step in plan.steps:
        x = run_step(x, step, mesh)
    return x
