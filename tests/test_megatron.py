"""Megatron-LM's ``tensor_parallel/mappings.py``, function by function, against the spmd call docs/megatron.md names.

Each Megatron autograd Function is re-implemented here as its code reads
(forward and backward kernels as written, collectives through
``torch.distributed._functional_collectives`` + ``wait_tensor`` instead of the
in-place ``torch.distributed`` calls, the rank index from the mesh because
``dist.get_rank`` answers for one fake rank only under ``LocalTensorMode``).
On 4 simulated ranks (mesh tp=4), each row runs Megatron's function and our
call on the same per-rank input and the same per-rank upstream gradient and
checks: equal forward values, equal input gradients, and the same
communication counts forward and backward (which are also written down by
hand, per row, from Megatron's code).

Megatron version read: NVIDIA/Megatron-LM ``megatron/core/tensor_parallel/mappings.py``
at a11077467a90bb721e123e5e90069455b85fa4c7 (with the MoE helpers), and the later
``group=``-argument layout of the same file (see docs/megatron.md).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import CommCounter, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
N = 4
AR, AG, RS, A2A = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"


class _Group(NamedTuple):
    """What Megatron's kernels ask of a process group: its collectives' group, its size, this rank's index."""

    pg: Any
    size: int
    rank: Any  # a per-rank SymInt under LocalTensorMode


_GROUP: list[_Group] = []  # the group of the running case (Megatron reads it from parallel_state)


def _group() -> _Group:
    return _GROUP[-1]


# ---------------------------------------------------------------------------
# Megatron's kernels (mappings.py, private helpers), on functional collectives.


def _reduce(x):
    # Megatron: torch.distributed.all_reduce(input_.contiguous(), group) in place.
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", _group().pg))


def _split_along_last_dim(x):
    # Megatron: split_tensor_along_last_dim(input_, world_size)[rank].contiguous(); narrow takes the same slice
    # and accepts the per-rank index.
    g = _group()
    k = x.shape[-1] // g.size
    return x.narrow(-1, g.rank * k, k).contiguous()


def _split_along_first_dim(x):
    g = _group()
    k = x.shape[0] // g.size
    return x.narrow(0, g.rank * k, k).contiguous()


def _gather_along_first_dim(x):
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, _group().pg))


def _gather_along_last_dim(x):
    # Megatron gathers on dim 0, then moves the rank blocks to the last dim.
    out = _gather_along_first_dim(x)
    return torch.cat(out.chunk(_group().size, dim=0), dim=-1).contiguous()


def _reduce_scatter_along_first_dim(x):
    return funcol.wait_tensor(funcol.reduce_scatter_single(x.contiguous(), "sum", 0, _group().pg))


def _reduce_scatter_along_last_dim(x):
    # As Megatron: flatten to 2-D, stack the last-dim blocks on dim 0, reduce-scatter dim 0, reshape back.
    n = _group().size
    target = list(x.shape)
    target[-1] //= n
    x = x.reshape(-1, x.shape[-1])
    concat = torch.cat(torch.split(x, x.shape[-1] // n, dim=1), dim=0)
    return _reduce_scatter_along_first_dim(concat).reshape(target)


def _all_to_all_kernel(x):
    # Megatron: all_to_all_single with equal splits on dim 0.
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, _group().pg))


def _function(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """A Megatron autograd Function: ``forward`` and ``backward`` kernels as its code calls them."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return forward(x)

        @staticmethod
        def backward(ctx, g):
            return backward(g)

    _Fn.__name__ = _Fn.__qualname__ = name
    return _Fn


_Copy = _function("_CopyToModelParallelRegion", lambda x: x.view_as(x), _reduce)
_Reduce = _function("_ReduceFromModelParallelRegion", _reduce, lambda g: g)
_Scatter = _function("_ScatterToModelParallelRegion", _split_along_last_dim, _gather_along_last_dim)
_Gather = _function("_GatherFromModelParallelRegion", _gather_along_last_dim, _split_along_last_dim)
_ScatterSP = _function("_ScatterToSequenceParallelRegion", _split_along_first_dim, _gather_along_first_dim)
_GatherSP_tp = _function(  # tensor_parallel_output_grad=True
    "_GatherFromSequenceParallelRegion", _gather_along_first_dim, _reduce_scatter_along_first_dim
)
_GatherSP_dup = _function(  # tensor_parallel_output_grad=False
    "_GatherFromSequenceParallelRegion", _gather_along_first_dim, _split_along_first_dim
)
_ReduceScatterSP = _function(
    "_ReduceScatterToSequenceParallelRegion", _reduce_scatter_along_first_dim, _gather_along_first_dim
)
_AllGatherLast = _function("_AllGatherFromTensorParallelRegion", _gather_along_last_dim, _reduce_scatter_along_last_dim)
_ReduceScatterLast = _function(
    "_ReduceScatterToTensorParallelRegion", _reduce_scatter_along_last_dim, _gather_along_last_dim
)
# Megatron's _AllToAll.backward is _AllToAll.apply on the gradient (the split sizes swapped; equal here).
_AllToAll = _function("_AllToAll", _all_to_all_kernel, lambda g: _AllToAll.apply(g))


def _sp2hp(x):
    """Megatron's all_to_all_sp2hp: [tokens/TP, H] -> [tokens, H/TP]."""
    n = _group().size
    x = x.reshape(-1, x.shape[-1])
    concat = torch.cat(torch.split(x, x.shape[-1] // n, dim=1), dim=0)
    return _AllToAll.apply(concat)


def _hp2sp(x):
    """Megatron's all_to_all_hp2sp: [tokens, H/TP] -> [tokens/TP, H]."""
    n = _group().size
    x = x.reshape(-1, x.shape[-1])
    exchanged = _AllToAll.apply(x).reshape(-1, x.shape[-1])
    return torch.cat(torch.split(exchanged, exchanged.shape[0] // n, dim=0), dim=-1)


# ---------------------------------------------------------------------------
# The rows: Megatron's public function -> our call, with the types and the comm counts Megatron's code does.


class Row(NamedTuple):
    name: str
    megatron: Callable
    ours: Callable  # (x, axis) -> y
    src: Any
    dst: Any
    shape: tuple[int, ...]
    fwd: dict
    bwd: dict
    axis: Any = "tp"


SEQ = (8, 2, 4)  # [s, b, h]: first and last dims differ, so a split on the wrong dim shows
ROWS = [
    Row("copy_to_tensor_model_parallel_region", _Copy.apply,
        lambda x, a: spmd.reinterpret(x, a, src=I, dst=R), I, R, SEQ, {}, {AR: 1}),
    Row("reduce_from_tensor_model_parallel_region", _Reduce.apply,
        lambda x, a: spmd.all_reduce(x, a, src=P, dst=I), P, I, SEQ, {AR: 1}, {}),
    Row("scatter_to_tensor_model_parallel_region", _Scatter.apply,
        lambda x, a: spmd.convert(x, a, src=I, dst=S(-1)), I, S(-1), SEQ, {}, {AG: 1}),
    Row("gather_from_tensor_model_parallel_region", _Gather.apply,
        lambda x, a: spmd.all_gather(x, a, src=S(-1), dst=I), S(-1), I, SEQ, {AG: 1}, {}),
    Row("scatter_to_sequence_parallel_region", _ScatterSP.apply,
        lambda x, a: spmd.convert(x, a, src=I, dst=S(0)), I, S(0), SEQ, {}, {AG: 1}),
    Row("gather_from_sequence_parallel_region[tensor_parallel_output_grad=True]", _GatherSP_tp.apply,
        lambda x, a: spmd.all_gather(x, a, src=S(0), dst=R), S(0), R, SEQ, {AG: 1}, {RS: 1}),
    Row("gather_from_sequence_parallel_region[tensor_parallel_output_grad=False]", _GatherSP_dup.apply,
        lambda x, a: spmd.all_gather(x, a, src=S(0), dst=I), S(0), I, SEQ, {AG: 1}, {}),
    Row("reduce_scatter_to_sequence_parallel_region", _ReduceScatterSP.apply,
        lambda x, a: spmd.reduce_scatter(x, a, src=P, dst=S(0)), P, S(0), SEQ, {RS: 1}, {AG: 1}),
    Row("all_gather_last_dim_from_tensor_parallel_region", _AllGatherLast.apply,
        lambda x, a: spmd.all_gather(x, a, src=S(-1), dst=R), S(-1), R, SEQ, {AG: 1}, {RS: 1}),
    Row("reduce_scatter_last_dim_to_tensor_parallel_region", _ReduceScatterLast.apply,
        lambda x, a: spmd.reduce_scatter(x, a, src=P, dst=S(-1)), P, S(-1), SEQ, {RS: 1}, {AG: 1}),
    Row("all_to_all", _AllToAll.apply,
        lambda x, a: spmd.all_to_all(x, a, src=V, dst=V, split_dim=0, concat_dim=0), V, V, (8, 4), {A2A: 1}, {A2A: 1}),
    Row("all_to_all_sp2hp", _sp2hp,
        lambda x, a: spmd.all_to_all(x, a, src=S(0), dst=S(1)), S(0), S(1), (8, 4), {A2A: 1}, {A2A: 1}),
    Row("all_to_all_hp2sp", _hp2sp,
        lambda x, a: spmd.all_to_all(x, a, src=S(1), dst=S(0)), S(1), S(0), (8, 4), {A2A: 1}, {A2A: 1}),
    # The older file's MoE helpers run on the tensor-and-expert group: here a (ep=2, tp=2) mesh, our axis the
    # flattened ("ep", "tp") pair, Megatron's group the whole world (that group when data parallel is 1).
    Row("gather_from_sequence_parallel_region_to_moe", _GatherSP_tp.apply,
        lambda x, a: spmd.all_gather(x, a, src=S(0), dst=R), S(0), R, SEQ, {AG: 1}, {RS: 1}, ("ep", "tp")),
    Row("reduce_scatter_to_sequence_parallel_region_from_moe", _ReduceScatterSP.apply,
        lambda x, a: spmd.reduce_scatter(x, a, src=P, dst=S(0)), P, S(0), SEQ, {RS: 1}, {AG: 1}, ("ep", "tp")),
]


def _types(mesh, axis, t) -> dict:
    names = axis if isinstance(axis, tuple) else (axis,)
    return {a: t for a in names} | {a: V for a in mesh.mesh_dim_names if a not in names}


def _run(fn, x, g):
    """``fn(x)`` and the gradient of ``x`` for upstream gradient ``g``, with the comm counts of each."""
    x = x.detach().requires_grad_()
    with CommCounter() as fwd:
        y = fn(x)
    with CommCounter() as bwd:
        (gx,) = torch.autograd.grad(y, x, g)
    return y, gx, fwd.counts, bwd.counts


def _mesh_of(row: Row):
    return fake_mesh((N,), ("tp",)) if row.axis == "tp" else fake_mesh((2, 2), ("ep", "tp"))


def _group_of(row: Row, mesh):
    """Megatron's view of the group (inside LocalTensorMode the rank index is a per-rank value)."""
    if row.axis == "tp":
        return _Group(mesh.get_group("tp"), N, mesh.get_local_rank("tp"))
    import torch.distributed as dist

    return _Group(dist.group.WORLD, N, None)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    va, vb = rank_values(a), rank_values(b)
    for r in sorted(va):
        torch.testing.assert_close(va[r], vb[r], msg=lambda m, r=r: f"{what}, rank {r}: {m}")


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_megatron_function_matches_one_spmd_call(row):
    mesh = _mesh_of(row)  # made once, outside the mode (torch 2.14 makes a new fake world inside it)
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        _GROUP.append(_group_of(row, mesh))  # the rank index is a per-rank value only inside the mode
        try:
            x = random_value(mesh, _types(mesh, row.axis, row.src), row.shape)
            with torch.no_grad():
                out_shape = tuple(row.ours(x, row.axis).shape)
            g = random_value(mesh, _types(mesh, row.axis, spmd.backward_type(row.dst)), out_shape, seed=1)
            y_m, gx_m, fwd_m, bwd_m = _run(row.megatron, x, g)
            y_o, gx_o, fwd_o, bwd_o = _run(lambda t: row.ours(t, row.axis), x, g)
        finally:
            _GROUP.pop()
        _assert_same(y_o, y_m, "forward")
        _assert_same(gx_o, gx_m, "input gradient")
        assert (fwd_m, bwd_m) == (row.fwd, row.bwd), "Megatron's counts differ from the ones written from its code"
        assert (fwd_o, bwd_o) == (fwd_m, bwd_m)
        # The typed call accepts Megatron's input type and gives the output type the doc names.
        with spmd.typecheck():
            typed = row.ours(spmd.assert_type(x, _types(mesh, row.axis, row.src)), row.axis)
            dst = row.dst if getattr(row.dst, "dim", None) is None else S(row.dst.dim % typed.dim())  # S(-1): last
            assert spmd.get_type(typed) == _types(mesh, row.axis, dst)


def test_every_row_is_in_the_doc():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "megatron.md").read_text()
    for row in ROWS:
        assert f"`{row.name.split('[')[0]}" in doc, row.name
