"""Every row of the forward/backward table, on simulated ranks (LocalTensorMode over a fake PG).

For each row of ``_transitions.TRANSITIONS`` and each layout (V stacked, or
S(d)), on world sizes 2 and 4 and on each axis of a 2x2 mesh:
(a) the forward keeps (or, for reinterpret, re-reads) the denotation,
(b) the backward passes the adjoint identity <A x, g> = <x, A^T g>,
(c) forward and backward communication counts are exactly the expected ones,
(d) double backward runs the forward op again.
A new table row gets all of these automatically (and fails until it has an
expected count below).
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types._comm import collectives as coll
from spmd_types._comm import reinterpret_convert as local
from spmd_types._local.transitions import TRANSITIONS, Transition
from spmd_types.testing import CommCounter, denote, pair, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
AR, AG, RS, A2A = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"

# (op, src, dst) -> (forward comms, backward comms). Written by hand from seed 003, not read from the table.
EXPECTED_COMMS = {
    ("reinterpret", R, I): ({}, {}),
    ("reinterpret", R, V): ({}, {}),
    ("reinterpret", R, P): ({}, {}),
    ("reinterpret", I, R): ({}, {AR: 1}),
    ("reinterpret", I, V): ({}, {AR: 1}),
    ("reinterpret", V, P): ({}, {}),
    ("convert", R, I): ({}, {}),
    ("convert", I, R): ({}, {AR: 1}),
    ("convert", R, V): ({}, {}),
    ("convert", I, V): ({}, {AG: 1}),
    ("convert", R, P): ({}, {}),
    ("convert", I, P): ({}, {}),
    ("convert", V, P): ({}, {}),
    ("all_reduce", P, R): ({AR: 1}, {AR: 1}),
    ("all_reduce", P, I): ({AR: 1}, {}),
    ("all_gather", V, R): ({AG: 1}, {RS: 1}),
    ("all_gather", V, I): ({AG: 1}, {}),
    ("reduce_scatter", P, V): ({RS: 1}, {AG: 1}),
    ("all_to_all", V, V): ({A2A: 1}, {A2A: 1}),
}

# (mesh shape, names, axis the op runs on)
MESHES = {
    "world2": ((2,), ("tp",), "tp"),
    "world4": ((4,), ("tp",), "tp"),
    "2x2-tp": ((2, 2), ("dp", "tp"), "tp"),
    "2x2-dp": ((2, 2), ("dp", "tp"), "dp"),
}


def _cases() -> list:
    out = []
    for row in TRANSITIONS:
        layouts = ["stack", "shard"] if (row.src is V or row.dst is V) else ["-"]
        for layout in layouts:
            out.append(pytest.param(row, layout, id=f"{row.op}-{row.src}-{row.dst}-{layout}"))
    return out


CASES = _cases()



def _types(row: Transition, layout: str) -> tuple:
    src, dst = row.src, row.dst
    if layout == "shard":
        if row.op == "all_to_all":
            return S(0), S(1)
        src = S(1) if src is V else src
        dst = S(1) if dst is V else dst
    return src, dst


def _apply(row: Transition, layout: str, x: torch.Tensor, axis: str) -> torch.Tensor:
    src, dst = _types(row, layout)
    fn = getattr(local, row.op, None) or getattr(coll, row.op)
    if row.op == "all_to_all" and layout == "stack":
        return fn(x, axis, src=V, dst=V, split_dim=0, concat_dim=1)  # the published meaning: unbind 0, stack on 1
    return fn(x, axis, src=src, dst=dst)


@pytest.fixture(scope="module")
def world(request):
    shape, names, axis = MESHES[request.param]  # 2x2-tp runs only double backward, to keep the time down
    mesh = fake_mesh(shape, names)
    return mesh, axis


def _full(mesh, axis: str, t) -> dict:
    """The whole type: ``t`` on ``axis``, V on any other axis (so per-slice independence is tested)."""
    return {a: (t if a == axis else V) for a in mesh.mesh_dim_names}


def _setup(world, row, layout, seed=0):
    mesh, axis = world
    n = mesh.size(list(mesh.mesh_dim_names).index(axis))
    src, dst = _types(row, layout)
    x = random_value(mesh, _full(mesh, axis, src), (n, 2 * n), seed)
    return mesh, axis, src, dst, x


def test_every_row_has_expected_counts():
    assert {(t.op, t.src, t.dst) for t in TRANSITIONS} == set(EXPECTED_COMMS)


@pytest.mark.parametrize("world", ["world2", "world4", "2x2-dp"], indirect=True)
@pytest.mark.parametrize("row,layout", CASES)
def test_row(world, row, layout):
    """Forward meaning, typed result, adjoint identity and exact comm counts of one table row."""
    mesh = world[0]
    with LocalTensorMode(mesh.size()), spmd.set_current_mesh(mesh):
        mesh, axis, src, dst, x = _setup(world, row, layout)
        x.requires_grad_()
        with CommCounter() as comms:
            y = _apply(row, layout, x, axis)
        fwd = comms.counts
        _check_forward(mesh, axis, row, layout, x, y, src, dst)
        g = random_value(mesh, _full(mesh, axis, spmd.backward_type(dst)), tuple(y.shape), seed=1)
        with CommCounter() as comms:
            (gx,) = torch.autograd.grad(y, x, g)
        assert (fwd, comms.counts) == EXPECTED_COMMS[(row.op, row.src, row.dst)]
        lhs = pair(y, g, mesh, _full(mesh, axis, dst))
        rhs = pair(x, gx, mesh, _full(mesh, axis, src))
        torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)
        if mesh.size() == 2:
            return  # the typed run is checked on world 4 and the 2x2 mesh's dp axis (time budget)
        with spmd.typecheck():
            typed = _apply(row, layout, spmd.assert_type(x.detach(), _full(mesh, axis, src)), axis)
            assert spmd.get_type(typed) == _full(mesh, axis, dst)
        for r, v in rank_values(y).items():
            assert torch.equal(rank_values(typed)[r], v)


def _check_forward(mesh, axis, row, layout, x, y, src, dst) -> None:
    if row.op == "reinterpret":
        for r, v in rank_values(x).items():
            assert torch.equal(rank_values(y)[r], v), "reinterpret changed local data"
        return
    want = denote(x, mesh, _full(mesh, axis, src), first=axis)
    got = denote(y, mesh, _full(mesh, axis, dst), first=axis)
    if row.op == "all_to_all" and layout == "stack":
        per_slice = want.unbind(0) if mesh.ndim == 2 else [want]  # the other axis (V) is stacked outside
        want = torch.stack([_all_to_all_spec(w, split_dim=0, concat_dim=1) for w in per_slice])
        want = want if mesh.ndim == 2 else want[0]
    torch.testing.assert_close(got, want)


def _all_to_all_spec(stacked: torch.Tensor, split_dim: int, concat_dim: int) -> torch.Tensor:
    """V -> V all_to_all on denotations: rank j gets entry j of split_dim of every rank's value, stacked on
    concat_dim in rank order."""
    n = stacked.shape[0]
    return torch.stack([torch.stack([v.select(split_dim, j) for v in stacked.unbind(0)], concat_dim)
                        for j in range(n)])


@pytest.mark.parametrize("world", ["world2", "2x2-tp"], indirect=True)
@pytest.mark.parametrize("row,layout", CASES)
def test_double_backward_is_the_forward(world, row, layout):
    mesh = world[0]
    with LocalTensorMode(mesh.size()), spmd.set_current_mesh(mesh):
        mesh, axis, src, dst, x = _setup(world, row, layout)
        x.requires_grad_()
        y = _apply(row, layout, x, axis)
        g = random_value(mesh, _full(mesh, axis, spmd.backward_type(dst)), tuple(y.shape), seed=1)
        g.requires_grad_()
        (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
        h = random_value(mesh, _full(mesh, axis, src), tuple(x.shape), seed=2)
        with CommCounter() as comms:
            (gg,) = torch.autograd.grad(gx, g, h)
        assert comms.counts == EXPECTED_COMMS[(row.op, row.src, row.dst)][0]
        direct = _apply(row, layout, h, axis)
        for r, v in rank_values(direct).items():
            torch.testing.assert_close(rank_values(gg)[r], v)
