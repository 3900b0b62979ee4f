"""The plain-tensor forward of every typed op, by op name: what ``_comm_call.run`` runs.

Each kernel takes a plain tensor and a resolved call (``_comm_call.Call``:
the op, src/dst types, the axis's group, layout options) and does the local
work or the collective. The backward is never here: ``_comm_call`` runs the
op's dual from ``_transitions``, so the table stays the one source of truth.
Kept below the op sections (``_local``, ``_collectives``) so that the runner
needs nothing above it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._core.types import I, P, R, SpmdType, V, base_type
from . import impl as impl

__all__ = ["KERNELS", "keeps_shards", "is_alias"]


def _reinterpret(x: torch.Tensor, call: Any) -> torch.Tensor:
    return impl.scaled(x, call.reduce, call.comm.size)


# convert: same meaning, local work only
_CONVERT_KIND = {
    (R, I): "same", (I, R): "same", (R, V): "take", (I, V): "take",
    (R, P): "first", (I, P): "first", (V, P): "place",
}


def _convert(x: torch.Tensor, call: Any) -> torch.Tensor:
    kind = _CONVERT_KIND[(base_type(call.src), base_type(call.dst))]
    comm = call.comm
    if kind == "same":
        out = x.view_as(x)
    elif kind == "take":
        out = impl.take_slice(x, comm, call.dim, call.sizes)
    elif kind == "first":
        out = impl.keep_on_first(x, comm)
    else:
        out = impl.place_slice(x, comm, call.dim, call.sizes)
    return out if call.reduce == "sum" else impl.scaled(out, call.reduce, comm.size)


def _all_reduce(x: torch.Tensor, call: Any) -> torch.Tensor:
    return impl.all_reduce(x, call.comm, call.reduce)


def _all_gather(x: torch.Tensor, call: Any) -> torch.Tensor:
    out = impl.all_gather(x, call.comm, call.dim, call.sizes)
    return out if call.reduce == "sum" else impl.scaled(out, call.reduce, call.comm.size)


def _reduce_scatter(x: torch.Tensor, call: Any) -> torch.Tensor:
    return impl.reduce_scatter(x, call.comm, call.dim, call.reduce, call.sizes)


def keeps_shards(src: SpmdType, dst: SpmdType) -> bool:
    """S(d) -> S(d): the shards of dim d stay its shards (concat(xs, d).chunk(n, d) is xs), so nothing moves."""
    return src == dst and src is not V


def _all_to_all(x: torch.Tensor, call: Any) -> torch.Tensor:
    if call.in_splits is not None:  # uneven pieces on dim 0 (MoE token routing)
        out = impl.all_to_all_uneven(x, call.comm, call.in_splits, call.out_splits)
        return out if call.reduce == "sum" else impl.scaled(out, call.reduce, call.comm.size)
    if keeps_shards(call.src, call.dst):  # the identity; its dual is S(d) -> S(d) again
        return x.view_as(x)
    out = impl.all_to_all(x, call.comm, call.split_dim, call.concat_dim)
    return out if call.reduce == "sum" else impl.scaled(out, call.reduce, call.comm.size)


def is_alias(call: Any) -> bool:
    """Whether ``call``'s kernel returns an alias of its input, the values unchanged (``x.view_as(x)``)."""
    if call.reduce != "sum":
        return False
    if call.op == "reinterpret":
        return True
    if call.op == "convert":
        return _CONVERT_KIND[(base_type(call.src), base_type(call.dst))] == "same"
    return call.op == "all_to_all" and call.in_splits is None and keeps_shards(call.src, call.dst)


KERNELS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "reinterpret": _reinterpret,
    "convert": _convert,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
}
