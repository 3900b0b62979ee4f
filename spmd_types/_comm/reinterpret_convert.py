"""``reinterpret`` and ``convert``: type changes with no communication in the forward.

Each section holds the op's typing, its forward and its backward; the
backward is a call to the op's dual as ``_transitions`` names it (see
``_comm_call.dual``), so the table is the one source of truth. The backward of
some of them communicates: ``reinterpret(I, R)`` backward is an all-reduce.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._core.dtensor_hook import interop, is_dtensor
from .._core.traced import register_call, routed, traced_call
from .._core.types import AxisType, SpmdType, V, base_type
from .async_op import takes_async_op
from .call import Call, begin, check_sizes, finish, norm_dim
from .dtypes import for_call
from .erased import erased, remember_erased

__all__ = ["reinterpret", "convert"]



# ---------------------------------------------------------------------------
# reinterpret: same local data, new type (the meaning may change)


@takes_async_op
def reinterpret(
    x: torch.Tensor, axis: Any, *, src: SpmdType, dst: SpmdType, op_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None, backward_options: dict | None = None, expert_mode: bool = False,
) -> torch.Tensor:
    """Change ``x``'s type on ``axis`` from ``src`` to ``dst`` without touching its local data.

    The meaning may change: ``reinterpret(R, P)`` of ``[3.]`` on 4 ranks means
    ``[12.]``. No communication forward; the backward is the dual in seed
    003's table (``reinterpret(I, R)`` backward is an all-reduce)::

        A   =>  +A          (R -> P: every rank's copy joins the pending sum)
                +A

    ``op_dtype``, ``out_dtype`` and ``backward_options`` cast as on every typed op
    (see the low-precision page of the docs). ``expert_mode=`` is the published
    API's switch for R -> I, R -> P, I -> R and R -> V; seed 003's table allows
    them here without it (docs/choices.md, choice 49).

    Example::

        out = spmd.reinterpret(hidden @ w, "tp", src=spmd.V, dst=spmd.P)  # row-parallel matmul
    """
    if src is dst and isinstance(src, AxisType):  # no change (the published API returns x): src still checked
        return same_type("spmd.reinterpret", x, axis, src, (op_dtype, out_dtype, backward_options))
    fast_args = ("reinterpret", axis, src, dst)
    hit = erased(x, fast_args, op_dtype, out_dtype, backward_options)
    if hit is not None:
        return hit
    if routed():  # torch.compile traces: one graph node (see _core/traced.py)
        return traced_call("reinterpret", x, axis, src=src, dst=dst, op_dtype=op_dtype, out_dtype=out_dtype,
                           backward_options=backward_options)
    if is_dtensor(x):
        return interop().typed_op(reinterpret, x, axis, src=src, dst=dst, op_dtype=op_dtype, out_dtype=out_dtype,
                                  backward_options=backward_options)
    begun = begin("reinterpret", x, axis, src, dst)
    dtypes = for_call(begun, "reinterpret", x, op_dtype, out_dtype, backward_options)
    call = Call("reinterpret", begun.src, begun.dst, begun.comm, dtypes=dtypes)
    out = finish(begun, call, x)
    remember_erased(x, fast_args, op_dtype, out_dtype, backward_options, call)
    return out


# ---------------------------------------------------------------------------
# convert: same meaning, new type (local slicing or zero-filling only)


@takes_async_op
def convert(
    x: torch.Tensor, axis: Any, *, src: SpmdType, dst: SpmdType, sizes: Sequence[int] | None = None,
    op_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None, backward_options: dict | None = None,
    expert_mode: bool = False,
) -> torch.Tensor:
    """Change ``x``'s type on ``axis`` keeping its meaning, with local work only.

    * R/I -> V: each rank keeps ``x[rank]`` (dim 0 must have one entry per rank);
      R/I -> S(d): each rank keeps its shard of dim ``d`` (``sizes=`` for uneven shards).
    * R/I -> P: rank 0 keeps ``x``, the others hold zeros.
    * V -> P: each rank puts its value at index ``rank`` of zeros ``[N, ...]``;
      S(d) -> P: each rank puts its shard in its place in zeros of the full shape.
    * R <-> I: nothing changes but the gradient's type.

    ``op_dtype`` / ``out_dtype`` cast before / after; ``backward_options`` are the
    backward's. ``convert(I, R)`` of a bf16 value needs ``backward_options={"op_dtype": ...}``:
    its backward all-reduces the gradient.

    ::

        [A, B, C]  =>  [A]      (R -> S(0): keep your slice)
                       [B]
                       [C]

    Example::

        w_shard = spmd.convert(w, "tp", src=spmd.I, dst=spmd.S(0))
    """
    if src is dst and isinstance(src, AxisType):  # no change (the published API returns x): src still checked
        return same_type("spmd.convert", x, axis, src, (op_dtype, out_dtype, backward_options))
    fast_args = None if sizes is not None else ("convert", axis, src, dst)
    hit = None if fast_args is None else erased(x, fast_args, op_dtype, out_dtype, backward_options)
    if hit is not None:
        return hit
    if routed():
        return traced_call("convert", x, axis, src=src, dst=dst, sizes=sizes, op_dtype=op_dtype, out_dtype=out_dtype,
                           backward_options=backward_options)
    if is_dtensor(x):
        return interop().typed_op(convert, x, axis, src=src, dst=dst, sizes=sizes, op_dtype=op_dtype,
                                  out_dtype=out_dtype, backward_options=backward_options)
    begun = begin("convert", x, axis, src, dst)
    src, dst, comm = begun.src, begun.dst, begun.comm
    sizes = check_sizes(begun.opname, sizes, comm)
    dim = None
    if base_type(dst) is V:
        dim = _slice_layout(begun.opname, x, dst, comm.size, sizes, comm.label)
    elif base_type(src) is V:
        dim = None if src is V else norm_dim(begun.opname, f"src={src}", src.dim, x.dim())
    dtypes = for_call(begun, "convert", x, op_dtype, out_dtype, backward_options)
    call = Call("convert", src, dst, comm, dim=dim, sizes=sizes, dtypes=dtypes)
    out = finish(begun, call, x)
    remember_erased(x, fast_args, op_dtype, out_dtype, backward_options, call)
    return out


def _slice_layout(opname: str, x: torch.Tensor, dst: SpmdType, n: int, sizes: Any, label: str) -> int | None:
    """The dim that ``convert(..., dst=V or S(d))`` slices, after checking it splits evenly."""
    if dst is V and sizes is not None:
        raise ValueError(f"{opname}: sizes= needs a shard dim (dst=S(d)); dst=V keeps x[rank]")
    if dst is V:
        if x.dim() == 0 or x.shape[0] != n:
            raise ValueError(
                f"{opname}: dst=V keeps x[rank], so dim 0 must have one entry per rank of axis {label} "
                f"({n}); got shape {list(x.shape)}"
            )
        return None
    dim = norm_dim(opname, f"dst={dst}", dst.dim, x.dim())
    length = x.shape[dim]
    if sizes is not None:
        if sum(sizes) != length:
            raise ValueError(f"{opname}: sizes={list(sizes)} add up to {sum(sizes)}, but dim {dim} has size {length}")
    elif length % n:
        raise ValueError(
            f"{opname}: dst={dst} splits tensor dim {dim} (size {length}) into {n} equal shards on axis "
            f"{label}; {length} is not divisible by {n}. Pass sizes= (one per rank) for uneven shards."
        )
    return dim


def same_type(opname: str, x: torch.Tensor, axis: Any, t: AxisType, options: tuple) -> torch.Tensor:
    """``src == dst``: ``x`` itself once ``src`` is checked against its type (cast if ``op_dtype`` / ``out_dtype``)."""
    from .call import Begun, check_input, resolve_comm
    from .dtypes import for_call as plan_for

    if is_dtensor(x):
        return x
    comm = resolve_comm(opname, axis)
    begun = Begun(opname, t, t, comm, check_input(opname, x, comm, t, t))
    plan = plan_for(begun, opname.split(".")[-1], x, *options, reduces_back=False, keeps_input=False)
    if plan is None:
        return x
    x = x if plan.op is None else x.to(plan.op)
    return x if plan.out is None else x.to(plan.out)


register_call("reinterpret", reinterpret)
register_call("convert", convert)
