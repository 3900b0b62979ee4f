"""Comparing a parallel run of ``check_equivalence`` with the reference: one row per value, or why it is not compared.

What one run recorded is a :class:`Run`. Module outputs, the loss and gradients are reassembled by type
(``_eq_align``) and held to their tolerance; random draws are checked per rank (``_eq_determinism``);
an optimizer step is compared by its update, the parameter after the step minus before it, so that the
tolerance follows the update's round-off rather than the parameter's (docs/choices.md, choice 46).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .._core.types import I, P
from ._eq_align import SAFETY, MeshInfo, Sources, assemble, assemble_per_rank, match, match_key, tolerance, update_tolerances
from ._eq_determinism import check_draw
from ._eq_record import Snapshot, format_source
from ._eq_report import Comparison, Divergence, EquivalenceReport, NotCompared

__all__ = ["Run", "Asked", "compare"]

# An update's scale is taken over the entries its parameter resolves when there are at least MIN_SCALED of them,
# or half of its nonzero entries where that is fewer (a bias, a norm's weight) (docs/choices.md, choice 46). A median
# moves only when half its entries do: were even one resolved entry in ten moved past its round-off by chance, the
# median of 32 would move with odds of about 1e-8 (of 8, 5e-3), while a handful (SGD's few largest entries above
# float32's resolution) can be carried by one or two. Not a share of a large update: an embedding's rows that no
# token of the batch reaches move by weight decay alone, below float32's resolution, and a scale over the rows the
# batch reaches still shows a step size off by any factor.
MIN_SCALED = 32


@dataclass
class Run:
    """What one run recorded, in execution order (filled as the run goes, so a failed step keeps its start)."""

    initial: dict[str, torch.Tensor] | None = None
    outputs: list[Snapshot] = field(default_factory=list)
    loss: Snapshot | None = None
    grads: list[Snapshot] = field(default_factory=list)
    updates: list[Snapshot] = field(default_factory=list)  # each parameter after the step minus before it
    before: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # every rank's parameters at the start
    changed: bool = False  # some parameter changed during the step (an optimizer step ran)
    mesh: MeshInfo | None = None  # the run's axis names, sizes and rank coordinates
    calls: dict[str, int] = field(default_factory=dict)  # how many times each module's forward ran
    dtype: torch.dtype = torch.float64  # the dtype it ran in

    def snapshots(self) -> list[Snapshot]:
        """Everything recorded, in execution order."""
        return [*self.outputs, *([self.loss] if self.loss else []), *self.grads, *self.updates]

    def by_key(self) -> dict[tuple[str, str], Snapshot]:
        return {(s.kind, s.key): s for s in self.snapshots()}



@dataclass(frozen=True)
class Asked:
    """What the caller gave that the comparison reads: the batch, layouts and reference names, output dims."""

    batch: Mapping[str, Any]
    sources: Sources
    output_dims: Mapping[str, Mapping[str, int]] | None




def compare(ref: Run, ref64: Run | None, par: Run, ask: Asked, dtype: torch.dtype,
            strayed: Mapping[tuple[str, str], str]) -> EquivalenceReport:
    """The report: each parallel value against the reference, in execution order, or why it is not compared.

    ``ref64`` is the reference's float64 run (None in float64), ``strayed`` the values whose float64 run
    strays grossly from the run in ``dtype`` (:func:`~._eq_determinism.gross_gaps`), each with its reason.
    """
    ref_by, ref64_by = ref.by_key(), (ref64.by_key() if ref64 else {})
    info = par.mesh
    assert info is not None
    compared: list[Comparison] = []
    skipped: list[NotCompared] = []
    items = [*par.outputs, *([par.loss] if par.loss else []), *par.grads]
    if ref.changed or par.changed:
        items += par.updates
    data_axes = _data_axes(ask.batch)
    param_types = {u.key: u.types for u in par.updates}  # a gradient is cut as its parameter is
    for snap in items:
        if snap.kind == "random":
            compared.append(_draw_row(snap, info, data_axes))
            continue
        key = (snap.kind, snap.key)
        if snap.kind == "output" and match_key(ask.sources.names, snap.key) is not None:
            skipped.append(NotCompared(snap.key, "output", _RENAMED_OUTPUT))
            continue
        mine = ref_by.get(key)
        if mine is None or not mine.values:
            why = (mine.why_not if mine is not None else None) or _only_in(snap, ref, par, "the parallel run")
            skipped.append(NotCompared(snap.key, snap.kind, why))  # type: ignore[arg-type]
            continue
        if key in strayed:
            skipped.append(NotCompared(snap.key, snap.kind, strayed[key]))  # type: ignore[arg-type]
            continue
        if snap.kind in ("grad", "update") and ask.sources.per_rank(snap.key):
            row = _per_rank_row(snap, param_types.get(snap.key), ref_by, ref64_by, info, ask.sources, dtype)
        else:
            counts = (ref.calls.get(snap.module, 0), par.calls.get(snap.module, 0)) if snap.module else None
            before = ref.before.get(snap.key, {}).get(0) if snap.kind == "update" else None
            twin_dtype = ref64.dtype if ref64 is not None else torch.float64
            row = _compare_one(snap, mine, ref64_by.get(key), info, ask, dtype, counts, before, twin_dtype)
        (skipped if isinstance(row, NotCompared) else compared).append(row)
    seen = {(s.kind, s.key) for s in items} | _renamed_sources(par, ask.sources, info)
    for (kind, key), snap in ref_by.items():
        renamed = kind == "output" and match_key(ask.sources.names, key) is not None
        if (kind, key) not in seen and kind in ("output", "grad") and not renamed:
            skipped.append(NotCompared(key, kind, _only_in(snap, ref, par, "the reference run")))  # type: ignore
    world = " x ".join(f"{a}={n}" for a, n in zip(info.names, info.sizes))
    title = f"check_equivalence: {world} (simulated) against one device, {str(dtype).removeprefix('torch.')}"
    return EquivalenceReport(compared, skipped, title=title)


_RENAMED_OUTPUT = ("the output of a module named by reference_names (an expert): which tokens reach it on each rank "
                   "is the expert-parallel exchange's choice, not one device's; the layer's output after the "
                   "exchange back is compared")


def _data_axes(batch: Mapping[str, Any]) -> frozenset[str]:
    """The axes the batch is split over (S(d) on some entry): their ranks may share a random stream."""
    return frozenset(a for entry in batch.values() if isinstance(entry, tuple)
                     for a, t in entry[1].items() if t.is_varying)


def _draw_row(snap: Snapshot, info: MeshInfo, data_axes: frozenset[str]) -> Comparison:
    """A random draw's row: ok when every rank drew from the stream its type asks for (see _eq_determinism)."""
    ranks, why = check_draw(snap, info, data_axes)
    source = format_source(snap.source)
    row = Divergence if ranks else Comparison
    return row(snap.key, "random", 0.0, 0.0, 0.0, ranks, source, why)  # type: ignore[arg-type]


def _only_in(snap: Snapshot, ref: Run, par: Run, run: str) -> str:
    """Why a value is in one run only: a module that ran more often there, or a name the other model lacks."""
    if snap.module is not None:
        ran = (ref.calls.get(snap.module, 0), par.calls.get(snap.module, 0))
        if ran[0] != ran[1]:
            return (f"{_ran(ran)}: only its first {'call is' if min(ran) == 1 else f'{min(ran)} calls are'} "
                    "compared (a size fixed in step, such as a micro-batch size, changes how often modules run)")
    return f"only in {run} (build() must make the same modules and parameters on both meshes)"


def _ran(counts: tuple[int, int]) -> str:
    return f"the module ran {counts[0]} time{'s' if counts[0] != 1 else ''} on one device, {counts[1]} on each rank"


def _shape_reason(got: list[int], want: list[int], counts: tuple[int, int] | None) -> str:
    text = f"reassembled from the ranks it is {got}, on one device {want}: the two runs made it with different shapes"
    if counts is not None and counts[0] != counts[1]:
        return text + (" (a size fixed in step, such as a micro-batch size, makes the one-device run's pieces "
                       f"differ: {_ran(counts)})")
    return text + " (a size that depends on the mesh, in build() or step, differs between the two models)"


def _compare_one(snap: Snapshot, mine: Snapshot, mine64: Snapshot | None, info: MeshInfo, ask: Asked,
                 dtype: torch.dtype, counts: tuple[int, int] | None = None, before: torch.Tensor | None = None,
                 twin_dtype: torch.dtype = torch.float64) -> Comparison | NotCompared:
    """A value reassembled from its per-rank pieces by its type, against the reference's value of its name.

    An update (``before``: its parameter at the start, on one device) is also compared by its scale
    (:func:`_update_scale`), and held to whichever of the two comparisons it fails most.
    """
    want = mine.values[0]
    want64 = mine64.values[0] if mine64 is not None and mine64.values else None
    tols = None
    if before is not None and want.numel():
        tols = update_tolerances(want, want64, dtype, snap.precision, before, twin_dtype)
        tol = float(tols.max())
    else:
        tol = tolerance(want, want64, dtype, snap.precision)
    given = match(ask.output_dims, snap.module) if snap.module is not None else None
    got = assemble(snap, info, tuple(want.shape), given, tol)
    reason, ranks, err, why_inf = got.reason, got.ranks, math.inf, None  # a shape unlike the reference's: inf
    if got.value is not None and got.shape_error is None:
        err = max(got.spread, float((got.value - want).abs().max()) if want.numel() else 0.0)
        if tols is not None:
            finer = torch.finfo(twin_dtype).eps < torch.finfo(dtype).eps  # a float64 twin: its scale error counts
            scale = _update_scale(got.value, want, want64 if finer else None, tols)
            if scale is None and tol >= 0.5 * float(want.abs().max()):
                reason = _below_resolution(want, tol, snap.precision or dtype)
            elif scale is not None and scale[0] / scale[1] > err / tol:
                err, tol, why_inf = scale[0], scale[1], scale[2]
    elif got.value is not None:
        why_inf = _shape_reason(list(got.value.shape), list(want.shape), counts)
    return _row(snap, err, tol, want, ranks, reason, why_inf, dtype, checked=before is not None)


def _update_scale(got: torch.Tensor, want: torch.Tensor, twin: torch.Tensor | None,
                  tols: torch.Tensor) -> tuple[float, float, str] | None:
    """(|scale - 1|, its tolerance, what it is) of an update against the reference's, or None if unresolved.

    The scale is the median ratio of the update's entries to the reference's, over the entries the
    parameter resolves (each larger than twice its own tolerance; ``MIN_SCALED`` of them, or half
    of the nonzero entries where that is fewer, however many others the update has): a step size
    off by any factor (a learning rate divided by tp) moves it, while a few entries that round-off
    flips (Adam where a gradient is near zero) cannot. Its tolerance: ``SAFETY`` times the larger
    of the twin's own scale error and the median relative round-off of those entries.
    """
    resolved = (want.abs() > 2 * tols) & (want != 0)
    if int(resolved.sum()) < max(1, min(MIN_SCALED, want.ne(0).sum().item() // 2)):
        return None
    ref = want[resolved]
    scale = float((got[resolved] / ref).median())
    typical = float((tols[resolved] / SAFETY / ref.abs()).median())
    if twin is not None and twin.shape == want.shape:
        typical = max(typical, abs(float((twin[resolved] / ref).median()) - 1))
    return (abs(scale - 1), SAFETY * typical,
            f"the update is {scale:.4g} times the reference's (the median ratio of their entries)")


def _per_rank_row(snap: Snapshot, types: Mapping[str, Any] | None, ref_by: Mapping[tuple[str, str], Snapshot],
                  ref64_by: Mapping[tuple[str, str], Snapshot], info: MeshInfo, sources: Sources,
                  dtype: torch.dtype) -> Comparison | NotCompared:
    """A gradient or update with a layout or a reference name: each rank against its own piece of the reference."""
    values = {k: s.values[0] for (kind, k), s in ref_by.items() if kind == snap.kind and s.values}
    values64 = {k: s.values[0] for (kind, k), s in ref64_by.items() if kind == snap.kind and s.values}
    names = {sources.reference_name(snap.key, info.coord_dict(r)) for r in info.coords}
    missing = sorted(n for n in names if n not in values)
    if missing:
        return NotCompared(snap.key, snap.kind, f"its reference '{missing[0]}' has no {snap.kind} in the reference "  # type: ignore[arg-type]
                                                "run")
    tol = max(tolerance(values[n], values64.get(n), dtype, snap.precision) for n in names)
    want = max((values[n] for n in names), key=lambda v: float(v.abs().max()) if v.numel() else 0.0)
    whole = {a: (I if t is P else t) for a, t in (types or snap.types or {}).items()}  # P: its sum is compared

    def expected(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sources.piece(snap.key, whole, info, rank, values)

    err, ranks, reason = assemble_per_rank(snap, info, expected, tol, sources.label(snap.key))
    why_inf = reason if err == math.inf else None
    return _row(snap, err, tol, want, ranks, None if why_inf else reason, why_inf, dtype)


def _row(snap: Snapshot, err: float, tol: float, want: torch.Tensor, ranks: tuple[int, ...], reason: str | None,
         why_inf: str | None, dtype: torch.dtype, checked: bool = False) -> Comparison | NotCompared:
    if reason is None and snap.kind == "update" and not checked and tol >= 0.5 * float(want.abs().max()):
        reason = _below_resolution(want, tol, snap.precision or dtype)
    if reason is not None:
        return NotCompared(snap.key, snap.kind, reason)  # type: ignore[arg-type]
    norm = float(want.norm()) if want.numel() else 0.0
    source = format_source(snap.source)
    kind = Comparison if (not ranks and err <= tol) else Divergence
    return kind(snap.key, snap.kind, err, tol, norm, ranks, source, why_inf)  # type: ignore[arg-type]


def _renamed_sources(par: Run, sources: Sources, info: MeshInfo) -> set[tuple[str, str]]:
    """The reference's (kind, name) of every renamed parallel gradient: compared, though under another name."""
    out = set()
    for snap in par.grads:
        if match_key(sources.names, snap.key) is not None:
            out |= {("grad", sources.reference_name(snap.key, info.coord_dict(r))) for r in info.coords}
    return out


def _below_resolution(update: torch.Tensor, tol: float, dtype: torch.dtype) -> str:
    """Why an update cannot be compared: its round-off is half its size or more, and too few entries to scale."""
    scale = float(update.abs().max()) if update.numel() else 0.0
    name = str(dtype).removeprefix("torch.")
    return (f"its round-off in {name} ({tol / SAFETY:.1e}, against float64) is as large as its update (largest entry "
            f"{scale:.1e}), and too few of its entries stand out of their own round-off to compare its scale: "
            "parameters too coarse to hold the update leave nothing to compare; check optimizer steps in float64 "
            "(dtype=torch.float64)")
