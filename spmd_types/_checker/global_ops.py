"""Global SPMD beside each checked op: operands moved onto the current mesh, partition specs propagated.

``tensor.py``'s typed path asks these three when checking is global: an operand typed on another
presentation of the ranks moves onto the current mesh first (type and spec); the result's partition
spec comes from shard propagation (a contraction over a sharded dim is the pending sum it is, until
something claims it); a failure is explained by the rule that refused it.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.implicit_mesh import mesh_of_space
from .._core.mesh import current_mesh
from .._core.spaces import rehome
from .._core.state import STATE
from .._core.types import P, TypeMap
from .._global.shard_props import PendingSum
from .._global.shard_rules import explain_failure, propagate, raise_pending
from .._local.op_registry import entry_for
from .._torch.private import DisableTorchFunctionSubclass
from .run_ops import _TYPED_CLASSES

__all__ = ["onto_current_mesh", "explain", "global_types", "set_spec"]

_DisableTF = DisableTorchFunctionSubclass


def onto_current_mesh(func, args, kwargs) -> None:
    """Global SPMD reads partition specs by the current mesh's names: an operand typed on another presentation of
    the ranks (``spmd.reinterpret_mesh``'s rule) moves onto it first, type and spec, or the op is refused."""
    mesh = current_mesh()
    if mesh is None:
        return
    space = mesh.space
    for a in (*args, *kwargs.values()):
        for t in (a if type(a) in (list, tuple) else (a,)):
            types = getattr(t, "_spmd_types", None) if isinstance(t, torch.Tensor) else None
            if types is None or types.space is None or types.space is space:
                continue
            why = rehome(t, space)
            if why is not None:
                raise SpmdTypeError(
                    Rejection(f"Global SPMD: {entry_for(func).display} has an operand typed on another mesh, and it "
                              f"cannot move onto the current one: {why}.", [("operand", types.format())],
                              ["spmd.reinterpret_mesh(x, mesh) onto a mesh over the same ranks first"]),
                    user_source_line(),
                )


def _mesh_of(types: TypeMap) -> Any:
    """The current mesh, else (typed by groups alone) the one the operands were typed on."""
    mesh = current_mesh()
    return mesh if mesh is not None else mesh_of_space(types.space)


def explain(func, args, kwargs, out_types: TypeMap) -> None:
    mesh = _mesh_of(out_types)
    if mesh is not None:
        with _DisableTF():
            explain_failure(func, args, kwargs, out_types, mesh.global_axes(STATE.local_axes), mesh.sizes(),
                            STATE.out_partial)


def global_types(func, args, kwargs, out, out_types: TypeMap) -> tuple[TypeMap, Any]:
    """The result's types and partition spec in global SPMD (a contraction over a sharded dim: its pending sum)."""
    mesh = _mesh_of(out_types)
    if mesh is None:
        return out_types, None
    global_axes, sizes = mesh.global_axes(STATE.local_axes), mesh.sizes()
    with _DisableTF():
        spec = propagate(func, args, kwargs, out, out_types, global_axes, sizes, STATE.out_partial)
        if isinstance(spec, PendingSum):
            pending = _pending_sum(spec, out, out_types)
            if pending is None:
                raise_pending(func, spec)
            # The pending sum it is: P on those axes, usable once an assert or a declared type claims it.
            out_types = TypeMap.of({**out_types.as_dict(), **{a: P for a in pending}}, out_types.space,
                                   out_types.pending | pending)
            spec = propagate(func, args, kwargs, out, out_types, global_axes, sizes, STATE.out_partial | pending)
    dest = out if isinstance(out, torch.Tensor) and type(out) in _TYPED_CLASSES else None
    if dest is not None and spec is not None and getattr(dest, "_spmd_spec", spec) != spec:
        raise SpmdTypeError(
            Rejection(
                "Global SPMD: an in-place op cannot change its tensor's layout.",
                [("op", entry_for(func).display), ("before", str(dest._spmd_spec)), ("after", str(spec))],
                ["the out-of-place form, assigning the result"],
            ),
            user_source_line(),
        )
    return out_types, spec


def _pending_sum(spec: PendingSum, out: Any, out_types: TypeMap) -> frozenset[str] | None:
    """The axes of a contraction over a sharded dim (a tensor result, V there locally), or None.

    None inside an explicit ``out_partial_axes=`` call: it names the partial axes, and these are not among them.
    """
    axes = frozenset(spec.axes)
    if STATE.out_partial or not isinstance(out, torch.Tensor):
        return None
    if not all(getattr(out_types.get(a), "is_varying", False) for a in axes):
        return None
    return axes


def set_spec(out: Any, spec) -> None:
    if isinstance(out, torch.Tensor):
        out._spmd_spec = spec
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                o._spmd_spec = spec
