"""``reinterpret_mesh``: the same tensor, typed on another presentation of the same ranks.

A dense mesh ``(dp, cp, tp)`` and an expert mesh ``(edp, ep, etp)`` can run
over the same ranks; a flattened ``dp_cp`` is ``(dp, cp)`` taken together. A
type moves between them by ``_core/spaces.py``'s rule (matching regions keep
their type; the rest flatten group by group, one type per group). No data
changes and nothing communicates, forward or backward: the gradient's type
moves back the same way.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .._checker.tensor import make_typed
from .._checker.trace import log_op
from .._core.axes import MeshAxis, region_of_group
from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.mesh import Mesh, current_mesh, resolve_axis
from .._core.spaces import GroupMove, move_spec, move_types
from .._core.state import STATE
from .._core.traced import register_call, routed, traced_call
from .._core.types import AxisType, Space, TypeMap, compatible
from .._core.whole_type import TensorSpmdType

__all__ = ["reinterpret_mesh", "space_of"]


def reinterpret_mesh(tensor: torch.Tensor, type: Any = None, *, inplace: bool = False) -> torch.Tensor:  # noqa: A002
    """``tensor`` retyped onto ``type`` (a mesh; default the current one), a presentation of the same ranks.

    ``type`` is a ``DeviceMesh``, a ``{name: ProcessGroup}`` or ``{name: MeshAxis}``
    dict, a collection of ``MeshAxis`` (``spmd.current_mesh()``), or the target
    type itself, ``{axis: type}`` (the axes, checked against the moved type).
    Axes over the same ranks keep their type; the others must flatten into each
    other group by group with one type per group, else ``SpmdTypeError``.
    Outside :func:`typecheck` (or on a plain tensor) ``x`` comes back unchanged.
    ``inplace=True`` retypes ``x`` itself (the published API's form) instead of an alias.

    Example::

        with spmd.set_current_mesh(expert_mesh):     # (edp, ep) over the ranks of (dp, tp)
            tokens = spmd.reinterpret_mesh(tokens, spmd.current_mesh())
    """
    x, mesh = tensor, type  # the published parameter names: the tensor, and its target (a mesh or a type)
    if routed():  # torch.compile traces: one graph node, which the compiled graph's checker reads
        return x if not STATE.checking else traced_call("reinterpret_mesh", x, mesh)
    types = getattr(x, "_spmd_types", None)
    if not STATE.checking or types is None:
        return x
    declared = None
    if isinstance(mesh, TensorSpmdType):  # the published whole type: its per-axis types
        mesh = mesh.local_type
    if isinstance(mesh, Mapping) and mesh and all(isinstance(t, AxisType) for t in mesh.values()):
        declared = {_region(k): t for k, t in mesh.items()}  # {axis: type}: the target's axes, and a check
        mesh = frozenset(declared)
    target = space_of(mesh)
    found = move_types(types, target)
    if isinstance(found, str):
        raise SpmdTypeError(
            Rejection(
                f"spmd.reinterpret_mesh: the tensor's type cannot move onto the target mesh: {found}.",
                [("types", types.format()), ("target", ", ".join(f"{n}={r.layout_str()}" for n, r in target.pairs))],
                ["convert the axes that block the move to one type per flattened group first"],
            ),
            user_source_line(),
        )
    moved, groups = found
    if declared is not None:
        _check_declared(types, moved, target, declared)
    if moved is types:
        return x
    spec = getattr(x, "_spmd_spec", None)
    if inplace:
        x._spmd_types = moved  # type: ignore[attr-defined]
    out = x if inplace else make_typed(x, moved)
    if spec is not None:
        out._spmd_spec = _move_spec(spec, groups)
    if STATE.tracing:
        log_op("spmd.reinterpret_mesh", [x], out)
    return out


def _region(axis: Any) -> MeshAxis:
    """A key of a declared target type as a region: a MeshAxis, a ProcessGroup, or a name of the current mesh."""
    if isinstance(axis, str):
        mesh = current_mesh()
        if mesh is None:
            raise RuntimeError(f"spmd.reinterpret_mesh: axis {axis!r} is a name, but no mesh is current")
        return mesh.region(resolve_axis(axis))
    return axis if isinstance(axis, MeshAxis) else region_of_group(axis)


def _check_declared(types: TypeMap, moved: TypeMap, target: Space, declared: dict) -> None:
    """The moved type must be what the caller declared, axis by axis."""
    names = {region: name for name, region in target.pairs}
    for region, want in declared.items():
        name = names.get(region)
        have = moved.get(name) if name is not None else None
        if name is not None and not compatible(have, want):
            raise SpmdTypeError(
                Rejection(
                    f"spmd.reinterpret_mesh: the tensor's type moves onto axis '{name}' as {have}, and the declared "
                    f"type says {want}.",
                    [("types", types.format()), ("moved", moved.format())],
                    [f"declare {have} on '{name}', or change the type on the source mesh first"],
                ),
                user_source_line(),
            )


def space_of(mesh: Any) -> Space:
    """The space (names and regions) of a mesh given in any form ``set_current_mesh`` takes; None: the current."""
    current = current_mesh()
    if mesh is None:
        if current is None:
            raise RuntimeError("spmd.reinterpret_mesh needs a mesh, or a current mesh")
        return current.space
    if isinstance(mesh, Mesh):
        return mesh.space
    if current is not None and isinstance(mesh, (frozenset, set)) and all(isinstance(a, MeshAxis) for a in mesh):
        if {a for a in mesh if a.size() > 1} == {current.region(n) for n in current.typed_axes}:
            return current.space  # spmd.current_mesh(): keep the current mesh's names
    return Mesh.from_user(mesh).space


def _move_spec(spec: tuple, groups: list[GroupMove]) -> tuple:
    """``spec`` renamed group by group (``_core/spaces.py``), or the error saying which dim blocks it."""
    moved = move_spec(spec, groups)
    if isinstance(moved, str):
        raise SpmdTypeError(
            Rejection(
                f"spmd.reinterpret_mesh: the tensor's partition spec cannot move onto the target mesh: {moved}.",
                [("spec", str(spec))],
                ["gather the dim first, or shard it on the whole group in order"],
            ),
            user_source_line(),
        )
    return moved


def _same_data(x: torch.Tensor, mesh: Any = None) -> torch.Tensor:
    """What ``reinterpret_mesh``'s graph node runs: the same data (a new value, typed by the checker)."""
    return x.view_as(x)


register_call("reinterpret_mesh", reinterpret_mesh, _same_data)
