"""Support for tests/test_global_equivalence.py: run a global SPMD program on simulated ranks
(LocalTensorMode) and compare it with the same computation on one device.

A program is two functions over the same named inputs:

* ``spmd_fn(**typed)``: the parallel version, run inside ``spmd.typecheck(local=False)``
  on typed per-rank tensors; it returns its outputs (a tensor or a tuple) and,
  for backward, ends in a scalar that is I (or P) on every axis.
* ``ref_fn(**full)``: the single-device version on the full tensors.

Inputs are described by :class:`Inp` (the full value, its SPMD types, optionally a
partition spec); :func:`run_equivalence` shards them by their spec, runs both
versions, reassembles every output by its own partition spec and types (per-rank
values from ``_local_tensors``, each rank's mesh coordinate places its shard, P
is the sum over ranks, R/I copies must all agree), and does the same for the
gradient of every input that asks for one (the gradient's types are the
inputs' types through ``backward_type``; its layout is the input's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types._core.spec import normalize, spec_from_shards

Spec = tuple[tuple[str, ...], ...]

DTYPE = torch.float64
ATOL = 1e-9
RTOL = 1e-7


@dataclass
class Inp:
    """One program input: its full value and how it is typed (and so sharded) on the mesh."""

    full: torch.Tensor
    types: Mapping[str, Any]
    partition_spec: Any = None
    grad: bool = True


@dataclass
class Result:
    outputs: list[torch.Tensor] = field(default_factory=list)  # reassembled
    ref_outputs: list[torch.Tensor] = field(default_factory=list)
    out_types: list[dict] = field(default_factory=list)
    out_specs: list[Any] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # reassembled
    ref_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_types: dict[str, dict] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# mesh geometry


def mesh_geometry(mesh) -> tuple[tuple[str, ...], dict[str, int], dict[int, dict[str, int]]]:
    """(axis names, {axis: size}, {rank: {axis: coordinate}}) of a DeviceMesh."""
    names = tuple(mesh.mesh_dim_names)
    grid = mesh.mesh
    sizes = dict(zip(names, grid.shape))
    coords = {}
    for idx in itertools.product(*(range(n) for n in grid.shape)):
        coords[int(grid[idx])] = dict(zip(names, idx))
    return names, sizes, coords


def _block(coord: Mapping[str, int], spec: Spec, sizes: Mapping[str, int], local_shape) -> tuple[slice, ...]:
    """The slice of the full tensor a rank's shard covers (axes within a dim: major to minor)."""
    out = []
    for d, entry in enumerate(spec):
        index = 0
        for axis in entry:
            index = index * sizes[axis] + coord[axis]
        n = local_shape[d]
        out.append(slice(index * n, (index + 1) * n))
    return tuple(out)


def full_spec(types: Mapping[str, Any], partition_spec: Any, ndim: int, names) -> Spec:
    spec = spec_from_shards(types, ndim, names)
    if partition_spec is not None:
        user = normalize(partition_spec, ndim)
        spec = tuple(b or a for a, b in zip(spec, user))
    return spec


def shard(full: torch.Tensor, spec: Spec, mesh, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` under ``spec`` (unsharded axes: a replicated copy)."""
    _, sizes, coords = mesh_geometry(mesh)
    local_shape = [n // max(1, _factor(e, sizes)) for n, e in zip(full.shape, spec)]
    for n, e in zip(full.shape, spec):
        assert n % _factor(e, sizes) == 0, (tuple(full.shape), spec)
    return full[_block(coords[rank], spec, sizes, local_shape)].clone()


def _factor(entry, sizes) -> int:
    f = 1
    for a in entry:
        f *= sizes[a]
    return f


def reassemble(locals_: Mapping[int, torch.Tensor], types: Mapping[str, Any], spec: Spec | None, mesh) -> torch.Tensor:
    """The global value of a typed tensor from its per-rank values.

    V (S) axes place shards by ``spec``; P axes sum over ranks; R and I axes
    must hold the same value on every rank (checked), and rank coordinate 0
    stands for them.
    """
    names, sizes, coords = mesh_geometry(mesh)
    any_local = next(iter(locals_.values()))
    spec = spec if spec is not None else tuple(() for _ in range(any_local.dim()))
    placed = {a for e in spec for a in e}
    copies = []
    for axis in names:
        t = types[axis]
        if t.is_varying:
            assert axis in placed, f"axis {axis} is {t} but the spec {spec} does not place it"
        else:
            assert axis not in placed, f"axis {axis} is {t} but the spec {spec} places it"
            if t is not spmd.P:
                copies.append(axis)
    # R / I: every copy equals the coordinate-0 copy
    rank_of = {tuple(sorted(c.items())): r for r, c in coords.items()}
    for r, c in coords.items():
        rep = dict(c)
        for a in copies:
            rep[a] = 0
        r0 = rank_of[tuple(sorted(rep.items()))]
        torch.testing.assert_close(
            locals_[r], locals_[r0], atol=ATOL, rtol=RTOL,
            msg=lambda m, r=r, r0=r0: f"rank {r} and rank {r0} disagree on an R/I axis {copies}: {m}",
        )
    shape = [n * _factor(e, sizes) for n, e in zip(any_local.shape, spec)]
    full = torch.zeros(shape, dtype=any_local.dtype)
    covered = torch.zeros(shape, dtype=torch.int64)
    for r, c in coords.items():
        if any(c[a] != 0 for a in copies):
            continue
        blk = _block(c, spec, sizes, any_local.shape)
        full[blk] += locals_[r]
        covered[blk] += 1
    n_partial = 1
    for axis in names:
        if types[axis] is spmd.P:
            n_partial *= sizes[axis]
    assert bool((covered == n_partial).all()), "the shards do not tile the full tensor"
    return full


def local_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    return {r: v.detach().clone() for r, v in t._local_tensors.items()}


def types_of(t: torch.Tensor) -> dict:
    return spmd.get_type(t)


def spec_of(t: torch.Tensor) -> Spec:
    return t._spmd_spec


# ---------------------------------------------------------------------------
# the harness


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def run_equivalence(
    mesh,
    inputs: Mapping[str, Inp],
    spmd_fn: Callable[..., Any],
    ref_fn: Callable[..., Any],
    *,
    backward: bool = True,
    backward_inside: bool = True,
) -> Result:
    """Run both versions and return reassembled outputs/grads next to the reference ones.

    The last output is the loss when ``backward``: the SPMD loss must be a
    scalar (its backward runs inside or outside typecheck per ``backward_inside``).
    """
    names, sizes, coords = mesh_geometry(mesh)
    world = len(coords)
    res = Result()

    # single device
    full = {}
    for k, inp in inputs.items():
        v = inp.full.detach().clone()
        if inp.grad and v.is_floating_point():
            v.requires_grad_()
        full[k] = v
    ref_out = _as_tuple(ref_fn(**full))
    if backward:
        ref_out[-1].backward()
    res.ref_outputs = [o.detach() for o in ref_out]
    res.ref_grads = {k: v.grad for k, v in full.items() if v.requires_grad} if backward else {}

    # parallel, global SPMD
    specs = {k: full_spec(inp.types, inp.partition_spec, inp.full.dim(), names) for k, inp in inputs.items()}
    with LocalTensorMode(world) as lm:
        leaves = {}
        for k, inp in inputs.items():
            lt = lm.rank_map(lambda r, k=k, inp=inp: shard(inp.full.detach(), specs[k], mesh, r))
            if inp.grad and inp.full.is_floating_point():
                lt.requires_grad_()
            leaves[k] = lt
        with spmd.set_current_mesh(mesh), spmd.typecheck(local=False):
            typed = {}
            for k, inp in inputs.items():
                t = spmd.assert_type(leaves[k], dict(inp.types), partition_spec=inp.partition_spec)
                assert spec_of(t) == specs[k], (k, spec_of(t), specs[k])
                typed[k] = t
            outs = _as_tuple(spmd_fn(**typed))
            res.out_types = [types_of(o) for o in outs]
            res.out_specs = [spmd.get_partition_spec(o) for o in outs]
            out_locals = [(local_values(o), types_of(o), spec_of(o)) for o in outs]
            if backward and backward_inside:
                outs[-1].backward()
        if backward and not backward_inside:
            outs[-1].backward()
        with spmd.set_current_mesh(mesh):
            grad_types = {}
            for k, t in typed.items():
                if not (backward and t.requires_grad):
                    continue
                assert t.grad is not None, f"no gradient reached {k}"
                gt = {a: spmd.backward_type(ty) for a, ty in types_of(t).items()}
                have = types_of(t.grad)
                assert have == gt, f"{k}.grad is typed {have}, expected {gt}"
                grad_types[k] = gt
                res.grads[k] = reassemble(local_values(t.grad), gt, specs[k], mesh)
            res.grad_types = grad_types
    res.outputs = [reassemble(v, ty, sp, mesh) for v, ty, sp in out_locals]
    return res


def check(res: Result) -> None:
    """Every reassembled output and gradient equals the single-device one."""
    assert len(res.outputs) == len(res.ref_outputs)
    for i, (got, want) in enumerate(zip(res.outputs, res.ref_outputs)):
        torch.testing.assert_close(got, want.to(got.dtype), atol=ATOL, rtol=RTOL,
                                   msg=lambda m, i=i: f"output {i}: {m}")
    assert set(res.grads) == set(res.ref_grads), (set(res.grads), set(res.ref_grads))
    for k in res.grads:
        torch.testing.assert_close(res.grads[k], res.ref_grads[k], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, k=k: f"grad of {k}: {m}")
