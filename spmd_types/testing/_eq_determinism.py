"""A step ``check_equivalence`` can compare: random draws replayed, runs that repeat, round-off that stays round-off.

Random draws. On simulated ranks each rank draws from its own stream (seeded as the trainer seeds
it: the same on every rank, or per rank with ``torch.manual_seed(seed + dist.get_rank(group))``);
on one device the step draws for the whole tensor from one stream, so the two never match by
chance. The parallel run records every draw (each op torch tags ``nondeterministic_seeded``) with
the type of the value it was drawn for (dropout's output: its mask has the same pieces), and the
one-device runs replay it: the k-th draw there takes the k-th parallel draw, reassembled by that
type as any value is. What the replay cannot show, whether each rank drew from the right stream,
is checked per draw the way an RNG tracker defines it: on an axis where the value is R or I every
rank must draw the same numbers (Megatron's default stream); on an axis where it is V or S(d) and
the batch is not split (a model axis, such as tp) every rank must draw its own (the model-parallel
stream). On a data axis (one the batch is split over) ranks may share a stream, as Megatron's and
torchtitan's ranks of dp do.

Runs that repeat. The reference runs twice from the same start; a step that carries state between
runs (a schedule object or a counter made outside ``build()``) or draws outside torch's generator
differs between them, and :class:`NondeterministicStepError` names the first value that does.
Below float64 the float64 run must also stay within a gross bound of the run in ``dtype``, else
round-off cannot set the tolerance: such a value is listed as not compared, with its reason (a loss
that strays raises), instead of being held to a tolerance widened until anything passes.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .._core.types import I, P, R
from .._torch.private import TorchDispatchMode, simulator
from ._eq_align import MeshInfo, assemble, match
from ._eq_record import Snapshot, format_source
from ._eq_report import NondeterministicStepError

__all__ = ["DrawMode", "DrawTape", "check_draw", "check_repeats", "gross_gaps", "GROSS"]

# Ops whose every output element is a draw (replaying the output replays the op). Other ops that draw
# (``native_dropout``, ``rrelu_with_noise``) mix the draw with their input: they cannot be replayed.
_PURE_DRAWS = frozenset({
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "normal", "normal_", "uniform_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
    "multinomial", "poisson",
})
_SEEDED = torch.Tag.nondeterministic_seeded
# The float64 run may differ from the run in dtype by at most this fraction of a value's largest entry.
GROSS = 0.25


class DrawTape:
    """The parallel run's draws, in order, and their reassembly into each one-device draw."""

    def __init__(self, draws: list[Snapshot], mesh: MeshInfo, output_dims: Mapping[str, Any] | None) -> None:
        self.draws, self.mesh, self.output_dims = draws, mesh, output_dims

    def whole(self, k: int, op: str, shape: tuple[int, ...], here: Snapshot) -> torch.Tensor:
        """The k-th parallel draw as the one-device run draws it (``here``: its own record of the draw)."""
        if k >= len(self.draws):
            raise _draw_error(here, f"the step draws more often on one device than on the ranks ({len(self.draws)} "
                                    "draws there)")
        draw = self.draws[k]
        if draw.key != here.key or draw.module != here.module:
            raise _draw_error(here, f"its {k + 1}th draw is {draw.key} on the ranks: the runs took different paths")
        if draw.types is None:
            values = list(draw.values.values())
            if all(torch.equal(v, values[0]) for v in values) and tuple(values[0].shape) == tuple(shape):
                return values[0]
            raise _draw_error(here, "drawn for no typed value, and the ranks drew different numbers: type the value "
                                    "the numbers are drawn for (dropout's input)")
        if any(t is P for t in draw.types.values()):
            raise _draw_error(here, "drawn for a value typed P (a pending sum): draw after its reduction")
        got = assemble(draw, self.mesh, tuple(shape), match(self.output_dims, draw.module or ""), 0.0)
        if got.value is None or got.shape_error is not None:
            raise _draw_error(here, f"its pieces cannot be placed in the one-device draw of shape {list(shape)}: "
                                    f"{got.reason or got.shape_error}")
        return got.value


def _draw_error(here: Snapshot, why: str) -> NondeterministicStepError:
    where = format_source(here.source)
    return NondeterministicStepError(
        f"check_equivalence replays the ranks' random draws on one device, but cannot replay the draw of {here.op} "
        f"in {here.key}{f' at {where}' if where else ''}: {why}. Or compare with the random op off (dropout 0, "
        "model.eval())")


class DrawMode(TorchDispatchMode):
    """Inside a step: record every random draw (``tape`` None: the parallel run) or replay the tape's."""

    def __init__(self, recorder: Any, tape: DrawTape | None) -> None:
        super().__init__()
        self.recorder, self.tape = recorder, tape
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _SEEDED not in func.tags:
            return func(*args, **kwargs)
        enabled_local_tensor_mode = simulator().enabled_local_tensor_mode

        lm = enabled_local_tensor_mode()
        if lm is None:  # a draw made outside the simulation: one plain value
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in _PURE_DRAWS:  # an op that may draw (attention with dropout_p): refused only if it did
            before = _streams(lm)
            out = func(*args, **kwargs)
            if not all(torch.equal(a, b) for a, b in zip(before, _streams(lm))):
                here = self.recorder.note_draw(name, args[0])
                raise _draw_error(here, f"{name} mixes its draw with its input, so its draw cannot be replayed")
            return out
        out = func(*args, **kwargs)
        target = args[0] if name.endswith("_") else out
        here = self.recorder.note_draw(name, target)
        if self.tape is not None:
            value = self.tape.whole(self.count, name, tuple(target.shape), here)
            with torch.no_grad():
                target.copy_(value)
            here.values = {0: value.to(torch.float64)}
        self.count += 1
        return out


def _streams(lm: Any) -> list[torch.Tensor]:
    """Every simulated rank's CPU generator state (the one stream when the ranks have none of their own)."""
    states = getattr(lm, "_per_rank_rng_states", None)
    if not states:
        return [torch.get_rng_state()]
    return [states[r][0].clone() for r in sorted(states)]


def check_draw(snap: Snapshot, mesh: MeshInfo, data_axes: frozenset[str]) -> tuple[tuple[int, ...], str | None]:
    """(ranks at fault, why) for one parallel draw: R/I axes draw alike, V/S(d) model axes draw apart."""
    types = snap.types or {}
    for k, (axis, n) in enumerate(zip(mesh.names, mesh.sizes)):
        if n == 1 or snap.types is None:
            continue
        t = types.get(axis, I)
        if not (t is R or t is I) and axis in data_axes:
            continue
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, c in sorted(mesh.coords.items()):
            groups.setdefault(c[:k] + c[k + 1:], []).append(rank)
        bad: set[int] = set()
        for ranks in groups.values():
            values = [snap.values[r] for r in ranks]
            if t is R or t is I:
                bad.update(r for r, v in zip(ranks, values) if not torch.equal(v, values[0]))
            else:
                bad.update(r for i, r in enumerate(ranks) for j, q in enumerate(ranks)
                           if i != j and torch.equal(values[i], values[j]))
        if bad and (t is R or t is I):
            return tuple(sorted(bad)), (
                f"ranks {_ranks(bad)} draw other numbers than their peers on '{axis}', where the value is {t}: every "
                f"rank of '{axis}' holds the same value and must draw the same numbers (one stream, seeded alike "
                f"on '{axis}')")
        if bad:
            return tuple(sorted(bad)), (
                f"ranks {_ranks(bad)} draw the same numbers on '{axis}', where the value is {t}: each rank of "
                f"'{axis}' holds its own piece and must draw its own (a stream seeded per rank of '{axis}', e.g. "
                f"torch.manual_seed(seed + dist.get_rank(group)))")
    return (), None


def _ranks(ranks: set[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def _what(snap: Snapshot) -> str:
    """The value a snapshot holds, in words (``the output of layers.0.mlp``)."""
    return {"loss": "the loss", "output": f"the output of {snap.key}", "grad": f"the gradient of {snap.key}",
            "param": f"the updated {snap.key}", "random": f"the random draw in {snap.key}"}[snap.kind]


def check_repeats(first: list[Snapshot], again: list[Snapshot], dtype: torch.dtype) -> None:
    """Raise :class:`NondeterministicStepError` at the first value where two one-device runs differ."""
    eps = torch.finfo(dtype).eps
    again_by = {(s.kind, s.key): s for s in again}
    for snap in first:
        other = again_by.get((snap.kind, snap.key))
        if not snap.values or other is None or not other.values:
            continue
        a, b = snap.values[0], other.values[0]
        scale = float(a.abs().max()) if a.numel() else 0.0
        if a.shape == b.shape and (not a.numel() or float((a - b).abs().max()) <= 4 * eps * scale):
            continue
        gap = "in shape" if a.shape != b.shape else f"by {float((a - b).abs().max()):.1e} (largest entry {scale:.1e})"
        raise NondeterministicStepError(
            f"check_equivalence: the step is not deterministic: run twice on one device from the same start and "
            f"batch, {_what(snap)} differs {gap}. A step that carries state between runs (a schedule, "
            "a counter or a generator made outside build()) or draws random numbers outside torch (Python's random, "
            "NumPy) cannot be compared: keep its state in build() or step, seed inside step (torch.manual_seed, per "
            "rank as the trainer does), or draw with torch")


def gross_gaps(ref: list[Snapshot], ref64: list[Snapshot], dtype: torch.dtype) -> dict[tuple[str, str], str]:
    """The values whose float64 run strays from the run in ``dtype`` by more than :data:`GROSS` of their largest
    entry, each with the reason it cannot be compared; a loss that strays makes the whole step incomparable
    and raises :class:`NondeterministicStepError`."""
    by64 = {(s.kind, s.key): s for s in ref64}
    name = str(dtype).removeprefix("torch.")
    found: dict[tuple[str, str], str] = {}
    for snap in ref:
        other = by64.get((snap.kind, snap.key))
        if not snap.values or other is None or not other.values or snap.kind in ("random", "update"):
            continue
        a, b = snap.values[0], other.values[0]
        if a.shape != b.shape or not a.numel():
            continue
        scale, gap = float(b.abs().max()), float((a - b).abs().max())
        if not gap > GROSS * scale:
            continue
        if snap.kind == "loss":
            raise NondeterministicStepError(
                f"check_equivalence: the step computes differently in {name} and in float64 beyond round-off: the "
                f"loss differs by {gap:.1e} between the two one-device runs ({gap / scale:.0%} of it, {scale:.1e}), so "
                "round-off cannot set a tolerance. A draw outside torch, a branch on the dtype, or a choice that "
                "round-off flips (top-k, argmax on near ties) does this: draw with torch, or check in float64 "
                "(dtype=torch.float64)")
        found[(snap.kind, snap.key)] = (
            f"in {name} it strays from its float64 value by {gap / scale:.0%} of its largest entry ({scale:.1e}): "
            "round-off that large (cancellation), a branch on the dtype or a choice round-off flips (top-k, argmax) "
            "leaves no tolerance to hold it to; check it in float64 (dtype=torch.float64)")
    return found
