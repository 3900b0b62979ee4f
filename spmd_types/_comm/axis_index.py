"""``spmd.axis_index(axis)``: this rank's index on a mesh axis, typed V (JAX's ``lax.axis_index``).

A mask or an offset built from the rank differs per rank, so it is V on that
axis; a plain ``dist.get_rank()`` turned into a tensor would be typed like a
constant (R) by accident. On every other axis of the mesh the index is the
same, so it is R there. Under ``LocalTensorMode`` every simulated rank gets
its own index.
"""

from __future__ import annotations

from typing import Any

import torch

from .._checker.asserts import assert_type
from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.mesh import current_mesh
from .._core.state import STATE
from .._core.types import R, V
from . import impl as impl
from .call import resolve_comm

__all__ = ["axis_index"]


def axis_index(axis: Any, *, device: Any = None) -> torch.Tensor:
    """This rank's index on ``axis``: an int64 0-d tensor, typed V on ``axis`` and R on the other axes.

    ``axis`` is a mesh axis name, a ProcessGroup, a 1-D DeviceMesh, or a tuple
    of names (the index on the flattened axes, in mesh order). ``device``
    defaults to the current mesh's device type (``"cpu"`` without one).
    No communication. In global SPMD, call it where the axis is local
    (inside ``spmd.local_map``): a per-rank value has no global meaning.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            rank = spmd.axis_index("tp")                 # {dp: R, tp: V}
            mine = (token_ids // vocab_per_rank) == rank  # a per-rank mask, typed V
    """
    comm = resolve_comm("spmd.axis_index", axis)
    mesh = current_mesh()
    if device is None:
        device = getattr(getattr(mesh, "device_mesh", None), "device_type", None) or "cpu"
    out = impl._per_rank(_index_tensor)(impl.group_rank(comm), torch.device(device))
    if not STATE.checking or mesh is None:
        return out
    outside = [n for n in comm.names if n not in mesh.axis_names]
    if outside:
        raise ValueError(
            f"spmd.axis_index: {outside[0]} is not an axis of the current mesh, so the index cannot be typed; "
            "pass a mesh axis name"
        )
    if STATE.global_mode:
        global_axes = mesh.global_axes(STATE.local_axes)
        checked = [n for n in comm.names if n in global_axes]
        if checked:
            raise SpmdTypeError(
                Rejection(
                    f"spmd.axis_index is V on axis '{checked[0]}', which is checked in global SPMD, where a "
                    "per-rank value has no global meaning.",
                    [("op", f"spmd.axis_index({comm.label})"), ("global axes", ", ".join(sorted(global_axes)))],
                    [f"call it inside spmd.local_map(..., axes=[{comm.label}])",
                     f"spmd.typecheck(local=[{comm.label}]) to check that axis locally"],
                ),
                user_source_line(),
            )
    # typed as assert_type types a fresh tensor, so that the mesh's rules for axes of one rank apply alike
    return assert_type(out, {a: (V if a in comm.names else R) for a in mesh.axis_names})


def _index_tensor(index: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(index, dtype=torch.int64, device=device)
