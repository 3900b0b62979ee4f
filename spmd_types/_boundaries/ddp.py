"""Typed gradients through torch's DistributedDataParallel: a comm hook that says what DDP made.

A parameter replicated over the data-parallel axis is R there, so the gradient
autograd leaves in ``p.grad`` is P: each rank holds its own batch's share of
the pending sum. DDP's all-reduce (which averages) finishes that sum, and the
result is the same on every rank: R, the gradient of the loss averaged over
``dp``. :func:`register_ddp` installs a comm hook that runs that all-reduce and
types each gradient of the bucket R on the axis, so the next step's checked
code (``p -= lr * p.grad``, an optimizer step) sees what is really there. A
backward under ``ddp.no_sync()`` runs no hook, so its gradients stay P and a
step taken without a later synced backward is rejected where it uses them.

``torch.nn.parallel`` is imported only when :func:`register_ddp` is called.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._checker.tensor import type_in_place
from .._core.mesh import Axis, current_mesh, resolve_axis
from .._core.types import R, TypeMap

__all__ = ["register_ddp"]

_REDUCE_OPS = ("avg", "sum")


def register_ddp(model: Any, axis: Axis = "dp", *, op: str = "avg") -> Any:
    """Register a comm hook on DDP ``model`` that all-reduces over ``axis`` and types the gradients R there.

    ``op="avg"`` (DDP's own meaning) gives the gradient of the loss averaged
    over ``axis``; ``op="sum"`` the gradient of the summed loss. ``axis`` is a
    mesh axis name (resolved against the current mesh now, so the hook also
    works on autograd's worker threads), a ProcessGroup or a 1-D DeviceMesh; its
    group must be the one DDP was built on. Every parameter typed so far must be
    R on ``axis`` (its gradient is then a pending sum that the all-reduce
    finishes); parameters typed later are checked when the hook runs, before it
    communicates. Returns ``model``.

    Example::

        ddp = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            spmd.assert_type(model, {"dp": spmd.R})
            spmd.register_ddp(ddp, "dp")
            ddp(x).pow(2).mean().backward()   # model.weight.grad is R on dp, averaged
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"spmd.register_ddp takes a torch.nn.parallel.DistributedDataParallel model, got {type(model).__name__}"
        )
    if op not in _REDUCE_OPS:
        raise ValueError(f"spmd.register_ddp: op must be 'avg' or 'sum', got {op!r}")
    name, group = _axis_group(axis)
    if group is not model.process_group:
        raise ValueError(
            f"spmd.register_ddp: this DDP model all-reduces over another process group than axis '{name}'; "
            f"build it with DistributedDataParallel(model, process_group=<the '{name}' group>)"
        )
    for pname, p in model.module.named_parameters():
        _check_param(pname, p, name)
    names = {id(p): n for n, p in model.module.named_parameters()}
    model.register_comm_hook(_HookState(name, group, op, names), _typed_allreduce_hook)
    return model


def _axis_group(axis: Axis) -> tuple[str, dist.ProcessGroup]:
    if isinstance(axis, dist.ProcessGroup):
        mesh = current_mesh()
        found = [n for n, g in mesh.groups.items() if g is axis] if mesh is not None else []
        return (found[0] if found else f"group {axis.group_name}"), axis
    try:
        name = resolve_axis(axis)
    except (ValueError, RuntimeError, TypeError) as err:
        raise type(err)(f"spmd.register_ddp: {err}") from None
    return name, current_mesh().groups[name]  # type: ignore[union-attr]


def _check_param(pname: str, p: torch.Tensor, axis: str) -> None:
    """A typed parameter must be R on ``axis``: DDP all-reduces its gradient, which is then a P."""
    types: TypeMap | None = getattr(p, "_spmd_types", None)
    if types is None or axis not in types or types[axis] is R:
        return
    raise TypeError(
        f"spmd.register_ddp: parameter '{pname}' is {types[axis]} on axis '{axis}', not R. DDP all-reduces "
        f"every gradient over '{axis}', which is right only for a replicated (R) parameter, whose gradient "
        f"is a pending sum (P); type it with spmd.assert_type(model, {{'{axis}': spmd.R, ...}})"
    )


class _HookState:
    __slots__ = ("axis", "group", "op", "names")

    def __init__(self, axis: str, group: dist.ProcessGroup, op: str, names: dict[int, str]) -> None:
        self.axis, self.group, self.op, self.names = axis, group, op, names


# No annotations on ``bucket`` and the result: DDP compares them with dist.GradBucket and
# Future[Tensor], and this module's postponed (string) annotations would never be equal.
def _typed_allreduce_hook(state: _HookState, bucket):  # noqa: ANN001, ANN201
    """All-reduce the bucket (averaged for op='avg'), then type each of its gradients R on the axis."""
    params = bucket.parameters()
    for p in params:
        _check_param(state.names.get(id(p), "?"), p, state.axis)
    buffer = bucket.buffer()
    if state.op == "avg":
        buffer.div_(state.group.size())
    fut = dist.all_reduce(buffer, group=state.group, async_op=True).get_future()  # type: ignore[union-attr]

    def typed(_: torch.futures.Future) -> torch.Tensor:
        for p in params:
            types = getattr(p, "_spmd_types", None)
            if types is not None and p.grad is not None and state.axis in types:
                type_in_place(p.grad, types.backward().replace(state.axis, R))
        return buffer  # all_reduce works in place

    return fut.then(typed)
