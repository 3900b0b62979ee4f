"""Alignment by type, for ``check_equivalence``: cut pieces from whole tensors, put per-rank values back together.

A type says how the per-rank pieces of a value make one tensor (CONTRACT section 1): R and I, any
rank's copy (and every copy must agree); P, their sum; S(d), their concatenation on dim d; V, their
concatenation on the dim its partition spec names, or the dim ``output_dims`` names, or the one dim
the shapes allow. Several axes on one dim nest in mesh order: the first axis is the outer one, as
in ``DeviceMesh`` rank order. Parameters and the batch are cut the same way in reverse.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .._core.dtensor_hook import is_dtensor
from .._core.types import I, P, R, SpmdType, V
from .._torch.private import DisableTorchFunctionSubclass, dtensor_local, local_tensors_of
from ._eq_dtensor import dtensor_types
from ._eq_record import Snapshot, types_on
from ._simulate import _coords, _outside_simulation, per_rank

__all__ = ["MeshInfo", "Assembled", "Sources", "load_parameters", "local_batch", "assemble", "assemble_per_rank",
           "tolerance", "update_tolerances", "match", "match_key", "RTOL64", "ATOL64", "SAFETY"]

# float64: a fixed tolerance relative to the reference's largest entry. Reordered float64 sums differ by
# about 1e-16 of the scale per thousand terms, so 1e-9 stays six orders above round-off and far below a bug.
RTOL64, ATOL64 = 1e-9, 1e-12
# Below float64: the tolerance is SAFETY times the reference's own round-off (its run in the dtype against
# its run in float64), and never below SAFETY * eps * scale. Two runs that each carry round-off r differ
# by up to about 2r; 16 leaves room for the parallel run's different summation order (see docs/equivalence.md).
SAFETY = 16.0


@dataclass(frozen=True)
class MeshInfo:
    """The mesh a run used: axis names, sizes, and every rank's coordinates."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    coords: dict[int, tuple[int, ...]]
    device_mesh: Any = field(default=None, compare=False)  # the run's DeviceMesh (types are read on it)

    @classmethod
    def of(cls, mesh: Any) -> MeshInfo:
        layout = mesh.mesh
        coords = {int(layout[c]): c for c in _coords(layout.shape)}
        return cls(tuple(mesh.mesh_dim_names), tuple(layout.shape), coords, mesh)

    def coord_dict(self, rank: int) -> dict[str, int]:
        return dict(zip(self.names, self.coords[rank]))


def match_key(globs: Mapping[str, Any] | None, name: str) -> str | None:
    """The first glob in ``globs`` that matches ``name`` (None if none does)."""
    for pattern in globs or {}:
        if fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def match(globs: Mapping[str, Any] | None, name: str) -> Any:
    """The value of the first glob in ``globs`` that matches ``name`` (None if none does)."""
    found = match_key(globs, name)
    return None if found is None else globs[found]  # type: ignore[index]


def shard_dim(t: SpmdType) -> int | None:
    """``d`` for S(d), None for every other type."""
    return getattr(t, "dim", None)


# ---------------------------------------------------------------------------
# cutting whole tensors into per-rank pieces (parameters, the batch)


def _cut(full: torch.Tensor, types: Mapping[str, SpmdType], mesh: MeshInfo, rank: int, label: str,
         unknown: Callable[[str, SpmdType], str], whole_v: bool = False) -> torch.Tensor:
    """This rank's piece of ``full``: outer mesh axes cut first, so that pieces nest as they reassemble.

    ``whole_v``: an axis where the type is V (no dim) keeps the whole (a renamed parameter: the name
    already says which piece this rank holds, such as which expert).
    """
    x = full
    for axis, n, c in zip(mesh.names, mesh.sizes, mesh.coords[rank]):
        t = types.get(axis, I)
        if t is R or t is I or (whole_v and t is V):
            continue
        d = shard_dim(t)
        if d is None:
            raise ValueError(unknown(axis, t))
        if x.dim() == 0 or x.shape[d] % n:
            raise ValueError(f"check_equivalence: {label} is S({d}) on '{axis}', but its shape {list(x.shape)} "
                             f"does not split into {n} equal chunks on dim {d}")
        size = x.shape[d] // n
        x = x.narrow(d, c * size, size)
    return x


def _param_types(p: torch.Tensor, mesh: Any) -> dict[str, SpmdType] | None:
    if is_dtensor(p):  # the axes a DTensor's mesh does not span hold whole copies
        return dtensor_types(p, mesh)[0]
    return types_on(p, mesh)


def _store(p: torch.Tensor, name: str, parallel: bool) -> dict[int, torch.Tensor]:
    base = dtensor_local(p) if is_dtensor(p) else p
    store = local_tensors_of(base)
    if store is not None:
        return store
    if parallel:
        raise ValueError(
            f"check_equivalence: parameter '{name}' is one plain tensor, not one per simulated rank: build() must "
            "create every parameter (a module made outside build(), or cached between calls, is not simulated)"
        )
    with DisableTorchFunctionSubclass():
        return {0: base.data}


@dataclass(frozen=True)
class Sources:
    """Where each parallel parameter's pieces come from: ``layouts`` and ``reference_names`` (globs -> functions)."""

    layouts: Mapping[str, Callable[..., torch.Tensor]] | None = None
    names: Mapping[str, Callable[[str, dict[str, int]], str]] | None = None

    def with_layouts(self, extra: Mapping[str, Callable[..., torch.Tensor]]) -> Sources:
        """These sources with ``extra`` layouts after the given ones (a given glob that matches still wins)."""
        if not extra:
            return self
        return Sources({**(self.layouts or {}), **{k: v for k, v in extra.items() if k not in (self.layouts or {})}},
                       self.names)

    def per_rank(self, name: str) -> bool:
        """True when ``name`` has a layout or a reference name: its values are compared rank by rank."""
        return match_key(self.layouts, name) is not None or match_key(self.names, name) is not None

    def label(self, name: str) -> str:
        """``layouts['glob']`` or ``reference_names['glob']``: what says where ``name``'s pieces come from."""
        glob = match_key(self.layouts, name)
        return f"layouts[{glob!r}]" if glob is not None else f"reference_names[{match_key(self.names, name)!r}]"

    def reference_name(self, name: str, coords: dict[str, int]) -> str:
        """The reference's name for parameter ``name`` on the rank at ``coords``."""
        rename = match(self.names, name)
        return name if rename is None else rename(name, coords)

    def piece(self, name: str, types: Mapping[str, SpmdType] | None, mesh: MeshInfo, rank: int,
              values: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's piece of the reference value, the whole value it was cut from), from ``values`` by name."""
        coords = mesh.coord_dict(rank)
        source = self.reference_name(name, coords)
        if source not in values:
            known = ", ".join(sorted(values)[:8])
            raise ValueError(f"check_equivalence: reference_names gives '{source}' for parameter '{name}' on rank "
                             f"{rank}, but the reference model has no such parameter (its parameters: {known}, ...)")
        full, layout = values[source], match(self.layouts, name)
        if layout is not None:
            return layout(full.clone(), coords), full
        if types is None:
            raise ValueError(
                f"check_equivalence loads each parallel parameter from the reference by its type, but parameter "
                f"'{name}' is untyped: type it in build() (spmd.assert_type(param, types), or "
                f"spmd_megatron.type_parameters(model)), or give its layout: layouts={{'{name}': "
                "fn(full, coords) -> local}")

        def unknown(axis: str, t: SpmdType) -> str:
            return (f"check_equivalence loads a parameter by its type when the type says which piece each rank "
                    f"holds (S(d): a chunk of dim d; R and I: the whole), but parameter '{name}' is {t} on "
                    f"'{axis}': give its layout: layouts={{'{name}': fn(full, coords) -> local}}, or, when each "
                    f"rank holds other whole parameters (experts), their names: reference_names={{'{name}': "
                    "fn(name, coords) -> reference name}")

        renamed = match(self.names, name) is not None
        return _cut(full, types, mesh, rank, f"parameter '{name}'", unknown, whole_v=renamed), full


def load_parameters(params: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor], mesh: MeshInfo,
                    sources: Sources | None, *, parallel: bool) -> None:
    """Write every rank's piece of each reference value in ``initial`` into the model's parameters, by type."""
    sources = sources or Sources()
    for name, p in params.items():
        if name not in initial and match(sources.names, name) is None:
            known = ", ".join(sorted(initial)[:8])
            raise ValueError(f"check_equivalence: the parallel model's parameter '{name}' is not in the reference "
                             f"model built on the one-device mesh (its parameters: {known}, ...); if it is another "
                             f"one's piece there (an expert), name it: reference_names={{'{name}': fn(name, coords) "
                             "-> reference name}")
        store = _store(p, name, parallel)
        layout = match(sources.layouts, name)
        types = None if (layout is not None or not parallel) else _param_types(p, mesh.device_mesh)
        for rank in mesh.coords:
            if parallel:
                piece, full = sources.piece(name, types, mesh, rank, initial)
            else:  # every axis has one rank: the whole value, whatever the type
                piece = full = initial[name]
            local = store[rank]
            if tuple(piece.shape) != tuple(local.shape):
                how = "its layout gives" if layout is not None else f"cut by its type {_fmt_types(types)} gives"
                fix = "" if layout is not None else (
                    " (a size that depends on the mesh, such as a vocabulary padded to a multiple of tp, differs), or "
                    f"give its layout: layouts={{'{name}': fn(full, coords) -> local}} (e.g. pad full, then cut this "
                    "rank's piece)")
                raise ValueError(
                    f"check_equivalence: parameter '{name}': {how} {list(piece.shape)} on rank {rank} from the "
                    f"reference's {list(full.shape)}, but the parallel parameter is {list(local.shape)}: build() must "
                    f"make the same model on both meshes{fix}"
                )
            with torch.no_grad(), DisableTorchFunctionSubclass(), _outside_simulation():
                local.copy_(piece.to(local.dtype))


def _fmt_types(types: Mapping[str, SpmdType] | None) -> str:
    return "{" + ", ".join(f"{a}: {t}" for a, t in (types or {}).items()) + "}"


def local_batch(batch: Mapping[str, Any], mesh: MeshInfo, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each batch entry cut into its per-rank pieces (S(d): a chunk; R/I: whole), typed as given."""
    import spmd_types as spmd

    out = {}
    for key, entry in batch.items():
        full, types = entry if isinstance(entry, tuple) else (entry, None)
        if full.is_floating_point():
            full = full.to(dtype)

        def unknown(axis: str, t: SpmdType, key: str = key) -> str:
            return (f"check_equivalence: batch entry '{key}' is {t} on '{axis}', which does not say how the global "
                    "batch splits: give S(d) (a chunk of dim d per rank), R or I (the whole on every rank)")

        pieces = {r: _cut(full, types or {}, mesh, r, f"batch entry '{key}'", unknown) for r in mesh.coords}
        local = per_rank(lambda r, pieces=pieces: pieces[r].clone())
        out[key] = spmd.assert_type(local, dict(types)) if types else local
    return out


# ---------------------------------------------------------------------------
# putting per-rank values back together


@dataclass
class Assembled:
    """A reassembled value (None when it could not be) with the ranks that broke an R/I agreement."""

    value: torch.Tensor | None
    ranks: tuple[int, ...] = ()
    spread: float = 0.0
    reason: str | None = None
    shape_error: str | None = None


def _v_dims(snap: Snapshot, mesh: MeshInfo, ref_shape: tuple[int, ...], given: Mapping[str, int] | None
            ) -> dict[str, int] | str:
    """The dim each varying axis concatenates on, or the reason it cannot be told."""
    local = tuple(next(iter(snap.values.values())).shape)
    nd = len(local)
    dims: dict[str, int] = {}
    unknown: list[str] = []
    for axis, n in zip(mesh.names, mesh.sizes):
        if n == 1 or not snap.types[axis].is_varying:  # type: ignore[index]
            continue
        t = snap.types[axis]  # type: ignore[index]
        d = shard_dim(t)
        if d is None:
            d = snap.dims.get(axis, (given or {}).get(axis))
        if d is None:
            unknown.append(axis)
        elif not -nd <= d < nd:
            return f"V on '{axis}' on dim {d}, but the value has {nd} dims (shape {list(local)})"
        else:
            dims[axis] = d % nd
    if not unknown:
        return dims
    sizes = dict(zip(mesh.names, mesh.sizes))
    fits = []
    for choice in itertools.product(range(nd), repeat=len(unknown)):
        trial = {**dims, **dict(zip(unknown, choice))}
        grown = list(local)
        for axis, d in trial.items():
            grown[d] *= sizes[axis]
        if tuple(grown) == tuple(ref_shape):
            fits.append(dict(zip(unknown, choice)))
    axes = " and ".join(f"'{a}'" for a in unknown)
    if len(fits) == 1:
        return {**dims, **fits[0]}
    if not fits:
        first = unknown[0]
        return (f"V on {axes} whose pieces make the reference's shape {list(ref_shape)} on no dim (local "
                f"{list(local)}): a pending sum typed V (local SPMD's row-parallel product) has no layout to "
                "reassemble, and the value after its reduction is compared; to compare it too, type it P "
                f"(spmd.reinterpret(x, {first!r}, src=spmd.V, dst=spmd.P)); pieces interleaved by a flatten of "
                "two split dims have none either")
    options = ", ".join("{" + ", ".join(f"{a}: {d}" for a, d in f.items()) + "}" for f in fits)
    return (f"V on {axes}: the shapes (local {list(local)}, reference {list(ref_shape)}) fit several layouts "
            f"({options}); name the dims with output_dims={{'{snap.module or snap.key}': {{axis: dim}}}}")


def assemble(snap: Snapshot, mesh: MeshInfo, ref_shape: tuple[int, ...], given_dims: Mapping[str, int] | None,
             tol: float) -> Assembled:
    """Reassemble ``snap``'s per-rank values into one tensor, axis by axis, innermost axis first."""
    if snap.why_not is not None:
        return Assembled(None, reason=snap.why_not)
    if set(snap.values) != set(mesh.coords):
        return Assembled(None, reason="one plain tensor, not one per simulated rank (made outside the simulation: make it "
                                      "in build() or step)")
    untyped = [a for a, n in zip(mesh.names, mesh.sizes) if n > 1 and a not in snap.types]  # type: ignore[operator]
    if untyped:
        return Assembled(None, reason=f"not typed on axis '{untyped[0]}' (type it on every mesh axis of more than one "
                                      "rank with spmd.assert_type)")
    shapes = {tuple(v.shape) for v in snap.values.values()}
    if len(shapes) > 1:
        return Assembled(None, reason=f"its ranks hold different shapes ({sorted(shapes)}): ragged pieces (the tokens "
                                      "an expert-parallel exchange gives each rank) have no one-device layout; the "
                                      "module's output after the exchange back is compared")
    dims = _v_dims(snap, mesh, ref_shape, given_dims)
    if isinstance(dims, str):
        return Assembled(None, reason=dims)
    table = {c: (snap.values[r], (r,)) for r, c in mesh.coords.items()}
    bad: set[int] = set()
    spread = 0.0
    for k in reversed(range(len(mesh.names))):
        axis, t = mesh.names[k], snap.types.get(mesh.names[k], I)  # type: ignore[union-attr]
        groups: dict[tuple[int, ...], list[tuple[torch.Tensor, tuple[int, ...]]]] = {}
        for c in sorted(table):
            groups.setdefault(c[:k] + c[k + 1:], []).append(table[c])
        folded = {}
        for key, members in groups.items():
            if t is R or t is I or mesh.sizes[k] == 1:
                first = members[0][0]
                for v, ranks in members[1:]:
                    gap = float((v - first).abs().max()) if v.numel() else 0.0
                    spread = max(spread, gap)
                    if not gap <= tol:
                        bad.update(ranks)
                folded[key] = members[0]
            elif t is P:
                folded[key] = (torch.stack([v for v, _ in members]).sum(0), _ranks(members))
            else:
                folded[key] = (torch.cat([v for v, _ in members], dims[axis]), _ranks(members))
        table = folded
    value = table[()][0]
    if tuple(value.shape) != tuple(ref_shape):
        return Assembled(value, tuple(sorted(bad)), spread,
                         shape_error=f"reassembled shape {list(value.shape)}, reference {list(ref_shape)}")
    return Assembled(value, tuple(sorted(bad)), spread)


def _ranks(members: list[tuple[torch.Tensor, tuple[int, ...]]]) -> tuple[int, ...]:
    return tuple(r for _, ranks in members for r in ranks)


def assemble_per_rank(snap: Snapshot, mesh: MeshInfo, expected: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                      tol: float, label: str) -> tuple[float, tuple[int, ...], str | None]:
    """(largest error, ranks beyond ``tol``, reason) comparing each rank with ``expected(rank)``.

    ``expected(rank)`` is (this rank's piece of the reference value, the whole it was cut from): a
    layout's, or a renamed parameter's. A value that is P on an axis is summed over that axis first
    (every rank of the group is then compared with the sum). ``reason`` says why the value is not
    compared, or, with an infinite error, why the shapes differ (``label`` names the source:
    ``layouts['w']``).
    """
    if snap.why_not is not None and snap.types is None:
        return 0.0, (), snap.why_not
    types = snap.types or {}
    worst, bad = 0.0, []
    for rank, c in mesh.coords.items():
        got = snap.values[rank]
        partial = [k for k, a in enumerate(mesh.names) if types.get(a) is P and mesh.sizes[k] > 1]
        if partial:
            peers = [q for q, cq in mesh.coords.items()
                     if all(cq[k] == c[k] for k in range(len(c)) if k not in partial)]
            got = torch.stack([snap.values[q] for q in peers]).sum(0)
        want, full = expected(rank)
        want = want.to(torch.float64)
        if tuple(got.shape) != tuple(want.shape):
            return math.inf, (rank,), (f"{label} gives {list(want.shape)} on rank {rank} from the reference's "
                                       f"{list(full.shape)}, but the parallel value is {list(got.shape)}")
        err = float((got - want).abs().max()) if got.numel() else 0.0
        worst = max(worst, err)
        if not err <= tol:
            bad.append(rank)
    return worst, tuple(bad), None


# ---------------------------------------------------------------------------
# tolerance


def update_tolerances(ref: torch.Tensor, twin: torch.Tensor | None, dtype: torch.dtype, precision: torch.dtype | None,
                      before: torch.Tensor, twin_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Each element's tolerance for an update (``ref``: the reference's; ``before``: the parameter before the step).

    ``SAFETY * max(|ref - twin|, eps * max|ref|, eps(dtype) * |before|)`` element by element: the
    update's own round-off where the twin measured it (an optimizer that divides by a gradient's
    size amplifies it where a gradient is near zero, and only there), never below the resolution of
    the parameter it was added to. A twin coarser than the run (float32 beside a float64 run whose
    loss is in float32) also rounds its parameters, which the run does not: one ulp of its parameter
    is taken off its gap.
    """
    coarse = precision if precision is not None and torch.finfo(precision).eps > torch.finfo(dtype).eps else dtype
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    floor = torch.full_like(ref, torch.finfo(coarse).eps * scale)
    if twin is not None and twin.shape == ref.shape and coarse != torch.float64:
        gap = (ref - twin).abs()
        if torch.finfo(twin_dtype).eps > torch.finfo(dtype).eps:
            gap = (gap - torch.finfo(twin_dtype).eps * before.abs()).clamp_min(0.0)
        floor = torch.maximum(floor, gap)
    floor = torch.maximum(floor, torch.finfo(dtype).eps * before.abs())
    if coarse == torch.float64:
        return RTOL64 * scale + ATOL64 + SAFETY * floor
    return SAFETY * floor + torch.finfo(coarse).tiny


def tolerance(ref: torch.Tensor, ref64: torch.Tensor | None, dtype: torch.dtype,
              precision: torch.dtype | None = None) -> float:
    """The largest error allowed for a value whose reference is ``ref`` (and float64 reference ``ref64``).

    ``precision`` is the coarsest float dtype the step had computed in by the time the value was
    made (code may compute in float32 inside a float64 model); its round-off sets the floor.
    """
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    coarse = precision if precision is not None and torch.finfo(precision).eps > torch.finfo(dtype).eps else dtype
    if coarse == torch.float64:
        return RTOL64 * scale + ATOL64
    info = torch.finfo(coarse)
    roundoff = 0.0
    if ref64 is not None and ref.numel() and ref.shape == ref64.shape:
        roundoff = float((ref - ref64).abs().max())
    return SAFETY * max(roundoff, info.eps * scale) + info.tiny

