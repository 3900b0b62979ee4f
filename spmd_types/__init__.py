"""spmd_types: SPMD types for distributed PyTorch, checked before any GPU time is spent.

Every tensor gets a type per mesh axis: R (replicate), I (invariant), V
(varying), P (partial) or S(d) (shard). Ordinary ops are checked against a
typing-rules table; type changes go through typed conversions and
collectives whose backward is chosen by type.

    import spmd_types as spmd
"""

from ._boundaries.autograd_functions import (
    register_autograd_function,
    register_decomposition,
    register_local_autograd_function,
    unregister_autograd_function,
)
from ._boundaries.checkpoint import check_state_dict, load_state_dict
from ._boundaries.ddp import register_ddp
from ._boundaries.hooks import register_local_backward_hook
from ._boundaries.local_map import Infer, local, local_map
from ._boundaries.no_typecheck import no_typecheck
from ._boundaries.published_calls import register_no_typecheck, reinterpret_no_grad, set_dist
from ._boundaries.scalar import Scalar
from ._checker.asserts import (
    assert_type,
    get_type,
    is_checking,
    typecheck,
)
from ._checker.boundaries import attach_boundary, typed_boundary
from ._checker.mutate import mutate_type
from ._checker.published import (
    assert_local_type,
    assert_local_type_like,
    assert_type_like,
    get_axis_local_type,
    get_local_type,
    get_partition_spec,
    has_local_type,
    maybe_get_axis_local_type,
)
from ._checker.tensor import LTensor
from ._checker.trace import trace
from ._comm import raw_collectives as _raw_collectives  # noqa: F401 - types raw torch.distributed collectives on typed tensors
from ._comm.aliases import invariant_to_replicate, shard, unshard
from ._comm.axis_index import axis_index
from ._comm.collectives import all_gather, all_reduce, all_to_all, redistribute, reduce_scatter
from ._comm.redistribute_spec import plan_redistribute
from ._comm.reinterpret_convert import convert, reinterpret
from ._comm.reinterpret_mesh import reinterpret_mesh
from ._compile.backend import compile_backend
from ._core.axes import MeshAxis
from ._core.errors import DTensorPropagationError, RedistributeError, SpmdTypeError
from ._core.mesh import current_mesh_all_names, current_mesh_names, set_current_mesh
from ._core.mesh import current_mesh_axes as current_mesh
from ._core.state import TYPE_CHECKING, is_type_checking
from ._core.tracebacks import traceback_filtering
from ._core.types import (
    I,
    Invariant,
    P,
    Partial,
    PartitionSpec,
    R,
    Replicate,
    S,
    Shard,
    SpmdType,
    V,
    Varying,
    backward_type,
)
from ._core.whole_type import merge_types  # also makes spmd.SpmdType(local_type, partition_spec) a whole type
from ._global.explicit import einsum, linear, matmul, sum
from ._local.rules_table import RuleKind
from .types import (
    DeviceMeshAxis as DeviceMeshAxis,
)
from .types import (
    DimSharding as DimSharding,
)
from .types import (
    LocalSpmdType as LocalSpmdType,
)
from .types import (
    PartitionSpecEntry as PartitionSpecEntry,
)
from .types import (
    PerMeshAxisLocalSpmdType,
    PerMeshAxisSpmdType,
    TensorSharding,
    format_axis,
    normalize_axis,
    normalize_mesh,
    normalize_partition_spec,
)
from .types import (
    PerMeshAxisSpmdTypes as PerMeshAxisSpmdTypes,
)

__all__ = [
    "R", "I", "V", "P", "S", "Replicate", "Invariant", "Varying", "Partial", "Shard",
    "SpmdType", "backward_type", "PartitionSpec", "SpmdTypeError", "LTensor",
    "set_current_mesh", "typecheck", "assert_type", "get_type", "typed_boundary",
    "attach_boundary", "is_checking", "RuleKind", "get_partition_spec",
    "reinterpret", "convert", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "redistribute",
    "sum", "linear", "matmul", "einsum", "local_map", "plan_redistribute",
    "register_ddp", "compile_backend",
    "axis_index", "Scalar", "no_typecheck", "check_state_dict", "load_state_dict",
    "register_autograd_function", "unregister_autograd_function",
    # the published spmd_types API (torchtitan's), beside our own names
    "is_type_checking", "TYPE_CHECKING", "current_mesh", "current_mesh_names", "current_mesh_all_names", "MeshAxis",
    "get_local_type", "has_local_type", "get_axis_local_type", "maybe_get_axis_local_type",
    "assert_type_like", "assert_local_type", "assert_local_type_like",
    "mutate_type", "local", "Infer", "reinterpret_mesh", "shard", "unshard", "invariant_to_replicate",
    "register_local_autograd_function", "register_decomposition", "trace", "traceback_filtering",
    "PerMeshAxisSpmdType", "PerMeshAxisLocalSpmdType", "TensorSharding", "normalize_axis", "normalize_mesh",
    "normalize_partition_spec", "format_axis", "merge_types", "register_local_backward_hook", "RedistributeError",
    "DTensorPropagationError", "register_no_typecheck", "reinterpret_no_grad", "set_dist",
]
# The published API's type-hint aliases (PerMeshAxisSpmdTypes, LocalSpmdType, DeviceMeshAxis, PartitionSpecEntry,
# DimSharding) are importable here and documented in spmd_types.types; typing aliases carry no docstring of their own.

# DTensor interop (spmd_types/interop): loaded on first use, so `import spmd_types` never imports DTensor.
_INTEROP = {
    "Reduced": "placements", "is_reduced": "placements", "placement_to_type": "placements",
    "type_to_placement": "placements", "placement_to_cotangent": "placements", "spec_to_cotangent": "placements",
    "from_dtensor": "bridge", "to_dtensor": "bridge",
    "spmd_type_to_dtensor_placement": "published", "dtensor_placement_to_spmd_type": "published",
    "spmd_redistribute": "published",
}
__all__ += list(_INTEROP) + ["rulecheck"]


def __getattr__(name: str):
    if name == "rulecheck":  # spmd.rulecheck(...), loaded on first use (it imports spmd_types.testing)
        import importlib

        return importlib.import_module(".rulecheck", __name__)
    module = _INTEROP.get(name)
    if module is None:
        raise AttributeError(f"module 'spmd_types' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".integrations.dtensor.{module}", __name__), name)


from . import checker as checker  # noqa: E402 - the published API's modules, reachable as spmd.checker / spmd.runtime
from . import rules as rules  # noqa: E402
from . import runtime as runtime  # noqa: E402
from ._boundaries import hook_registration as _hook_registration  # noqa: E402

_hook_registration.install()  # Functions with an spmd_typecheck / typecheck_forward hook type themselves


def _hide_own_frames() -> None:
    """pytest and IPython show an SpmdTypeError's traceback without the package's frames (see _core/tracebacks.py)."""
    import sys

    from ._core.tracebacks import hide_frames

    for name, module in list(sys.modules.items()):
        if name.startswith(__name__ + ".") and module is not None:
            module.__tracebackhide__ = hide_frames


_hide_own_frames()
