"""The published API's ``spmd_types.runtime``: typing tensors and the regions around them.

The same functions as the top-level ``spmd_types`` names; torchtitan imports
``get_local_type``, ``get_partition_spec`` and ``has_local_type`` from here.

Example::

    from spmd_types.runtime import get_local_type, has_local_type
    if has_local_type(buf):
        saved = get_local_type(buf)
"""

from ._boundaries.autograd_functions import (
    register_autograd_function,
    register_decomposition,
    register_local_autograd_function,
)
from ._boundaries.local_map import Infer, local, local_map
from ._boundaries.no_typecheck import no_typecheck
from ._boundaries.published_calls import register_no_typecheck, reinterpret_no_grad
from ._checker.asserts import (
    assert_type,
)
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
from ._checker.trace import trace
from ._core.whole_type import merge_types

__all__ = [
    "get_local_type", "get_partition_spec", "has_local_type", "get_axis_local_type", "maybe_get_axis_local_type",
    "assert_type", "assert_type_like",
    "assert_local_type", "assert_local_type_like", "mutate_type", "local", "local_map", "Infer", "no_typecheck",
    "register_autograd_function", "register_local_autograd_function", "register_decomposition", "trace",
    "merge_types", "register_no_typecheck", "reinterpret_no_grad",
    # the type values and helpers the published runtime module also holds (spmd_types.runtime.R, ...)
    "R", "I", "V", "P", "S", "Shard", "PartitionSpec", "SpmdType", "SpmdTypeError", "MeshAxis", "current_mesh",
    "is_type_checking", "normalize_axis", "normalize_partition_spec", "normalize_local_type", "format_axis",
    "to_local_type", "shard_types_to_partition_spec", "PerMeshAxisSpmdTypesArg", "DeviceMeshAxis", "LocalSpmdType",
    "PerMeshAxisSpmdType", "PerMeshAxisSpmdTypes", "PerMeshAxisLocalSpmdType",
]
from ._core.mesh import current_mesh_axes as current_mesh  # noqa: E402
from ._core.state import is_type_checking  # noqa: E402
from .types import (  # noqa: E402 - after __all__, as the list it fills
    DeviceMeshAxis,
    I,
    LocalSpmdType,
    MeshAxis,
    P,
    PartitionSpec,
    PerMeshAxisLocalSpmdType,
    PerMeshAxisSpmdType,
    PerMeshAxisSpmdTypes,
    PerMeshAxisSpmdTypesArg,
    R,
    S,
    Shard,
    SpmdType,
    SpmdTypeError,
    V,
    format_axis,
    normalize_axis,
    normalize_local_type,
    normalize_partition_spec,
    shard_types_to_partition_spec,
    to_local_type,
)
