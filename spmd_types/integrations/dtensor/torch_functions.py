"""DTensor's own autograd Functions meeting typed tensors: ``DTensor.from_local`` is checked like ``spmd.to_dtensor``.

torch's tensor-parallel styles (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``) turn a plain local input into a
DTensor with ``DTensor.from_local``, which applies DTensor's
``_FromTorchTensor``. With ``use_local_output=True`` (torchtitan's default)
the tensors between those modules are plain local tensors, which a user may
type. When a typed one reaches ``from_local``, its type must be what the
placements mean: ``Replicate()`` is I (DTensor's backward hands it a summed
gradient), ``Shard(d)`` is S(d) (or V), ``Partial()`` is P; a mismatch is the
same error ``spmd.to_dtensor`` gives. The DTensor then holds a plain alias, so
the typed tensor never enters DTensor's dispatch, and the gradient comes back
through DTensor's own backward.

The registration is the public one (``rule=``, on DTensor's class alone), made
when this integration loads: ``spmd.typecheck()`` loads it on entry once
DTensor is imported.
"""

from __future__ import annotations

from typing import Any

from ..._boundaries.autograd_functions import register_autograd_function
from ..._core.types import TypeMap
from ..._torch.private import from_torch_tensor_function
from .bridge import _check_types, mesh_names
from .placements import placement_to_type

_FromTorchTensor = from_torch_tensor_function()  # DTensor.from_local's autograd Function

__all__ = ["from_local_rule"]


def from_local_rule(x_types: TypeMap | None, mesh: Any, placements: tuple, *_: Any) -> None:
    """``_FromTorchTensor.apply(x, mesh, placements, ...)``: ``x``'s types must be the placements' (no typed output).

    ``DTensor.from_local`` has already counted negative ``Shard`` dims from the front.
    """
    if x_types is None:
        return None
    names = mesh_names(mesh, "DTensor.from_local")
    placements = tuple(placements)
    wanted = {n: placement_to_type(p) for n, p in zip(names, placements)}
    _check_types("DTensor.from_local", x_types, wanted, placements, names)
    return None


register_autograd_function(_FromTorchTensor, rule=from_local_rule)
