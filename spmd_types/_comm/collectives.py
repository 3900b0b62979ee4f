"""Typed collectives: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``redistribute``.

One section per collective, holding its typing, its forward and its
backward; the backward is a call to the op's dual as ``_transitions`` names
it, so ``all_gather(dst=R)`` backward is a reduce-scatter and
``all_gather(dst=I)`` backward is a local slice. The denotations (CONTRACT
section 1): R and I are the one value every rank holds, V the per-rank values
stacked on a new dim 0, S(d) the shards concatenated on dim d, P their sum.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
from torch.autograd.function import once_differentiable

from .._checker.tensor import _DisableTF
from .._core.dtensor_hook import interop, is_dtensor
from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.mesh import current_mesh
from .._core.state import STATE
from .._core.traced import register_call, routed, traced_call
from .._core.types import I, P, R, S, SpmdType, V, base_type, check_type_value
from .._local.transitions import ROUTE
from . import impl as impl
from .async_op import takes_async_op
from .call import (
    Begun,
    Call,
    _global_spec,
    begin,
    check_input,
    check_local_size,
    check_sizes,
    finish,
    norm_dim,
    resolve_comm,
    shards_in_range,
    type_result,
    unwrap,
)
from .dtypes import DtypePlan, for_call
from .erased import erased, remember_erased
from .kernels import keeps_shards
from .redistribute_spec import redistribute_spec
from .reinterpret_convert import convert
from .stacking import check_one_per_rank, stacked_input, uneven_splits, varying_dim

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "redistribute"]


def _check_split(
    opname: str, x: torch.Tensor, dim: int, n: int, sizes: Any, label: str, what: str, uneven_ok: bool = True
) -> None:
    length = x.shape[dim]
    if sizes is not None:
        if sum(sizes) != length:
            raise ValueError(f"{opname}: sizes={list(sizes)} add up to {sum(sizes)}, but dim {dim} has size {length}")
        return
    if length % n:
        raise ValueError(
            f"{opname}: {what} splits tensor dim {dim} (size {length}) into {n} equal shards on axis {label}; "
            f"{length} is not divisible by {n}."
            + (" Pass sizes= (one per rank) for uneven shards." if uneven_ok else "")
        )


# ---------------------------------------------------------------------------
# all_reduce: P -> R (backward all_reduce), P -> I (backward reinterpret(I, R): no comm);
# op="max"|"min": V -> R, V -> I (not linear, so not in seed 003's table: EXTREME_ROWS below)


@takes_async_op
def all_reduce(
    x: torch.Tensor, axis: Any, *, src: SpmdType | None = None, dst: SpmdType = R, op: str = "sum",
    inplace: bool = False, op_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
    backward_options: dict | None = None,
) -> torch.Tensor:
    """Sum (``op="avg"``: average) the pending sum over ``axis``; or take the max / min over ranks.

    ``dst=R``: backward all-reduces the (pending) gradient. ``dst=I``: the
    gradient is already summed, backward does nothing. ``src`` defaults to P
    (V for ``op="max"|"min"``); ``src=V`` means ``reinterpret(V, P)`` first.
    ``axis=("dp", "tp")`` reduces over both in one collective on the flattened
    group::

        +A
        +B  =>  A + B + C
        +C

    ``op="max"`` / ``"min"`` takes a V (or S(d)) value to the elementwise
    extreme over ranks, R or I (``EXTREME_ROWS``); its gradient goes to the
    ranks holding the extreme, split evenly among ties as ``torch.amax`` does.

    ``op_dtype=`` sums in that dtype (the input is cast first), ``out_dtype=``
    casts the result; ``backward_options=`` are the backward's own options, and
    ``dst=R`` in reduced precision needs ``backward_options={"op_dtype": ...}``.
    ``inplace=True`` writes the result into ``x`` (which then has type ``dst``)
    and returns it; autograd cannot follow that, so ``x`` must not need a gradient.

    Example::

        out = spmd.all_reduce(partial_out, "tp", src=spmd.P, dst=spmd.R)
        row_max = spmd.all_reduce(local_max, "tp", src=spmd.V, dst=spmd.R, op="max")
        grad = spmd.all_reduce(g, "dp", src=spmd.P, dst=spmd.I, op_dtype=torch.float32)  # sum bf16 grads in fp32
    """
    fast_args = None if inplace or op in EXTREME_OPS else ("all_reduce", axis, src, dst, op)
    hit = None if fast_args is None else erased(x, fast_args, op_dtype, out_dtype, backward_options)
    if hit is not None:
        return hit
    if routed():  # torch.compile traces: one graph node (see _core/traced.py)
        return traced_call("all_reduce", x, axis, src=src, dst=dst, op=op, inplace=inplace, op_dtype=op_dtype,
                           out_dtype=out_dtype, backward_options=backward_options)
    if inplace:
        _check_inplace(x)  # before any communication
        return _into(x, all_reduce(x, axis, src=src, dst=dst, op=op, op_dtype=op_dtype, out_dtype=out_dtype,
                                   backward_options=backward_options))
    if is_dtensor(x):
        src = (V if op in EXTREME_OPS else P) if src is None else src
        return interop().typed_op(all_reduce, x, axis, src=src, dst=dst, op=op, op_dtype=op_dtype,
                                  out_dtype=out_dtype, backward_options=backward_options)
    if op in EXTREME_OPS:
        return _all_reduce_extreme(x, axis, V if src is None else src, dst, op, (op_dtype, out_dtype, backward_options))
    if op not in ("sum", "avg"):
        raise ValueError(f"spmd.all_reduce: op must be 'sum', 'avg', 'max' or 'min', got {op!r}")
    begun = begin("all_reduce", x, axis, P if src is None else src, dst, op)
    dtypes = for_call(begun, "all_reduce", x, op_dtype, out_dtype, backward_options)
    call = Call("all_reduce", begun.src, begun.dst, begun.comm, reduce=op, dtypes=dtypes)
    out = finish(begun, call, x)
    remember_erased(x, fast_args, op_dtype, out_dtype, backward_options, call)
    return out


def _sizes_or_split_sizes(opname: str, sizes: Any, split_sizes: Any) -> Any:
    """``split_sizes=`` is the published API's name for ``sizes=``."""
    if split_sizes is None:
        return sizes
    if sizes is not None:
        raise TypeError(f"{opname}: give sizes= or split_sizes= (the same thing), not both")
    return split_sizes


def _check_inplace(x: torch.Tensor) -> None:
    """An in-place collective result cannot reach autograd: refuse it, before any communication."""
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "spmd.all_reduce(inplace=True) writes the result into x, which autograd cannot follow for a tensor "
            "that requires grad; use the returned value of spmd.all_reduce(x, ...) instead"
        )


def _into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ``out`` into ``x`` (dispatch off) and give ``x`` the result's type; returns ``x``."""
    with torch.no_grad(), _DisableTF():
        x.copy_(out)
    types = getattr(out, "_spmd_types", None)
    if types is not None and getattr(x, "_spmd_types", None) is not None:
        x._spmd_types = types  # type: ignore[attr-defined]
        if getattr(out, "_spmd_spec", None) is not None:
            x._spmd_spec = out._spmd_spec  # type: ignore[attr-defined]
    return x


class ExtremeRow(NamedTuple):
    src: SpmdType
    dst: SpmdType
    backward_comm: str  # what the backward moves
    meaning: str


# all_reduce(op="max"|"min") as data. V stands for V or S(d). A P input is rejected: its value is
# the sum over ranks, and the max of the summands is not a function of that sum.
EXTREME_OPS = ("max", "min")
EXTREME_ROWS: tuple[ExtremeRow, ...] = (
    ExtremeRow(V, R, "all_reduce", "the extreme on every rank; the pending gradient and the tie count are summed "
               "in one all-reduce, then go to the ranks holding the extreme"),
    ExtremeRow(V, I, "all_reduce", "the extreme on every rank; the gradient is already summed, only the tie "
               "count is all-reduced"),
)


def _all_reduce_extreme(x: torch.Tensor, axis: Any, src: Any, dst: Any, op: str, options: tuple) -> torch.Tensor:
    opname = "spmd.all_reduce"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{opname} takes a tensor, got {type(x).__name__}")
    src = check_type_value(src, f"{opname}: src")
    dst = check_type_value(dst, f"{opname}: dst")
    src, dst = shards_in_range(opname, x, src, dst)
    comm = resolve_comm(opname, axis)
    if not any(row.src is base_type(src) and row.dst is dst for row in EXTREME_ROWS):
        _reject_extreme(opname, comm, src, dst, op)
    if x.is_complex():
        raise TypeError(f"{opname}: op={op!r} needs an ordered dtype, got {x.dtype}")
    types = check_input(opname, x, comm, src, dst)
    begun = Begun(opname, src, dst, comm, types)
    if STATE.global_mode and types is not None:
        _check_extreme_global(begun, x, op)  # before any communication
    call = Call("all_reduce", src, dst, comm, reduce=op, dtypes=_extreme_dtypes(begun, x, op, options))
    plain = unwrap(x)
    if plain.requires_grad and torch.is_grad_enabled():
        out = _AllReduceExtreme.apply(plain, call)
    else:
        out = _cast(_extreme_forward(plain, call)[1], call.dtypes and call.dtypes.out)
    return type_result(begun, x, out)


def _extreme_dtypes(begun: Begun, x: torch.Tensor, op: str, options: tuple) -> DtypePlan | None:
    """The dtype plan of ``all_reduce(op="max"|"min")``: its backward sums the gradient when ``dst=R``.

    The extreme is taken at the input's precision unless ``op_dtype`` says
    otherwise (a narrower one would make ties the input does not have).
    """
    plan = for_call(begun, "all_reduce", x, *options, reduces_back=begun.dst is R, keeps_input=True)
    if plan is not None and "backward_options" in plan.backward:
        raise ValueError(
            f"{begun.opname}(op={op!r}): backward_options cannot hold 'backward_options': its backward is not "
            "differentiable (a double backward through it is an error), so there is no call for them."
        )
    return plan


def _extreme_forward(x: torch.Tensor, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` in the op's dtype, the extreme over ranks in it)."""
    if call.dtypes is not None and call.dtypes.op is not None:
        x = x.to(call.dtypes.op)
    return x, impl.all_reduce(x, call.comm, call.reduce)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _reject_extreme(opname: str, comm: Any, src: SpmdType, dst: SpmdType, op: str) -> None:
    if base_type(src) is P:
        why = (f"{opname}(op={op!r}) cannot take src=P: a pending sum's value is the sum over ranks, and the "
               f"{op} of the summands is not a function of that sum.")
        fixes = [f"spmd.all_reduce(x, {comm.label}, src=spmd.P, dst={dst.code()}) to finish the sum first",
                 "type x V where it is made, if each rank's own value is meant"]
    else:
        why = f"{opname}(op={op!r}) cannot take src={src} to dst={dst}: it takes a V (or S(d)) value to R or I."
        fixes = []
    shown = ", ".join(f"{row.src} -> {row.dst}" for row in EXTREME_ROWS)
    call = f"{opname}(x, {comm.label}, src={src.code()}, dst={dst.code()}, op={op!r})"
    raise SpmdTypeError(Rejection(why, [("op", call), ("allowed", shown)], fixes), user_source_line())


def _check_extreme_global(begun: Begun, x: torch.Tensor, op: str) -> None:
    mesh = current_mesh()
    global_axes = mesh.global_axes(STATE.local_axes) if mesh is not None else frozenset()
    names = [n for n in begun.comm.names if n in global_axes]
    if names and begun.src is V:
        def text(src: SpmdType) -> str:
            return f"{begun.opname}(x, {begun.comm.label}, src={src.code()}, dst={begun.dst.code()}, op={op!r})"

        raise SpmdTypeError(
            Rejection(
                f"{begun.opname}(op={op!r}) with src=V has no global meaning: say which dim with S(d), or run it "
                "in local SPMD (spmd.local_map).",
                [("op", text(V)), ("global axes", ", ".join(names))],
                [text(S(0))],
            ),
            user_source_line(),
        )
    with _DisableTF():
        ndim = x.dim()
    _global_spec(begun, x, ndim)  # the layout's own rejections


class _AllReduceExtreme(torch.autograd.Function):
    """Forward: all-reduce max/min. Backward: the gradient to the ranks holding the extreme, ties split evenly."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: Call) -> torch.Tensor:
        x, out = _extreme_forward(x, call)
        ctx.call = call
        ctx.save_for_backward(x, out)
        return _cast(out, call.dtypes and call.dtypes.out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, out = ctx.saved_tensors
        call = ctx.call
        plan, out_dtype = call.dtypes, None
        if plan is not None:  # the backward's options: sum in their op_dtype, hand back in x's dtype
            g = _cast(g, plan.backward.get("op_dtype"))
            out_dtype = plan.backward.get("out_dtype", plan.src_dtype)
        hit = (x == out).to(g.dtype)
        if call.dst is R:  # the gradient of R is a pending sum: finish it together with the tie count
            both = impl.all_reduce(torch.stack([g, hit]), call.comm, "sum")
            g, count = both[0], both[1]
        else:  # I: the gradient is already the sum
            count = impl.all_reduce(hit, call.comm, "sum")
        return _cast(hit * g / count, out_dtype), None


# ---------------------------------------------------------------------------
# all_gather: V -> R (backward reduce_scatter), V -> I (backward convert(I, V): a local slice)


@takes_async_op
def all_gather(
    x: torch.Tensor, axis: Any, *, src: SpmdType = V, dst: SpmdType = R, gather_dim: int | None = None,
    sizes: Sequence[int] | None = None, op_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
    backward_options: dict | None = None, split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Gather every rank's ``x``: stacked on a new dim 0 (``src=V``) or concatenated on d (``src=S(d)``).

    ``gather_dim=`` stacks a ``src=V`` input on a new dim there instead (the published meaning).
    ``sizes=`` (one per rank) gathers uneven shards. ``dst=R`` backward is a
    reduce-scatter; ``dst=I`` backward is a local slice (no communication)::

        [A]
        [B]  =>  [A, B, C]
        [C]

    ``op_dtype=`` gathers in that dtype; ``backward_options`` are the backward's
    (FSDP: gather bf16, reduce-scatter the gradient in fp32).

    Example::

        full_w = spmd.all_gather(w_shard, "dp", src=spmd.S(0), dst=spmd.R)
        full_w = spmd.all_gather(w_shard, "dp", src=spmd.S(0), dst=spmd.R, op_dtype=torch.bfloat16,
                                 backward_options={"op_dtype": torch.float32})
    """
    stacks = src is V and gather_dim is not None  # V stacks on a new dim gather_dim (stacking.py)
    fast_args = None if sizes is not None or split_sizes is not None or stacks else ("all_gather", axis, src, dst,
                                                                                      gather_dim)
    hit = None if fast_args is None else erased(x, fast_args, op_dtype, out_dtype, backward_options)
    if hit is not None:
        return hit
    if routed():
        return traced_call("all_gather", x, axis, src=src, dst=dst, gather_dim=gather_dim, sizes=sizes,
                           op_dtype=op_dtype, out_dtype=out_dtype, backward_options=backward_options,
                           split_sizes=split_sizes)
    sizes = _sizes_or_split_sizes("spmd.all_gather", sizes, split_sizes)
    if is_dtensor(x):
        return interop().typed_op(all_gather, x, axis, src=src, dst=dst, gather_dim=gather_dim, sizes=sizes,
                                  op_dtype=op_dtype, out_dtype=out_dtype, backward_options=backward_options)
    begun = begin("all_gather", x, axis, src, dst)
    comm = begun.comm
    sizes = check_sizes(begun.opname, sizes, comm)
    if sizes is not None and begun.src is V:
        raise ValueError(f"{begun.opname}: sizes= needs a concat dim, src=S(d); V inputs stack")
    if stacks:
        x, dim = stacked_input(begun.opname, x, gather_dim)  # type: ignore[arg-type]
    else:
        dim = varying_dim(begun.opname, "src", begun.src, gather_dim, "gather_dim", x.dim())
    if sizes is not None:
        check_local_size(begun.opname, x, dim, sizes, comm)  # type: ignore[arg-type]
    dtypes = for_call(begun, "all_gather", x, op_dtype, out_dtype, backward_options)
    call = Call("all_gather", begun.src, begun.dst, comm, dim=dim, sizes=sizes, dtypes=dtypes)
    out = finish(begun, call, x)
    remember_erased(x, fast_args, op_dtype, out_dtype, backward_options, call)
    return out


# ---------------------------------------------------------------------------
# reduce_scatter: P -> V (backward all_gather(V, R))


@takes_async_op
def reduce_scatter(
    x: torch.Tensor, axis: Any, *, src: SpmdType = P, dst: SpmdType = V, scatter_dim: int | None = None,
    op: str = "sum", sizes: Sequence[int] | None = None, op_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None, backward_options: dict | None = None, split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Sum (or average) the pending sum and keep this rank's part of it.

    ``dst=V`` keeps index ``rank`` of dim 0 (dim 0 has one entry per rank), or of dim ``scatter_dim``;
    ``dst=S(d)`` keeps this rank's shard of dim d (``sizes=`` for uneven
    shards). ``src=V`` means ``reinterpret(V, P)`` first. Backward is an
    all-gather::

        +[A0, A1, A2]       [A0 + B0 + C0]
        +[B0, B1, B2]  =>   [A1 + B1 + C1]
        +[C0, C1, C2]       [A2 + B2 + C2]

    ``op_dtype=`` sums in that dtype, ``out_dtype=`` casts the result;
    ``backward_options`` are the backward all-gather's.

    Example::

        grad_shard = spmd.reduce_scatter(grad, "dp", src=spmd.P, dst=spmd.S(0))
    """
    unstacks = dst is V and scatter_dim is not None  # V takes this rank's entry of dim scatter_dim (stacking.py)
    fast_args = (None if sizes is not None or split_sizes is not None or unstacks
                 else ("reduce_scatter", axis, src, dst, scatter_dim, op))
    hit = None if fast_args is None else erased(x, fast_args, op_dtype, out_dtype, backward_options)
    if hit is not None:
        return hit
    if routed():
        return traced_call("reduce_scatter", x, axis, src=src, dst=dst, scatter_dim=scatter_dim, op=op, sizes=sizes,
                           op_dtype=op_dtype, out_dtype=out_dtype, backward_options=backward_options,
                           split_sizes=split_sizes)
    sizes = _sizes_or_split_sizes("spmd.reduce_scatter", sizes, split_sizes)
    if is_dtensor(x):
        return interop().typed_op(reduce_scatter, x, axis, src=src, dst=dst, scatter_dim=scatter_dim, op=op, sizes=sizes,
                                  op_dtype=op_dtype, out_dtype=out_dtype, backward_options=backward_options)
    begun = begin("reduce_scatter", x, axis, src, dst, op)
    comm, opname = begun.comm, begun.opname
    sizes = check_sizes(opname, sizes, comm)
    if unstacks and sizes is None:
        d = check_one_per_rank(opname, x, "scatter_dim", scatter_dim, comm.size, comm.label)  # type: ignore[arg-type]
        dtypes = for_call(begun, "reduce_scatter", x, op_dtype, out_dtype, backward_options)
        call = Call("reduce_scatter", begun.src, begun.dst, comm, dim=d, reduce=op, dtypes=dtypes)
        return finish(begun, call, x).squeeze(d)
    dim = varying_dim(opname, "dst", begun.dst, scatter_dim, "scatter_dim", x.dim())
    if dim is None:
        if sizes is not None:
            raise ValueError(f"{opname}: sizes= needs a scatter dim (dst=S(d) or scatter_dim=); dst=V indexes dim 0")
        if x.dim() == 0 or x.shape[0] != comm.size:
            raise ValueError(
                f"{opname}: dst=V keeps index `rank` of dim 0, so dim 0 must have one entry per rank of axis "
                f"{comm.label} ({comm.size}); got shape {list(x.shape)}"
            )
    else:
        _check_split(opname, x, dim, comm.size, sizes, comm.label, f"dst={begun.dst}")
    dtypes = for_call(begun, "reduce_scatter", x, op_dtype, out_dtype, backward_options)
    call = Call("reduce_scatter", begun.src, begun.dst, comm, dim=dim, sizes=sizes, reduce=op, dtypes=dtypes)
    out = finish(begun, call, x)
    remember_erased(x, fast_args, op_dtype, out_dtype, backward_options, call)
    return out


# ---------------------------------------------------------------------------
# all_to_all: V -> V, S(i) -> S(j) (backward all_to_all S(j) -> S(i))


@takes_async_op
def all_to_all(
    x: torch.Tensor, axis: Any, *, src: SpmdType = V, dst: SpmdType = V, split_dim: int | None = None,
    concat_dim: int | None = None, output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None, op_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None, backward_options: dict | None = None,
) -> torch.Tensor:
    """Split ``x`` on ``split_dim`` into one piece per rank, send piece j to rank j, concatenate on ``concat_dim``.

    ``src=S(i), dst=S(j)`` keeps the meaning: shards of dim i become shards of
    dim j (``concat_dim=i``, ``split_dim=j``). With one V side, as the published
    API reads it, ``src=S(i)`` splits dim i and ``dst=S(j)`` joins on dim j (the
    other dim 0 unless given). With plain V the dims default to 0; on two
    different dims, V -> V unbinds ``split_dim`` (one entry per rank) and stacks
    what arrives on ``concat_dim``. ``input_split_sizes`` / ``output_split_sizes`` (V or S(0), dim 0;
    a side not given is even) send
    ``input_split_sizes[j]`` rows to rank j and receive ``output_split_sizes[j]``
    from it (MoE token routing); the backward swaps them.
    ``op_dtype`` / ``out_dtype`` cast before / after the exchange;
    ``backward_options`` are the backward all-to-all's. Backward is the all-to-all back::

        [A0, A1]        [A0, B0]
        [B0, B1]   =>   [A1, B1]

    Example::

        heads = spmd.all_to_all(seq_shard, "cp", src=spmd.S(0), dst=spmd.S(1))
        routed = spmd.all_to_all(tokens, ep_group, src=spmd.V, dst=spmd.V,
                                 input_split_sizes=send_counts, output_split_sizes=recv_counts)
    """
    # V -> V on two dims: unbind split_dim, stack on concat_dim (stacking.py)
    restacks = (src is V and dst is V and (split_dim or 0) != (concat_dim or 0) and input_split_sizes is None
                and output_split_sizes is None)
    fast_args = (None if input_split_sizes is not None or output_split_sizes is not None or restacks
                 else ("all_to_all", axis, src, dst, split_dim, concat_dim))
    hit = None if fast_args is None else erased(x, fast_args, op_dtype, out_dtype, backward_options)
    if hit is not None:
        return hit
    if routed():
        return traced_call("all_to_all", x, axis, src=src, dst=dst, split_dim=split_dim, concat_dim=concat_dim,
                           output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                           op_dtype=op_dtype, out_dtype=out_dtype, backward_options=backward_options)
    if is_dtensor(x):
        return interop().typed_op(all_to_all, x, axis, src=src, dst=dst, split_dim=split_dim, concat_dim=concat_dim,
                                  op_dtype=op_dtype, out_dtype=out_dtype, backward_options=backward_options)
    begun = begin("all_to_all", x, axis, src, dst)
    comm, opname, ndim = begun.comm, begun.opname, x.dim()
    if restacks:
        s = check_one_per_rank(opname, x, "split_dim", split_dim or 0, comm.size, comm.label)
        c = norm_dim(opname, f"concat_dim={concat_dim}", concat_dim or 0, ndim)
        call = Call("all_to_all", V, V, comm, split_dim=s, concat_dim=s,
                    dtypes=for_call(begun, "all_to_all", x, op_dtype, out_dtype, backward_options))
        return finish(begun, call, x).movedim(s, c)
    if (begun.src is V) != (begun.dst is V):  # one S(d) side: it names the dim split (src) or joined (dst)
        split = varying_dim(opname, "src", begun.src, split_dim, "split_dim", ndim)
        concat = varying_dim(opname, "dst", begun.dst, concat_dim, "concat_dim", ndim)
    else:  # S(i) -> S(j): shards of dim i become shards of dim j (concat i, split j)
        concat = varying_dim(opname, "src", begun.src, concat_dim, "concat_dim", ndim)
        split = varying_dim(opname, "dst", begun.dst, split_dim, "split_dim", ndim)
    concat, split = 0 if concat is None else concat, 0 if split is None else split  # a V side: dim 0 by default
    splits = uneven_splits(begun, x, input_split_sizes, output_split_sizes, split, concat)
    if splits is None and not keeps_shards(begun.src, begun.dst):
        _check_split(opname, x, split, comm.size, None, comm.label, f"split_dim={split}", uneven_ok=False)
    dtypes = for_call(begun, "all_to_all", x, op_dtype, out_dtype, backward_options)
    call = Call("all_to_all", begun.src, begun.dst, comm, split_dim=split, concat_dim=concat, dtypes=dtypes,
                in_splits=splits[0] if splits else None, out_splits=splits[1] if splits else None)
    out = finish(begun, call, x)
    remember_erased(x, fast_args, op_dtype, out_dtype, backward_options, call)
    return out


# ---------------------------------------------------------------------------
# redistribute: keep the meaning, communicate as needed (routes via _transitions.ROUTE)


@takes_async_op
def redistribute(
    x: torch.Tensor, axis: Any, dst_spec: Any = None, *, src: SpmdType | None = None, dst: SpmdType | None = None,
    sizes: Sequence[int] | None = None, src_partial: Sequence[str] = (), dst_partial: Sequence[str] = (),
    op_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None, backward_options: dict | None = None,
) -> torch.Tensor:
    """Change ``x``'s type keeping its meaning: on one axis, or from one partition spec to another.

    Per axis, ``redistribute(x, axis, src=, dst=)`` runs the op
    ``_transitions.ROUTE`` names for the pair: a convert (R/I -> V, P; V -> P),
    an all-gather (V -> R, I), an all-reduce (P -> R, I), a reduce-scatter
    (P -> V) or an all-to-all (S(i) -> S(j)). Its backward is that op's
    backward. ``src == dst`` returns ``x`` unchanged (cast, if ``op_dtype`` or
    ``out_dtype`` says so). ``op_dtype``, ``out_dtype`` and ``backward_options``
    go to the routed op (torchtitan passes ``backward_options={"op_dtype": x.dtype}``).

    With partition specs, ``redistribute(x, src_spec, dst_spec)`` plans the
    collectives (``spmd.plan_redistribute`` shows the plan), fusing several
    axes into one collective where the mesh allows, and runs them.

    Example::

        y = spmd.redistribute(x, "tp", src=spmd.S(0), dst=spmd.R)   # an all_gather
        z = spmd.redistribute(x, spmd.PartitionSpec(("dp", "tp")), spmd.PartitionSpec(("tp", "dp")))
    """
    if routed():  # torch.compile traces: one graph node (see _core/traced.py)
        return traced_call("redistribute", x, axis, dst_spec, src=src, dst=dst, sizes=sizes, src_partial=src_partial,
                           dst_partial=dst_partial, op_dtype=op_dtype, out_dtype=out_dtype,
                           backward_options=backward_options)
    dtype_options = {"op_dtype": op_dtype, "out_dtype": out_dtype, "backward_options": backward_options}
    if is_dtensor(x):
        return interop().typed_op(redistribute, x, axis, src=src, dst=dst, sizes=sizes, **dtype_options)
    if dst_spec is not None:
        _no_dtype_options_with_specs(dtype_options)
        return redistribute_spec(x, axis, dst_spec, src_partial=src_partial, dst_partial=dst_partial)
    if src is None or dst is None:
        raise TypeError("spmd.redistribute takes (x, axis, src=, dst=) or (x, src_spec, dst_spec)")
    src = check_type_value(src, "spmd.redistribute: src")
    dst = check_type_value(dst, "spmd.redistribute: dst")
    src, dst = shards_in_range("spmd.redistribute", x, src, dst)
    if src is dst:  # nothing to do, but src= must still be the tensor's type
        comm = resolve_comm("spmd.redistribute", axis)
        types = check_input("spmd.redistribute", x, comm, src, dst)
        return _same_type(Begun("spmd.redistribute", src, dst, comm, types), x, dtype_options)
    op = ROUTE.get((base_type(src), base_type(dst)))
    if op == "all_to_all" and (src is V or dst is V):
        raise ValueError(
            f"spmd.redistribute: {src} -> {dst} does not say which dims to split and concatenate; use "
            "src=S(i), dst=S(j), or spmd.all_to_all(..., split_dim=, concat_dim=)"
        )
    kwargs: dict[str, Any] = {"src": src, "dst": dst, **dtype_options}
    if sizes is not None:
        kwargs["sizes"] = sizes
    return _ROUTED[op](x, axis, **kwargs)


def _same_type(begun: Begun, x: torch.Tensor, dtype_options: dict) -> torch.Tensor:
    """``redistribute(src=X, dst=X)``: ``x`` itself, or ``x`` rounded through ``op_dtype`` and cast to ``out_dtype``.

    No op runs, so no backward reduces: the dtypes are checked, and the casts
    are ordinary (differentiable, typed) ``Tensor.to`` calls.
    """
    plan: DtypePlan | None = for_call(begun, "redistribute", x, **dtype_options, reduces_back=False, keeps_input=False)
    if plan is None:
        return x
    if plan.op is not None:
        x = x.to(plan.op)
    return x if plan.out is None else x.to(plan.out)


def _no_dtype_options_with_specs(dtype_options: dict) -> None:
    given = [k for k, v in dtype_options.items() if v is not None]
    if given:
        raise TypeError(
            f"spmd.redistribute(x, src_spec, dst_spec) takes no {'=, '.join(given)}=: it plans several collectives, "
            "and the options belong to one. Redistribute one axis at a time, spmd.redistribute(x, axis, src=, dst=, "
            f"{given[0]}=...), or cast x before and after."
        )


_ROUTED = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
           "all_to_all": all_to_all, "convert": convert}


for _op in (all_reduce, all_gather, reduce_scatter, all_to_all, redistribute):
    register_call(_op.__name__, _op)
