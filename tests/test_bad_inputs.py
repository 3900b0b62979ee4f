"""Every bad input is a clear error before any communication (issue 9, item 5).

The battery is a data table: each row is a bad call across the public API,
the exception type it must raise, and text of the message that names the
culprit (a substring, or the exact message for texts added for this battery).
Every row runs under a communication counter and must have communicated
nothing when it raises. Rows run on a fake (dp=2, tp=4) process group; the
context column says what surrounds the call: ``check`` (the mesh and
``typecheck()``), ``global`` (``typecheck(local=False)``), ``mesh`` (the mesh,
no checking) or ``none`` (nothing).

After every row the per-thread state is checked back to its defaults (no
checking switched on, no mesh left current), so a bad ``typecheck(...)`` or
``set_current_mesh(...)`` that leaves state behind fails its row.

The last section holds inputs that look odd but are fine (empty tensors, 0-d
values, ``src == dst``): each gives the right result on simulated ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import spmd_types as spmd
from spmd_types._core.mesh import current_mesh
from spmd_types._core.state import STATE
from spmd_types.testing import CommCounter, denote, per_rank

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
PS = spmd.PartitionSpec


class Case(NamedTuple):
    id: str
    call: Callable[[], Any]
    exc: type[BaseException]
    msg: str
    ctx: str = "check"
    exact: bool = False


ENV: dict[str, Any] = {}


def mesh():
    return ENV["mesh"]


def group(axis: str) -> dist.ProcessGroup:
    return ENV["mesh"].get_group(axis)


def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype)


def ty(types: dict, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``types`` (needs checking on)."""
    return spmd.assert_type(t(*shape, dtype=dtype), types)


def enter(cm: Any) -> None:
    """Enter and leave a context manager (where a bad argument is found on entry)."""
    with cm:
        pass


def two_meshes() -> torch.Tensor:
    """A tensor typed on the (dp, tp) mesh meets one typed on (a, b) over the same ranks, but not movable onto it."""
    a = ty({"dp": V, "tp": R}, 4)
    with spmd.set_current_mesh(ENV["ab_mesh"]):
        b = ty({"a": V, "b": R}, 4)  # (a, b) flatten to the ranks of (dp, tp), but with two types
    return a + b


def collective_on_other_mesh() -> torch.Tensor:
    """A tensor typed on another mesh (a, b) that cannot move onto this one reaches a collective on tp."""
    with spmd.set_current_mesh(ENV["ab_mesh"]):
        b = ty({"a": P, "b": V}, 4)
    return spmd.all_reduce(b, "tp", src=P, dst=R)


def local_map_call(fn: Callable, in_types: Any, out_types: Any, *args: Any, **kw: Any) -> Any:
    return spmd.local_map(fn, in_types=in_types, out_types=out_types, **kw)(*args)


def ident(a):
    return a


def twice(a):
    return a, a


def three(a):
    return 3


def pair(a, b):
    return a + b


def global_max() -> torch.Tensor:
    return AR(ty({"dp": R, "tp": S(0)}, 4, 4), "tp", src=V, dst=R, op="max")


def boundary_call(in_types: list) -> Any:
    return spmd.typed_boundary(in_types=in_types)(ident)(t(4))


def attach_call(in_types: list) -> Any:
    return spmd.attach_boundary(torch.nn.Identity(), in_types=in_types)(t(4))


def double_mesh_dict() -> None:
    enter(spmd.set_current_mesh({"a": group("tp"), "b": group("tp")}))


def global_gather_v() -> torch.Tensor:
    x = ty({"dp": R, "tp": S(0)}, 4, 4)
    return spmd.all_gather(x, "tp", src=V, dst=R)


def global_scatter_v() -> torch.Tensor:
    x = ty({"dp": R, "tp": P}, 4, 4)
    return spmd.reduce_scatter(x, "tp", src=P, dst=V)


def global_gather_not_minor() -> torch.Tensor:
    x = spmd.assert_type(t(4, 4), {"dp": V, "tp": V}, PS(("dp", "tp")))
    return spmd.all_gather(x, "dp", src=S(0), dst=R)


AR, AG, RS, A2A = spmd.all_reduce, spmd.all_gather, spmd.reduce_scatter, spmd.all_to_all
UNKNOWN = "unknown mesh axis 'pp'; the current mesh has axes 'dp', 'tp'"
NOT_TYPE = "must be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or spmd.S(d))"

CASES: list[Case] = [
    # --- axes: unknown names, wrong kinds, duplicates, order, no mesh
    Case("ar-unknown-axis", lambda: AR(t(4), "pp", src=P, dst=R), ValueError, "spmd.all_reduce: " + UNKNOWN),
    Case("ag-unknown-axis", lambda: AG(t(4), "pp", src=V, dst=R), ValueError, "spmd.all_gather: " + UNKNOWN),
    Case("rs-unknown-axis", lambda: RS(t(4), "pp", src=P, dst=V), ValueError, "spmd.reduce_scatter: " + UNKNOWN),
    Case("a2a-unknown-axis", lambda: A2A(t(4, 4), "pp", src=S(0), dst=S(1)), ValueError,
         "spmd.all_to_all: " + UNKNOWN),
    Case("reinterpret-unknown-axis", lambda: spmd.reinterpret(t(4), "pp", src=R, dst=P), ValueError,
         "spmd.reinterpret: " + UNKNOWN),
    Case("convert-unknown-axis", lambda: spmd.convert(t(4), "pp", src=R, dst=I), ValueError,
         "spmd.convert: " + UNKNOWN),
    Case("redistribute-unknown-axis", lambda: spmd.redistribute(t(4), "pp", src=P, dst=R), ValueError,
         "spmd.all_reduce: " + UNKNOWN),
    Case("ar-axis-int", lambda: AR(t(4), 0, src=P, dst=R), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got int"),
    Case("ar-axis-none", lambda: AR(t(4), None, src=P, dst=R), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got NoneType"),
    Case("ag-axis-float", lambda: AG(t(4), 1.5, src=V, dst=R), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got float"),
    Case("ar-axis-duplicate", lambda: AR(t(4), ("tp", "tp"), src=P, dst=R), ValueError,
         "spmd.all_reduce: axis ('tp', 'tp') names a mesh axis twice"),
    Case("ar-axis-duplicate-by-group", lambda: AR(t(4), ("tp", group("tp")), src=P, dst=R), ValueError,
         "names a mesh axis twice"),
    Case("ag-axis-duplicate-list", lambda: AG(t(4), ["dp", "dp"], src=V, dst=R), ValueError,
         "spmd.all_gather: axis ('dp', 'dp') names a mesh axis twice"),
    Case("ar-axes-out-of-order", lambda: AR(t(4), ("tp", "dp"), src=P, dst=R), ValueError,
         "list the axes of a flattened collective in mesh order, ('dp', 'tp'), not ('tp', 'dp')"),
    Case("ar-axis-empty-tuple", lambda: AR(t(4), (), src=P, dst=R), ValueError,
         "spmd.all_reduce: axis () names no mesh axis", exact=True),
    Case("ag-axis-empty-list", lambda: AG(t(4), [], src=V, dst=R), ValueError,
         "spmd.all_gather: axis () names no mesh axis", exact=True),
    Case("ar-axis-tuple-with-unknown", lambda: AR(t(4), ("dp", "pp"), src=P, dst=R), ValueError, UNKNOWN),
    Case("ar-axis-tuple-with-int", lambda: AR(t(4), ("dp", 1), src=P, dst=R), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got int"),
    Case("ar-no-mesh", lambda: AR(t(4), "tp", src=P, dst=R), RuntimeError,
         "axis 'tp' is a name, but no mesh is current", ctx="none"),
    Case("assert-group-not-in-mesh", lambda: enter_check_then(lambda: spmd.assert_type(t(4), {group("tp"): R})),
         ValueError, "is not an axis, nor a flattening of axes, of the current mesh", ctx="mesh-dict"),
    Case("ar-2d-devicemesh-axis", lambda: AR(t(4), mesh(), src=P, dst=R), ValueError,
         "an axis given as a DeviceMesh must be 1-D with a mesh_dim_name"),
    # --- src / dst that are not types
    Case("ar-src-str", lambda: AR(t(4), "tp", src="P", dst=R), TypeError,
         "spmd.all_reduce: src " + NOT_TYPE + ", got 'P' of type str"),
    Case("ar-dst-str", lambda: AR(t(4), "tp", src=P, dst="R"), TypeError,
         "spmd.all_reduce: dst " + NOT_TYPE + ", got 'R' of type str"),
    Case("ar-dst-none", lambda: AR(t(4), "tp", src=P, dst=None), TypeError,
         "spmd.all_reduce: dst " + NOT_TYPE + ", got None of type NoneType"),
    Case("ag-src-shard-function", lambda: AG(t(4), "tp", src=S, dst=R), TypeError,
         "spmd.all_gather: src: spmd.S needs a dim: spmd.S(0)", exact=True),
    Case("ag-dst-int", lambda: AG(t(4), "tp", src=V, dst=0), TypeError,
         "spmd.all_gather: dst " + NOT_TYPE + ", got 0 of type int"),
    Case("rs-src-class", lambda: RS(t(4), "tp", src=spmd.SpmdType, dst=V), TypeError,
         "spmd.reduce_scatter: src " + NOT_TYPE),
    Case("a2a-dst-str", lambda: A2A(t(4, 4), "tp", src=S(0), dst="S(1)"), TypeError,
         "spmd.all_to_all: dst " + NOT_TYPE),
    Case("reinterpret-src-none", lambda: spmd.reinterpret(t(4), "tp", src=None, dst=P), TypeError,
         "spmd.reinterpret: src " + NOT_TYPE),
    Case("convert-dst-placement", lambda: spmd.convert(t(4), "tp", src=R, dst=[R]), TypeError,
         "spmd.convert: dst " + NOT_TYPE + ", got [R] of type list"),
    Case("redistribute-src-str", lambda: spmd.redistribute(t(4), "tp", src="R", dst=V), TypeError,
         "spmd.redistribute: src " + NOT_TYPE),
    Case("redistribute-no-types", lambda: spmd.redistribute(t(4), "tp"), TypeError,
         "spmd.redistribute takes (x, axis, src=, dst=) or (x, src_spec, dst_spec)"),
    Case("backward-type-str", lambda: spmd.backward_type("R"), TypeError,
         "backward_type needs an SPMD type (R, I, V, P, S(d)), got 'R'"),
    # --- transitions the table does not have, and src that is not the input's type
    Case("ar-src-r", lambda: AR(t(4), "tp", src=R, dst=R), spmd.SpmdTypeError,
         "spmd.all_reduce cannot take src=R to dst=R"),
    Case("ar-dst-v", lambda: AR(t(4), "tp", src=P, dst=V), spmd.SpmdTypeError,
         "spmd.all_reduce cannot take src=P to dst=V"),
    Case("ag-src-p", lambda: AG(t(4), "tp", src=P, dst=R), spmd.SpmdTypeError,
         "spmd.all_gather cannot take src=P to dst=R"),
    Case("ag-dst-p", lambda: AG(t(4), "tp", src=V, dst=P), spmd.SpmdTypeError,
         "spmd.all_gather cannot take src=V to dst=P"),
    Case("rs-dst-r", lambda: RS(t(4), "tp", src=P, dst=R), spmd.SpmdTypeError,
         "spmd.reduce_scatter cannot take src=P to dst=R"),
    Case("a2a-src-r", lambda: A2A(t(4, 4), "tp", src=R, dst=V), spmd.SpmdTypeError,
         "spmd.all_to_all cannot take src=R to dst=V"),
    Case("reinterpret-p-to-r", lambda: spmd.reinterpret(t(4), "tp", src=P, dst=R), spmd.SpmdTypeError,
         "spmd.reinterpret cannot take src=P to dst=R"),
    Case("convert-p-to-r", lambda: spmd.convert(t(4), "tp", src=P, dst=R), spmd.SpmdTypeError,
         "spmd.convert cannot take src=P to dst=R"),
    Case("ar-src-not-input-type", lambda: AR(ty({"tp": R}, 4), "tp", src=P, dst=R), spmd.SpmdTypeError,
         "spmd.all_reduce's src= must be the input's type on the axis: src=P, but the tensor is R on axis 'tp'."),
    Case("ag-src-not-input-type", lambda: AG(ty({"tp": P}, 4), "tp", src=V, dst=R), spmd.SpmdTypeError,
         "spmd.all_gather's src= must be the input's type on the axis: src=V, but the tensor is P on axis 'tp'."),
    Case("ag-shard-dim-differs", lambda: AG(ty({"tp": S(1)}, 4, 4), "tp", src=S(0), dst=R), spmd.SpmdTypeError,
         "src=S(0), but the tensor is S(1) on axis 'tp'"),
    Case("ar-flattened-one-axis-wrong", lambda: AR(ty({"dp": P, "tp": R}, 4), ("dp", "tp"), src=P, dst=R),
         spmd.SpmdTypeError, "src=P, but the tensor is R on axis 'tp'"),
    Case("ar-input-from-other-mesh", collective_on_other_mesh, spmd.SpmdTypeError,
         "spmd.all_reduce's input is typed on another mesh and cannot be moved onto the current one: axes (a, b) "
         "would flatten into (dp, tp), but their types differ (a: P, b: V); a flattened axis has one type."),
    # --- the input itself
    Case("ar-input-list", lambda: AR([1.0, 2.0], "tp", src=P, dst=R), TypeError,
         "spmd.all_reduce takes a tensor, got list"),
    Case("ag-input-none", lambda: AG(None, "tp", src=V, dst=R), TypeError, "spmd.all_gather takes a tensor, got NoneType"),
    Case("rs-input-float", lambda: RS(1.0, "tp", src=P, dst=V), TypeError,
         "spmd.reduce_scatter takes a tensor, got float"),
    Case("a2a-input-tuple", lambda: A2A((t(4),), "tp", src=V, dst=V), TypeError,
         "spmd.all_to_all takes a tensor, got tuple"),
    Case("reinterpret-input-int", lambda: spmd.reinterpret(3, "tp", src=R, dst=P), TypeError,
         "spmd.reinterpret takes a tensor, got int"),
    Case("convert-input-str", lambda: spmd.convert("x", "tp", src=R, dst=I), TypeError,
         "spmd.convert takes a tensor, got str"),
    # --- reduce ops, and averages of integer tensors
    Case("ar-op-mean", lambda: AR(t(4), "tp", src=P, dst=R, op="mean"), ValueError,
         "spmd.all_reduce: op must be 'sum', 'avg', 'max' or 'min', got 'mean'"),
    Case("ar-op-none", lambda: AR(t(4), "tp", src=P, dst=R, op=None), ValueError,
         "op must be 'sum', 'avg', 'max' or 'min', got None"),
    Case("rs-op-max", lambda: RS(t(4), "tp", src=P, dst=V, op="max"), ValueError,
         "spmd.reduce_scatter: op must be 'sum' or 'avg', got 'max'"),
    Case("rs-op-list", lambda: RS(t(4), "tp", src=P, dst=V, op=["sum"]), ValueError,
         "spmd.reduce_scatter: op must be 'sum' or 'avg', got ['sum']"),
    Case("ar-avg-int64", lambda: AR(t(4, dtype=torch.int64), "tp", src=P, dst=R, op="avg"), TypeError,
         "spmd.all_reduce: op='avg' divides by the axis size, which an integer tensor (torch.int64) cannot "
         "hold; cast it to a floating dtype first, or use op='sum'", exact=True),
    Case("ar-avg-int32-typed", lambda: AR(ty({"tp": P}, 4, dtype=torch.int32), "tp", src=P, dst=I, op="avg"),
         TypeError, "spmd.all_reduce: op='avg' divides by the axis size, which an integer tensor (torch.int32)"),
    Case("ar-avg-bool", lambda: AR(t(4, dtype=torch.bool), "tp", src=P, dst=R, op="avg"), TypeError,
         "an integer tensor (torch.bool) cannot hold"),
    Case("ar-avg-v-src-int", lambda: AR(t(4, dtype=torch.int64), "tp", src=V, dst=R, op="avg"), TypeError,
         "op='avg' divides by the axis size"),
    Case("rs-avg-int", lambda: RS(t(4, 4, dtype=torch.int64), "tp", src=P, dst=S(0), op="avg"), TypeError,
         "spmd.reduce_scatter: op='avg' divides by the axis size, which an integer tensor (torch.int64)"),
    Case("ar-avg-uint8-flattened", lambda: AR(t(4, dtype=torch.uint8), ("dp", "tp"), src=P, dst=R, op="avg"),
         TypeError, "an integer tensor (torch.uint8)"),
    # --- shard dims: out of range, not ints, disagreeing
    Case("shard-dim-str", lambda: S("0"), TypeError, "S(dim) needs an int tensor dim, got '0'"),
    Case("shard-dim-float", lambda: S(1.0), TypeError, "S(dim) needs an int tensor dim, got 1.0"),
    Case("shard-dim-bool", lambda: S(True), TypeError, "S(dim) needs an int tensor dim, got True"),
    Case("shard-dim-none", lambda: S(None), TypeError, "S(dim) needs an int tensor dim, got None"),
    Case("ag-src-shard-out-of-range", lambda: AG(t(4, 4), "tp", src=S(2), dst=R), ValueError,
         "spmd.all_gather: src=S(2) names tensor dim 2, but the tensor has 2 dims"),
    Case("ag-src-shard-negative-out-of-range", lambda: AG(t(4, 4), "tp", src=S(-3), dst=R), ValueError,
         "spmd.all_gather: src=S(-3) names tensor dim -3, but the tensor has 2 dims"),
    Case("ag-shard-of-0d", lambda: AG(t(), "tp", src=S(0), dst=R), ValueError,
         "src=S(0) names tensor dim 0, but the tensor has 0 dims"),
    Case("rs-dst-shard-out-of-range", lambda: RS(t(4, 4), "tp", src=P, dst=S(5)), ValueError,
         "spmd.reduce_scatter: dst=S(5) names tensor dim 5, but the tensor has 2 dims"),
    Case("a2a-dst-shard-out-of-range", lambda: A2A(t(4, 4), "tp", src=S(0), dst=S(7)), ValueError,
         "spmd.all_to_all: dst=S(7) names tensor dim 7, but the tensor has 2 dims"),
    Case("convert-dst-shard-out-of-range", lambda: spmd.convert(t(4, 4), "tp", src=R, dst=S(2)), ValueError,
         "spmd.convert: dst=S(2) names tensor dim 2, but the tensor has 2 dims"),
    Case("convert-src-shard-out-of-range", lambda: spmd.convert(t(4, 4), "tp", src=S(3), dst=P), ValueError,
         "spmd.convert: src=S(3) names tensor dim 3, but the tensor has 2 dims"),
    Case("ag-gather-dim-out-of-range", lambda: AG(t(4, 4), "tp", src=V, dst=R, gather_dim=9), ValueError,
         "spmd.all_gather: gather_dim=9 stacks the ranks' values on a new dim 9, but a 2-dim tensor has new dims -3 "
         "to 2", exact=True),
    Case("rs-scatter-dim-out-of-range", lambda: RS(t(4, 4), "tp", src=P, dst=V, scatter_dim=-5), ValueError,
         "spmd.reduce_scatter: scatter_dim=-5 names tensor dim -5, but the tensor has 2 dims"),
    Case("ag-gather-dim-disagrees", lambda: AG(t(4, 4), "tp", src=S(0), dst=R, gather_dim=1), ValueError,
         "spmd.all_gather: src=S(0) already says dim 0; gather_dim=1 disagrees with it"),
    Case("rs-scatter-dim-disagrees", lambda: RS(t(4, 4), "tp", src=P, dst=S(1), scatter_dim=0), ValueError,
         "spmd.reduce_scatter: dst=S(1) already says dim 1; scatter_dim=0 disagrees with it"),
    Case("ag-gather-dim-str", lambda: AG(t(4, 4), "tp", src=V, dst=R, gather_dim="0"), TypeError,
         "spmd.all_gather: gather_dim= takes an int tensor dim, got '0' of type str", exact=True),
    Case("rs-scatter-dim-float", lambda: RS(t(4, 4), "tp", src=P, dst=V, scatter_dim=0.0), TypeError,
         "spmd.reduce_scatter: scatter_dim= takes an int tensor dim, got 0.0 of type float", exact=True),
    Case("ag-gather-dim-bool", lambda: AG(t(4, 4), "tp", src=V, dst=R, gather_dim=True), TypeError,
         "spmd.all_gather: gather_dim= takes an int tensor dim, got True of type bool", exact=True),
    Case("a2a-split-dim-str", lambda: A2A(t(4, 4), "tp", src=V, dst=V, split_dim="1", concat_dim=0), TypeError,
         "spmd.all_to_all: split_dim= takes an int tensor dim, got '1' of type str", exact=True),
    Case("a2a-uneven-shards", lambda: A2A(t(4, 4), "tp", src=S(0), dst=S(1), input_split_sizes=[1, 1, 1, 1],
                                          output_split_sizes=[1, 1, 1, 1]), ValueError,
         "spmd.all_to_all: uneven pieces (input_split_sizes=, output_split_sizes=) are rows of dim 0: src and dst V "
         "or S(0); got src=S(0), dst=S(1)", exact=True),
    Case("a2a-uneven-wrong-count", lambda: A2A(t(4, 4), "tp", src=V, dst=V, input_split_sizes=[2, 2],
                                               output_split_sizes=[1, 1, 1, 1]), ValueError,
         "spmd.all_to_all: input_split_sizes= gives one size per rank of axis 'tp' (4 ranks), got 2", exact=True),
    Case("a2a-uneven-wrong-total", lambda: A2A(t(4, 4), "tp", src=V, dst=V, input_split_sizes=[2, 2, 2, 2],
                                               output_split_sizes=[1, 1, 1, 1]), ValueError,
         "spmd.all_to_all: input_split_sizes=[2, 2, 2, 2] add up to 8, but dim 0 has size 4", exact=True),
    Case("ar-inplace-needs-grad", lambda: AR(t(4).requires_grad_(), "tp", src=P, dst=R, inplace=True), ValueError,
         "spmd.all_reduce(inplace=True) writes the result into x, which autograd cannot follow for a tensor that "
         "requires grad; use the returned value of spmd.all_reduce(x, ...) instead", exact=True),
    Case("ag-sizes-twice", lambda: AG(t(4), "tp", src=S(0), dst=R, sizes=[1, 1, 1, 1], split_sizes=[1, 1, 1, 1]),
         TypeError, "spmd.all_gather: give sizes= or split_sizes= (the same thing), not both", exact=True),
    Case("redistribute-v-to-shard-a2a", lambda: spmd.redistribute(t(4, 4), "tp", src=V, dst=S(1)), ValueError,
         "spmd.redistribute: V -> S(1) does not say which dims to split and concatenate"),
    # --- non-divisible shapes and sizes=
    Case("rs-not-divisible", lambda: RS(t(6, 4), "tp", src=P, dst=S(0)), ValueError,
         "spmd.reduce_scatter: dst=S(0) splits tensor dim 0 (size 6) into 4 equal shards on axis 'tp'; "
         "6 is not divisible by 4. Pass sizes= (one per rank) for uneven shards."),
    Case("rs-v-wrong-dim0", lambda: RS(t(3, 4), "tp", src=P, dst=V), ValueError,
         "dst=V keeps index `rank` of dim 0, so dim 0 must have one entry per rank of axis 'tp' (4); got shape [3, 4]"),
    Case("rs-v-of-0d", lambda: RS(t(), "tp", src=P, dst=V), ValueError,
         "so dim 0 must have one entry per rank of axis 'tp' (4); got shape []"),
    Case("a2a-not-divisible", lambda: A2A(t(4, 6), "tp", src=S(0), dst=S(1)), ValueError,
         "spmd.all_to_all: split_dim=1 splits tensor dim 1 (size 6) into 4 equal shards on axis 'tp'; "
         "6 is not divisible by 4."),
    Case("convert-not-divisible", lambda: spmd.convert(t(5, 4), "tp", src=R, dst=S(0)), ValueError,
         "spmd.convert: dst=S(0) splits tensor dim 0 (size 5) into 4 equal shards"),
    Case("convert-v-wrong-dim0", lambda: spmd.convert(t(2, 4), "tp", src=R, dst=V), ValueError,
         "spmd.convert: dst=V keeps x[rank], so dim 0 must have one entry per rank of axis 'tp' (4); got shape [2, 4]"),
    Case("ag-sizes-wrong-length", lambda: AG(t(2, 4), "tp", src=S(0), dst=R, sizes=[2, 2]), ValueError,
         "spmd.all_gather: sizes= gives one shard size per rank of axis 'tp' (4 ranks), got [2, 2]"),
    Case("ag-sizes-negative", lambda: AG(t(2, 4), "tp", src=S(0), dst=R, sizes=[2, 2, 2, -1]), ValueError,
         "spmd.all_gather: sizes= gives one shard size per rank of axis 'tp' (4 ranks), got [2, 2, 2, -1]"),
    Case("ag-sizes-float", lambda: AG(t(2, 4), "tp", src=S(0), dst=R, sizes=[2, 2, 2, 1.5]), TypeError,
         "spmd.all_gather: sizes= takes one int per rank, got [2, 2, 2, 1.5]", exact=True),
    Case("ag-sizes-str", lambda: AG(t(2, 4), "tp", src=S(0), dst=R, sizes="2222"), TypeError,
         "spmd.all_gather: sizes= takes one int per rank, got '2222'", exact=True),
    Case("ag-sizes-int", lambda: AG(t(2, 4), "tp", src=S(0), dst=R, sizes=8), TypeError,
         "spmd.all_gather: sizes= takes one int per rank, got 8", exact=True),
    Case("ag-sizes-bool", lambda: AG(t(2, 4), "tp", src=S(0), dst=R, sizes=[True, 1, 1, 1]), TypeError,
         "spmd.all_gather: sizes= takes one int per rank, got [True, 1, 1, 1]", exact=True),
    Case("ag-sizes-not-this-rank", lambda: AG(t(2, 4), "tp", src=S(0), dst=R, sizes=[3, 1, 1, 1]), ValueError,
         "spmd.all_gather: sizes=[3, 1, 1, 1] gives this rank (index 0 on axis 'tp') a shard of 3 on dim 0, "
         "but its shard has 2", exact=True),
    Case("ag-sizes-with-v", lambda: AG(t(2, 4), "tp", src=V, dst=R, sizes=[2, 2, 2, 2]), ValueError,
         "spmd.all_gather: sizes= needs a concat dim, src=S(d); V inputs stack", exact=True),
    Case("rs-sizes-sum", lambda: RS(t(8, 4), "tp", src=P, dst=S(0), sizes=[2, 2, 2, 1]), ValueError,
         "spmd.reduce_scatter: sizes=[2, 2, 2, 1] add up to 7, but dim 0 has size 8"),
    Case("rs-sizes-with-v", lambda: RS(t(4, 4), "tp", src=P, dst=V, sizes=[1, 1, 1, 1]), ValueError,
         "spmd.reduce_scatter: sizes= needs a scatter dim (dst=S(d) or scatter_dim=); dst=V indexes dim 0"),
    Case("convert-sizes-sum", lambda: spmd.convert(t(8, 4), "tp", src=R, dst=S(0), sizes=[4, 4, 4, 4]), ValueError,
         "spmd.convert: sizes=[4, 4, 4, 4] add up to 16, but dim 0 has size 8"),
    Case("convert-sizes-wrong-length", lambda: spmd.convert(t(8, 4), "tp", src=R, dst=S(0), sizes=[8]), ValueError,
         "spmd.convert: sizes= gives one shard size per rank of axis 'tp' (4 ranks), got [8]"),
    # --- global SPMD: errors found before the collective runs
    Case("global-ag-src-v", global_gather_v, spmd.SpmdTypeError,
         "spmd.all_gather with src=V has no global meaning", ctx="global"),
    Case("global-rs-dst-v", global_scatter_v, spmd.SpmdTypeError,
         "spmd.reduce_scatter with dst=V has no global meaning", ctx="global"),
    Case("global-ag-not-minor-most", global_gather_not_minor, spmd.SpmdTypeError,
         "spmd.all_gather can only gather the minor-most mesh axes of a dim", ctx="global"),
    # --- set_current_mesh with bad meshes
    Case("mesh-none", lambda: enter(spmd.set_current_mesh(None)), RuntimeError,
         "set_current_mesh() with no mesh keeps the current one, but no mesh is current", ctx="none", exact=True),
    Case("mesh-list-of-ints", lambda: enter(spmd.set_current_mesh([1, 2])), TypeError,
         "a mesh given as a collection holds MeshAxis objects or ProcessGroups, got int", ctx="none"),
    Case("mesh-str", lambda: enter(spmd.set_current_mesh("tp")), TypeError,
         "or a collection of MeshAxis / ProcessGroup objects; got str", ctx="none"),
    Case("mesh-unnamed-devicemesh", lambda: enter(spmd.set_current_mesh(init_device_mesh("cpu", (8,)))), ValueError,
         "set_current_mesh needs a DeviceMesh with mesh_dim_names", ctx="none"),
    Case("mesh-dict-int-key", lambda: enter(spmd.set_current_mesh({0: group("tp")})), TypeError,
         "mesh axis names must be str, got 0", ctx="none"),
    Case("mesh-dict-value-str", lambda: enter(spmd.set_current_mesh({"tp": "group"})), TypeError,
         "mesh axis 'tp' must map to a ProcessGroup or a MeshAxis, got str", ctx="none"),
    Case("mesh-dict-value-devicemesh", lambda: enter(spmd.set_current_mesh({"tp": mesh()})), TypeError,
         "mesh axis 'tp' must map to a ProcessGroup or a MeshAxis, got DeviceMesh", ctx="none"),
    Case("mesh-dict-one-group-two-names", double_mesh_dict, ValueError,
         "set_current_mesh: axes 'a' and 'b' run over the same ranks; a mesh axis is one region of ranks, named once",
         ctx="none", exact=True),
    Case("mesh-dict-empty", lambda: enter(spmd.set_current_mesh({})), ValueError,
         "set_current_mesh: the mesh has no axes", ctx="none", exact=True),
    Case("mesh-dict-empty-name", lambda: enter(spmd.set_current_mesh({"": group("tp")})), ValueError,
         "set_current_mesh: mesh axis names must be non-empty", ctx="none", exact=True),
    # --- typecheck(local=..., strict=...) with bad values: nothing left switched on
    Case("typecheck-local-int", lambda: enter(spmd.typecheck(local=5)), TypeError,
         "typecheck(local=...) takes True, False, an axis name, a collection of axis names or {axis: bool}; "
         "got 5", ctx="mesh", exact=True),
    Case("typecheck-local-three", lambda: enter(spmd.typecheck(local=3)), TypeError,
         "typecheck(local=...) takes True, False, an axis name, a collection of axis names or {axis: bool}; "
         "got 3", ctx="mesh", exact=True),
    Case("typecheck-local-float", lambda: enter(spmd.typecheck(local=1.0)), TypeError,
         "typecheck(local=...) takes True, False, an axis name", ctx="mesh"),
    Case("typecheck-local-list-of-ints", lambda: enter(spmd.typecheck(local=[0, 1])), TypeError,
         "typecheck(local=...): axis names are str, got 0", ctx="mesh", exact=True),
    Case("typecheck-local-dict-non-bool", lambda: enter(spmd.typecheck(local={"tp": "yes"})), TypeError,
         "typecheck(local={...}) maps axis names to True or False, got 'tp': 'yes'", ctx="mesh", exact=True),
    Case("typecheck-local-dict-int-key", lambda: enter(spmd.typecheck(local={0: True})), TypeError,
         "typecheck(local=...): axis names are str, got 0", ctx="mesh", exact=True),
    Case("typecheck-local-unknown-axis", lambda: enter(spmd.typecheck(local=["pp"])), ValueError,
         "typecheck(local=...): " + UNKNOWN, ctx="mesh", exact=True),
    Case("typecheck-local-unknown-axis-str", lambda: enter(spmd.typecheck(local="pp")), ValueError,
         "typecheck(local=...): " + UNKNOWN, ctx="mesh", exact=True),
    Case("typecheck-strict-str", lambda: enter(spmd.typecheck(strict="yes")), TypeError,
         "typecheck(strict=...) takes True or False, got 'yes'", ctx="mesh", exact=True),
    Case("typecheck-strict-mode", lambda: enter(spmd.typecheck(strict_mode="loose")), ValueError,
         "typecheck(strict_mode=...) takes 'strict' or 'permissive', got 'loose'", ctx="mesh", exact=True),
    Case("typecheck-strict-both", lambda: enter(spmd.typecheck("strict", strict=True)), TypeError,
         "typecheck() takes strict_mode= or strict=, not both", ctx="mesh", exact=True),
    Case("typecheck-strict-int", lambda: enter(spmd.typecheck(strict=1)), TypeError,
         "typecheck(strict=...) takes True or False, got 1", ctx="mesh", exact=True),
    Case("typecheck-positional", lambda: enter(spmd.typecheck(True)), TypeError,
         "typecheck(strict_mode=...) takes 'strict' or 'permissive', got True; local or global SPMD is local=..., "
         "strictness strict=...", ctx="mesh", exact=True),
    Case("typecheck-bad-inside-good", lambda: enter(spmd.typecheck(local=7)), TypeError, "got 7"),
    # --- assert_type with bad type dicts, tensors and partition specs
    Case("assert-types-list", lambda: spmd.assert_type(t(4), [R]), TypeError,
         "assert_type takes types as a dict {axis: type}, e.g. {'tp': spmd.R}, an spmd.SpmdType, a PartitionSpec, or "
         "one of R, I, V, P; got [R]", exact=True),
    Case("assert-types-none", lambda: spmd.assert_type(t(4), None), TypeError,
         "assert_type needs a type: a dict {axis: type}, an spmd.SpmdType, or one of R, I, V, P", exact=True),
    Case("assert-types-a-string", lambda: spmd.assert_type(t(4), "R"), TypeError,
         "assert_type takes types as a dict {axis: type}, e.g. {'tp': spmd.R}, an spmd.SpmdType, a PartitionSpec, or "
         "one of R, I, V, P; got 'R'", exact=True),
    Case("assert-unknown-axis", lambda: spmd.assert_type(t(4), {"pp": R}), ValueError, UNKNOWN),
    Case("assert-value-str", lambda: spmd.assert_type(t(4), {"tp": "R"}), TypeError,
         "the type for axis 'tp' " + NOT_TYPE + ", got 'R' of type str"),
    Case("assert-value-none", lambda: spmd.assert_type(t(4), {"tp": None}), TypeError,
         "the type for axis 'tp' " + NOT_TYPE + ", got None"),
    Case("assert-value-shard-function", lambda: spmd.assert_type(t(4), {"tp": S}), TypeError,
         "the type for axis 'tp': spmd.S needs a dim: spmd.S(0)", exact=True),
    Case("assert-axis-int", lambda: spmd.assert_type(t(4), {0: R}), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got int"),
    Case("assert-no-mesh", lambda: enter_check_then(lambda: spmd.assert_type(t(4), {"tp": R})), RuntimeError,
         "assert_type needs a current mesh", ctx="none"),
    Case("assert-not-a-tensor", lambda: spmd.assert_type([1.0], {"tp": R}), TypeError,
         "assert_type takes a tensor (or a list or tuple of tensors) or an nn.Module, got float"),
    Case("assert-shard-out-of-range", lambda: spmd.assert_type(t(4, 4), {"tp": S(2)}), ValueError,
         "S(2) on axis 'tp' is out of range for a 2-d tensor"),
    Case("assert-shard-of-0d", lambda: spmd.assert_type(t(), {"tp": S(0)}), ValueError,
         "S(0) on axis 'tp' is out of range for a 0-d tensor"),
    Case("assert-mismatch", lambda: spmd.assert_type(ty({"tp": R}, 4), {"tp": P}), spmd.SpmdTypeError,
         "Type assertion failed: the tensor is R on axis 'tp', and the assertion says P."),
    Case("assert-module-with-spec", lambda: spmd.assert_type(torch.nn.Linear(2, 2), {"tp": R}, PS("tp")), TypeError,
         "assert_type on a module types every parameter alike: pass no partition_spec"),
    Case("assert-module-bad-types", lambda: spmd.assert_type(torch.nn.Linear(2, 2), {"tp": "R"}), TypeError,
         "the type for axis 'tp' " + NOT_TYPE),
    Case("spec-axis-twice", lambda: spmd.assert_type(t(4, 4), {}, PS("tp", "tp")), ValueError,
         "mesh axis 'tp' appears twice in partition spec ('tp', 'tp')"),
    Case("spec-axis-twice-in-one-dim", lambda: spmd.assert_type(t(4, 4), {}, PS(("tp", "tp"))), ValueError,
         "mesh axis 'tp' appears twice in partition spec (('tp', 'tp'),)"),
    Case("spec-too-long", lambda: spmd.assert_type(t(4), {}, PS("dp", "tp")), ValueError,
         "partition spec ('dp', 'tp') has 2 entries for a 1-d tensor"),
    Case("spec-unknown-axis", lambda: spmd.assert_type(t(4, 4), {}, PS("pp")), ValueError, UNKNOWN),
    Case("spec-a-str", lambda: spmd.assert_type(t(4, 4), {}, "tp"), TypeError,
         "partition spec must be a PartitionSpec or a tuple of entries (None, an axis name or a tuple of axis "
         "names), one per tensor dim; got 'tp'", exact=True),
    Case("spec-an-int", lambda: spmd.assert_type(t(4, 4), {}, 0), TypeError,
         "partition spec must be a PartitionSpec or a tuple of entries (None, an axis name or a tuple of axis "
         "names), one per tensor dim; got 0", exact=True),
    Case("spec-entry-int", lambda: spmd.assert_type(t(4, 4), {}, (0, None)), TypeError,
         "partition spec entries are None, an axis name or a tuple of axis names; got 0", exact=True),
    Case("spec-entry-tuple-of-int", lambda: spmd.assert_type(t(4, 4), {}, (("tp", 1),)), TypeError,
         "partition spec entries are None, an axis name or a tuple of axis names; got ('tp', 1)", exact=True),
    Case("spec-disagrees-with-types", lambda: spmd.assert_type(t(4, 4), {"tp": S(0)}, PS(None, "tp")), ValueError,
         "axis 'tp': the types say S(0), but the partition spec places it on dim 1", exact=True),
    Case("spec-places-r-axis", lambda: spmd.assert_type(t(4, 4), {"tp": R}, PS("tp")), ValueError,
         "axis 'tp' shards a dim in the partition spec but its type is R, not V"),
    Case("partitionspec-int-entry", lambda: PS(1), TypeError,
         "PartitionSpec entries are None, an axis name or a tuple of axis names; got 1"),
    Case("partitionspec-list-entry", lambda: PS(["tp"]), TypeError,
         "PartitionSpec entries are None, an axis name or a tuple of axis names; got ['tp']"),
    Case("global-v-without-placement", lambda: spmd.assert_type(t(4, 4), {"tp": V}), spmd.SpmdTypeError,
         "the tensor is V on axis 'tp', which is checked in global SPMD, but no dim is sharded", ctx="global"),
    # --- local_map arity and declarations
    Case("local-map-too-many-in-types", lambda: local_map_call(ident, [{"tp": R}, {"tp": R}], {"tp": R}, t(4)),
         TypeError, "local_map(ident): 2 in_types for 1 arguments"),
    Case("local-map-too-few-out-types", lambda: local_map_call(twice, [{"tp": R}], [{"tp": R}], t(4)),
         TypeError, "local_map(twice): 1 out_types for the tuple it returned"),
    Case("local-map-out-types-for-single", lambda: local_map_call(ident, [{"tp": R}], [{"tp": R}, None], t(4)),
         TypeError, "local_map(ident): 2 out_types for the LTensor it returned"),
    Case("local-map-output-not-tensor", lambda: local_map_call(three, [{"tp": R}], {"tp": R}, t(4)),
         TypeError, "local_map(three): output 0 is a int, not a tensor"),
    Case("local-map-in-types-a-dict", lambda: spmd.local_map(lambda a: a, in_types={"tp": R}, out_types={"tp": R}),
         TypeError, "local_map: in_types takes one type dict (or None) per positional argument, e.g. "
         "[{'tp': spmd.R}]; got {'tp': R}", exact=True),
    Case("local-map-in-types-entry-str", lambda: spmd.local_map(lambda a: a, in_types=["tp"], out_types={"tp": R}),
         TypeError, "local_map: in_types[0] must be a type dict {axis: type} or None, got 'tp'", exact=True),
    Case("local-map-out-types-a-type", lambda: spmd.local_map(lambda a: a, in_types=[{"tp": R}], out_types=R),
         TypeError, "local_map: out_types takes a type dict, or one (or None) per output; got R", exact=True),
    Case("local-map-out-types-entry-int", lambda: spmd.local_map(lambda a: a, in_types=[None], out_types=[1]),
         TypeError, "local_map: out_types[0] must be a type dict {axis: type} or None, got 1", exact=True),
    Case("local-map-unknown-axes", lambda: local_map_call(lambda a: a, [{"tp": R}], {"tp": R}, t(4), axes=["pp"]),
         ValueError, UNKNOWN),
    Case("local-map-in-type-mismatch", lambda: local_map_call(lambda a: a, [{"tp": P}], {"tp": P}, ty({"tp": R}, 4)),
         spmd.SpmdTypeError, "Type assertion failed: the tensor is R on axis 'tp', and the assertion says P."),
    Case("local-map-out-type-mismatch", lambda: local_map_call(ident, [{"tp": R}], {"tp": P}, t(4)),
         spmd.SpmdTypeError, "local_map: output 0 of ident is R on axis 'tp', and out_types declares P."),
    Case("local-map-no-mesh", lambda: enter_check_then(lambda: local_map_call(ident, [None], {"tp": R}, t(4))),
         RuntimeError, "local_map needs a current mesh", ctx="none"),
    # --- tensors typed on two meshes mixed; explicit-partial ops
    Case("two-meshes-mixed", two_meshes, spmd.SpmdTypeError, "mixes tensors typed on different meshes, and other "
         "cannot be moved onto the current mesh: axes (a, b) would flatten into (dp, tp), but their types differ (a: V, "
         "b: R); a flattened axis has one type."),
    Case("sum-out-partial-unknown", lambda: spmd.sum(ty({"tp": V}, 4), out_partial_axes=["pp"]), ValueError, UNKNOWN),
    Case("sum-out-partial-int", lambda: spmd.sum(ty({"tp": V}, 4), out_partial_axes=3), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got int"),
    Case("linear-out-partial-already-p", lambda: spmd.linear(ty({"tp": P}, 2, 4), ty({"tp": R}, 3, 4),
                                                             out_partial_axes="tp"),
         spmd.SpmdTypeError, "out_partial_axes reinterprets the result as a pending sum (P) on 'tp', but the local "
         "result is already P there."),
    Case("redistribute-spec-dict-mesh", lambda: spmd.redistribute(t(4, 4), PS("tp"), PS(None)), TypeError,
         "spmd.redistribute needs the current mesh to be a DeviceMesh", ctx="mesh-dict"),
    # --- all_reduce(op="max" | "min")
    Case("max-src-p", lambda: AR(t(4), "tp", src=P, dst=R, op="max"), spmd.SpmdTypeError,
         "spmd.all_reduce(op='max') cannot take src=P: a pending sum's value is the sum over ranks"),
    Case("min-dst-v", lambda: AR(t(4), "tp", src=V, dst=V, op="min"), spmd.SpmdTypeError,
         "spmd.all_reduce(op='min') cannot take src=V to dst=V: it takes a V (or S(d)) value to R or I."),
    Case("max-unknown-axis", lambda: AR(t(4), "pp", src=V, dst=R, op="max"), ValueError,
         "spmd.all_reduce: " + UNKNOWN),
    Case("max-src-str", lambda: AR(t(4), "tp", src="V", dst=R, op="max"), TypeError,
         "spmd.all_reduce: src " + NOT_TYPE + ", got 'V' of type str"),
    Case("max-input-list", lambda: AR([1.0], "tp", src=V, dst=R, op="max"), TypeError,
         "spmd.all_reduce takes a tensor, got list"),
    Case("max-src-not-input-type", lambda: AR(ty({"tp": R}, 4), "tp", src=V, dst=R, op="max"), spmd.SpmdTypeError,
         "src=V, but the tensor is R on axis 'tp'"),
    Case("max-global-src-v", global_max, spmd.SpmdTypeError, "spmd.all_reduce(op='max') with src=V has no global meaning",
         ctx="global"),
    # --- axis_index, Scalar, no_typecheck, module boundaries
    Case("axis-index-unknown", lambda: spmd.axis_index("pp"), ValueError, "spmd.axis_index: " + UNKNOWN),
    Case("axis-index-int", lambda: spmd.axis_index(3), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got int"),
    Case("axis-index-global", lambda: spmd.axis_index("tp"), spmd.SpmdTypeError,
         "spmd.axis_index is V on axis 'tp', which is checked in global SPMD", ctx="global"),
    Case("axis-index-no-mesh", lambda: spmd.axis_index("tp"), RuntimeError,
         "spmd.axis_index: axis 'tp' is a name, but no mesh is current", ctx="none"),
    Case("scalar-list", lambda: spmd.Scalar([1], {"tp": V}), TypeError,
         "spmd.Scalar takes a Python number (or a 0-d tensor), got list"),
    Case("scalar-1d-tensor", lambda: spmd.Scalar(torch.ones(2), {"tp": V}), ValueError,
         "spmd.Scalar takes a 0-d tensor, got shape [2]"),
    Case("scalar-bad-type", lambda: spmd.Scalar(1.0, {"tp": "V"}), TypeError, "the type for axis 'tp' " + NOT_TYPE),
    Case("no-typecheck-block-with-types", lambda: enter(spmd.no_typecheck(in_types=[{"tp": R}])), TypeError,
         "spmd.no_typecheck: in_types= and out_types= type a function's arguments and results"),
    Case("no-typecheck-arity", lambda: spmd.no_typecheck(in_types=[{"tp": R}, None], out_types={"tp": R})(ident)(t(4)),
         TypeError, "spmd.no_typecheck(ident): 2 in_types for 1 arguments"),
    Case("no-typecheck-in-types-a-dict",
         lambda: spmd.no_typecheck(in_types={"tp": R}, out_types={"tp": R})(ident)(t(4)), TypeError,
         "in_types takes one type dict (or None) per positional argument"),
    Case("boundary-arity", lambda: boundary_call([{"tp": R}, {"tp": R}]), TypeError,
         "spmd.typed_boundary(ident): 2 in_types for 1 arguments", exact=True),
    Case("boundary-bad-type", lambda: boundary_call([{"tp": "R"}]), TypeError, "the type for axis 'tp' " + NOT_TYPE),
    Case("attach-boundary-arity", lambda: attach_call([{"tp": R}, {"tp": R}]), TypeError,
         "Identity: 2 type specs for tuple"),
    # --- partition-spec redistribute and its planner
    Case("plan-spec-a-str", lambda: spmd.plan_redistribute((8, 4), "tp", (None, "tp"), {"tp": 4}), TypeError,
         "src_spec must be a PartitionSpec or a tuple of entries", ctx="none"),
    Case("plan-unknown-axis", lambda: spmd.plan_redistribute((8, 4), ("pp", None), (None, "tp"), {"tp": 4}),
         ValueError, "src_spec names mesh axis 'pp' (dim 0), which is not in the mesh", ctx="none"),
    Case("plan-not-divisible", lambda: spmd.plan_redistribute((6, 4), ("tp", None), (None, "tp"), {"tp": 4}),
         ValueError, "src_spec shards dim 0 (size 6) over tp(4) = 4 ranks, which does not divide it", ctx="none"),
    Case("redistribute-spec-unknown", lambda: spmd.redistribute(ty({"tp": S(0)}, 4, 4), PS("pp"), PS(None)),
         ValueError, "src_spec names mesh axis 'pp' (dim 0), which is not in the mesh"),
    Case("redistribute-spec-a-str", lambda: spmd.redistribute(ty({"tp": S(0)}, 4, 4), "tp", PS(None)), TypeError,
         "src_spec must be a PartitionSpec or a tuple of entries"),
    Case("redistribute-spec-not-the-tensor", lambda: spmd.redistribute(ty({"tp": R}, 4, 4), PS("tp"), PS(None)),
         spmd.SpmdTypeError, "spmd.redistribute: src_spec (and src_partial) must describe the tensor as it is."),
    Case("redistribute-spec-bad-entry", lambda: spmd.redistribute(ty({"tp": S(0)}, 4, 4), PS("tp"), (1, None)),
         TypeError, "dst_spec entries are None, an axis name or a tuple of axis names; got 1"),
    Case("convert-sizes-with-v", lambda: spmd.convert(t(4, 4), "tp", src=R, dst=V, sizes=[1, 1, 1, 1]), ValueError,
         "spmd.convert: sizes= needs a shard dim (dst=S(d)); dst=V keeps x[rank]", exact=True),
    Case("assert-shard-bool-dim", lambda: spmd.assert_type(t(4, 4), {"tp": S(True)}), TypeError,
         "S(dim) needs an int tensor dim, got True"),
    Case("assert-axis-tuple-key", lambda: spmd.assert_type(t(4), {("dp", "tp"): R}), TypeError,
         "axis must be a mesh axis name, a ProcessGroup, a MeshAxis or a 1-D DeviceMesh, got tuple"),
    Case("typecheck-local-devicemesh", lambda: enter(spmd.typecheck(local=mesh())), TypeError,
         "typecheck(local=...) takes True, False, an axis name, a collection of axis names or {axis: bool}; got "
         "DeviceMesh", ctx="mesh"),
    Case("typecheck-local-bytes", lambda: enter(spmd.typecheck(local=b"tp")), TypeError,
         "typecheck(local=...) takes True, False, an axis name, a collection of axis names or {axis: bool}; "
         "got b'tp'", ctx="mesh", exact=True),
    Case("typecheck-local-tensor", lambda: enter(spmd.typecheck(local=torch.ones(2))), TypeError,
         "typecheck(local=...) takes True, False, an axis name", ctx="mesh"),
    # --- ordinary typed ops that mix types wrongly (the rules' own errors; no communication)
    Case("add-r-p", lambda: ty({"tp": R}, 4) + ty({"tp": P}, 4), spmd.SpmdTypeError,
         "A pending sum (P) can only be added to another pending sum"),
    Case("mul-p-p", lambda: ty({"tp": P}, 4) * ty({"tp": P}, 4), spmd.SpmdTypeError, "P"),
    Case("linear-i-v", lambda: F.linear(ty({"tp": V}, 2, 4), ty({"tp": I}, 3, 4).requires_grad_()), spmd.SpmdTypeError,
         "Invariant (I) values only combine with other I values"),
    Case("backward-from-r", lambda: ty({"tp": R}, 4).requires_grad_().sum().backward(), spmd.SpmdTypeError,
         "backward() from a Replicate (R) value"),
    # --- issue 14, item 3: accepted silently before
    Case("reinterpret-src-shard-out-of-range", lambda: spmd.reinterpret(ty({"tp": V}, 4, 4), "tp", src=S(2), dst=P),
         ValueError, "spmd.reinterpret: src=S(2) names tensor dim 2, but the tensor has 2 dims", exact=True),
    Case("reinterpret-dst-shard-out-of-range", lambda: spmd.reinterpret(ty({"tp": R}, 4, 4), "tp", src=R, dst=S(5)),
         ValueError, "spmd.reinterpret: dst=S(5) names tensor dim 5, but the tensor has 2 dims", exact=True),
    Case("reinterpret-dst-shard-negative-out-of-range",
         lambda: spmd.reinterpret(ty({"tp": I}, 4, 4), "tp", src=I, dst=S(-3)), ValueError,
         "spmd.reinterpret: dst=S(-3) names tensor dim -3, but the tensor has 2 dims", exact=True),
    Case("reinterpret-plain-src-shard-out-of-range", lambda: spmd.reinterpret(t(4), "tp", src=S(1), dst=P),
         ValueError, "spmd.reinterpret: src=S(1) names tensor dim 1, but the tensor has 1 dims", exact=True),
    Case("convert-typed-src-shard-out-of-range", lambda: spmd.convert(ty({"tp": V}, 4, 4), "tp", src=S(2), dst=P),
         ValueError, "spmd.convert: src=S(2) names tensor dim 2, but the tensor has 2 dims", exact=True),
    Case("convert-typed-dst-shard-of-0d", lambda: spmd.convert(ty({"tp": I}), "tp", src=I, dst=S(0)),
         ValueError, "spmd.convert: dst=S(0) names tensor dim 0, but the tensor has 0 dims", exact=True),
    Case("redistribute-shard-out-of-range", lambda: spmd.redistribute(ty({"tp": R}, 4, 4), "tp", src=R, dst=S(2)),
         ValueError, "spmd.redistribute: dst=S(2) names tensor dim 2, but the tensor has 2 dims", exact=True),
    Case("local-map-unchecked-leading-tensor",
         lambda: local_map_call(pair, [{"tp": R}], {"tp": R}, t(4), t(4)), TypeError,
         "local_map(pair): in_types has 1 entry for 2 positional arguments, so argument 0 (a Tensor of shape "
         "[4]) would go unchecked; give one entry per positional argument (None leaves one unchecked)", exact=True),
    Case("typed-boundary-unchecked-leading-tensor",
         lambda: spmd.typed_boundary(in_types=[{"tp": R}])(pair)(t(4), t(4)), TypeError,
         "spmd.typed_boundary(pair): in_types has 1 entry for 2 positional arguments, so argument 0 (a Tensor "
         "of shape [4]) would go unchecked; give one entry per positional argument (None leaves one unchecked)",
         exact=True),
    Case("attach-boundary-not-a-module", lambda: spmd.attach_boundary(ident, in_types=[{"tp": R}]), TypeError,
         "spmd.attach_boundary takes an nn.Module (it asserts types in the module's forward hooks), got function "
         "'ident'; for a function use @spmd.typed_boundary(in_types=..., out_types=...)", exact=True),
    Case("attach-boundary-in-types-a-dict", lambda: spmd.attach_boundary(torch.nn.Identity(), in_types={"tp": R}),
         TypeError, "spmd.attach_boundary: in_types takes one type dict (or None) per positional argument, e.g. "
         "[{'tp': spmd.R}]; got {'tp': R}", exact=True),
    Case("attach-boundary-out-types-a-type", lambda: spmd.attach_boundary(torch.nn.Identity(), out_types=R),
         TypeError, "spmd.attach_boundary: out_types takes a type dict, or one (or None) per output; got R",
         exact=True),
    Case("typed-boundary-in-types-a-dict", lambda: spmd.typed_boundary(in_types={"tp": R}), TypeError,
         "spmd.typed_boundary: in_types takes one type dict (or None) per positional argument, e.g. "
         "[{'tp': spmd.R}]; got {'tp': R}", exact=True),
    Case("redistribute-src-spec-disagrees-with-shard-type",
         lambda: spmd.redistribute(ty({"dp": R, "tp": S(1)}, 4, 4), PS("tp", None), PS(None, "tp")), spmd.SpmdTypeError,
         "  axis:          'tp': the tensor is S(1), and src_spec places 'tp' on dim 0"),
    Case("redistribute-src-spec-leaves-out-a-shard-axis",
         lambda: spmd.redistribute(ty({"dp": S(0), "tp": R}, 4, 4), PS(None, None), PS(None, "tp")),
         spmd.SpmdTypeError, "'dp': the tensor is S(0), and src_spec places 'dp' on no dim"),
    Case("redistribute-type-for-dst-spec", lambda: spmd.redistribute(ty({"tp": S(0)}, 4, 4), "tp", R), TypeError,
         "spmd.redistribute: dst_spec takes a partition spec, got the SPMD type R; a change of type on one axis "
         "takes src= and dst= by keyword: spmd.redistribute(x, 'tp', src=spmd.S(0), dst=spmd.R)", exact=True),
    Case("redistribute-type-for-dst-spec-plain", lambda: spmd.redistribute(t(4, 4), "tp", P), TypeError,
         "spmd.redistribute: dst_spec takes a partition spec, got the SPMD type P; a change of type on one axis "
         "takes src= and dst= by keyword: spmd.redistribute(x, 'tp', src=..., dst=spmd.P)", exact=True, ctx="mesh"),
    Case("to-dtensor-shard-out-of-range", lambda: spmd.to_dtensor(ty({"tp": V}, 4, 4), mesh(), [Shard(0), Shard(2)]),
         ValueError, "spmd.to_dtensor: the placement Shard(dim=2) names tensor dim 2, but the tensor has 2 dims",
         exact=True),
    Case("dtensor-from-local-r-as-replicate", lambda: DTensor.from_local(ty({"tp": R}, 4), mesh(), [Shard(0), Replicate()]),
         spmd.SpmdTypeError, "DTensor.from_local: the tensor is R on axis 'tp', and the placement Replicate() means I."),
]


def enter_check_then(fn: Callable[[], Any]) -> Any:
    """Checking on with no mesh: the call must ask for one."""
    with spmd.typecheck():
        return fn()


@pytest.fixture(scope="module", autouse=True)
def env():
    ENV["mesh"] = fake_mesh((2, 4), ("dp", "tp"))
    ENV["ep_mesh"] = init_device_mesh("cpu", (8,), mesh_dim_names=("ep",))
    ENV["ab_mesh"] = init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b"))
    yield
    ENV.clear()


def _context(ctx: str):
    stack = contextlib.ExitStack()
    if ctx in ("check", "global", "mesh"):
        stack.enter_context(spmd.set_current_mesh(ENV["mesh"]))
    if ctx == "mesh-dict":
        stack.enter_context(spmd.set_current_mesh({"dp": group("dp")}))
    if ctx == "check":
        stack.enter_context(spmd.typecheck())
    if ctx == "global":
        stack.enter_context(spmd.typecheck(local=False))
    return stack


def _state() -> tuple:
    return (STATE.checking, STATE.strict, STATE.global_mode, STATE.local_axes, STATE.out_partial, current_mesh())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input(case: Case):
    before = _state()
    with _context(case.ctx):
        inside = _state()
        with CommCounter() as comms:
            with pytest.raises(case.exc) as err:
                case.call()
        assert _state() == inside, "the failed call left per-thread state changed"
    assert _state() == before
    text = str(err.value)
    if case.exact:
        assert text == case.msg
    else:
        assert case.msg in text, f"{case.msg!r} not in:\n{text}"
    assert comms.total == 0, f"communicated before failing: {comms.counts}"


def test_the_battery_is_large_and_ids_are_unique():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)


# ---------------------------------------------------------------------------
# Inputs that look odd but are fine: each gives the right result (simulated ranks, the same 2x4 mesh)


def _fine(fn: Callable[[Any], tuple[torch.Tensor, dict, torch.Tensor]], comms: dict) -> None:
    """Run ``fn(mesh)`` -> (result, its types, the expected denotation) under simulated ranks."""
    m = ENV["mesh"]
    with LocalTensorMode(8), spmd.set_current_mesh(m), spmd.typecheck():
        with CommCounter() as counter:
            out, types, want = fn(m)
        assert spmd.get_type(out) == types
        torch.testing.assert_close(denote(out, m, types), want)
        assert counter.counts == comms


def _values(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank r's value: ``r + 1`` everywhere (so sums and stacks are easy to write down)."""
    return per_rank(lambda r: torch.full(shape, r + 1, dtype=dtype))


def test_fine_all_reduce_of_an_empty_tensor():
    def run(m):
        x = spmd.assert_type(_values((0, 3)), {"dp": V, "tp": P})
        return AR(x, "tp", src=P, dst=R), {"dp": V, "tp": R}, torch.zeros(2, 0, 3)
    _fine(run, {"all_reduce": 1})


def test_fine_all_reduce_of_a_0d_value():
    def run(m):
        # dp is R, so every dp row must hold the same value: use rank % 4 + 1 (the tp index + 1).
        x = spmd.assert_type(per_rank(lambda r: torch.tensor(float(r % 4 + 1))), {"dp": R, "tp": P})
        return AR(x, "tp", src=P, dst=R, op="avg"), {"dp": R, "tp": R}, torch.tensor(2.5)
    _fine(run, {"all_reduce": 1})


def test_fine_integer_sum_is_exact():
    def run(m):
        x = spmd.assert_type(per_rank(lambda r: torch.tensor([r % 4 + 1, 7])), {"dp": R, "tp": P})
        return AR(x, "tp", src=P, dst=R), {"dp": R, "tp": R}, torch.tensor([10, 28])
    _fine(run, {"all_reduce": 1})


def test_fine_all_gather_of_0d_values_stacks_them():
    def run(m):
        x = spmd.assert_type(per_rank(lambda r: torch.tensor(float(r % 4))), {"dp": R, "tp": V})
        return AG(x, "tp", src=V, dst=R), {"dp": R, "tp": R}, torch.arange(4.0)
    _fine(run, {"all_gather": 1})


def test_fine_all_gather_of_empty_shards():
    def run(m):
        x = spmd.assert_type(_values((0, 2)), {"dp": R, "tp": S(0)})
        return AG(x, "tp", src=S(0), dst=R), {"dp": R, "tp": R}, torch.zeros(0, 2)
    _fine(run, {"all_gather": 1})


def test_fine_reduce_scatter_with_an_empty_dim():
    def run(m):
        x = spmd.assert_type(_values((0, 4)), {"dp": R, "tp": P})
        return RS(x, "tp", src=P, dst=S(1)), {"dp": R, "tp": S(1)}, torch.zeros(0, 4)
    _fine(run, {"reduce_scatter": 1})


def test_fine_redistribute_to_the_same_type_is_the_input():
    m = ENV["mesh"]
    with spmd.set_current_mesh(m), spmd.typecheck(), CommCounter() as counter:
        x = ty({"dp": V, "tp": S(0)}, 4, 4)
        assert spmd.redistribute(x, "tp", src=S(0), dst=S(0)) is x
    assert counter.total == 0


@pytest.mark.parametrize("local", [[], (), {}, {"tp": False}, frozenset()])
def test_fine_typecheck_with_no_local_axes_is_global_everywhere(local):
    with spmd.set_current_mesh(ENV["mesh"]), spmd.typecheck(local=local):
        assert STATE.global_mode and STATE.local_axes == frozenset()
    assert not STATE.checking


def test_fine_sizes_as_a_tuple_or_torch_size():
    m = ENV["mesh"]
    with spmd.set_current_mesh(m), spmd.typecheck():
        for sizes in ((2, 2, 2, 2), torch.Size([2, 2, 2, 2])):
            out = RS(ty({"dp": V, "tp": P}, 8, 3), "tp", src=P, dst=S(0), sizes=sizes)
            assert spmd.get_type(out) == {"dp": V, "tp": S(0)}
