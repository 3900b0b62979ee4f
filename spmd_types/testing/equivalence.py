"""``check_equivalence``: a parallel training step against the same code on one device, aligned by SPMD types.

Types catch the bugs that change a gradient's communication; a wrong mask, a loss averaged twice or
a checkpoint split the wrong way are well typed and train wrong. This check runs the user's step
twice: once on a one-device mesh (every axis of size 1: the reference) and once on simulated ranks
(``LocalTensorMode`` on CPU). Each value's type says how its per-rank pieces make one tensor, so the
parallel run's module outputs, loss, gradients and updated parameters are reassembled and compared
with the reference's, and the first one that differs names the module where the bug starts.
docs/equivalence.md is the user's guide.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from .._core.dtensor_hook import is_dtensor
from .._core.types import Shard, SpmdType
from .._torch.private import DisableTorchFunctionSubclass, dtensor_local, local_tensors_of
from ._eq_align import MeshInfo, Sources, load_parameters, local_batch
from ._eq_compare import Asked, Run, compare
from ._eq_determinism import DrawMode, DrawTape, check_repeats, gross_gaps
from ._eq_dtensor import strided_layouts
from ._eq_record import Recorder, Snapshot, snapshot
from ._eq_report import Comparison, Divergence, DivergenceError, EquivalenceReport, NondeterministicStepError, NotCompared
from ._simulate import rank_values, simulate

__all__ = ["check_equivalence", "EquivalenceReport", "DivergenceError", "Divergence", "Comparison", "NotCompared",
           "NondeterministicStepError"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Spec:
    build: Callable[[Any], torch.nn.Module]
    step: Callable[..., Any]
    batch: Mapping[str, Any]
    names: tuple[str, ...]
    sources: Sources
    seed: int


def check_equivalence(
    build: Callable[[Any], torch.nn.Module],
    step: Callable[[torch.nn.Module, dict[str, torch.Tensor], Any], Any],
    batch: Mapping[str, Any],
    *,
    mesh_shape: tuple[int, ...] = (2, 2),
    names: tuple[str, ...] = ("dp", "tp"),
    layouts: Mapping[str, Callable[[torch.Tensor, dict[str, int]], torch.Tensor]] | None = None,
    reference_names: Mapping[str, Callable[[str, dict[str, int]], str]] | None = None,
    output_dims: Mapping[str, Mapping[str, int]] | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> EquivalenceReport:
    """Run ``step`` on simulated ranks and on one device; report the first value where they differ.

    ``build(mesh)`` returns the model with typed parameters; it is called inside
    ``spmd.typecheck()`` with torch's default dtype set to ``dtype``, on the ``mesh_shape`` mesh,
    whose ranks are simulated in this process (``LocalTensorMode``, CPU; each reads its own rank
    from ``dist.get_rank(group)`` and ``group.rank()``), and on a one-device mesh (every axis of
    size 1: the reference). The parallel parameters are loaded from the reference's
    (``state_dict`` if given, else the reference build's own initialisation) by their types: S(d),
    this rank's contiguous chunk of dim d; R and I, the whole; a parameter matching a glob of
    ``layouts`` gets ``layouts[glob](full, coords)`` (``coords``: this rank's ``{axis: index}``);
    one matching a glob of ``reference_names`` comes from the reference parameter
    ``reference_names[glob](name, coords)`` (expert k of ep rank r: ``local_experts.{r*n+k}``).
    ``step(model, batch, mesh)`` is one training step as the trainer writes it (forward, backward,
    gradient sync, maybe an optimizer step), run inside ``spmd.typecheck()``, returning the loss;
    ``batch`` maps names to ``(global tensor, {axis: type})``: S(d) entries are cut into chunks of
    dim d, R/I ones given whole, each typed as given (a bare tensor is given whole and untyped).

    The parallel run goes first and records its random draws; the reference runs twice replaying
    them (each draw is also checked per rank for the stream its type asks for), and below float64
    a third time in float64 to measure its round-off, which sets each value's tolerance
    (docs/equivalence.md). A step whose two reference runs differ, or whose draws cannot be
    replayed, raises :class:`NondeterministicStepError` instead of passing.

    Every module's forward output, the loss, every gradient and every update (the parameter after
    the step minus before it, when the step changed any) are reassembled by type (R/I: one copy,
    checked equal on every rank; P: summed; S(d): concatenated on d; V: on its partition spec's
    dim, else ``output_dims[glob][axis]``, else the one dim the shapes allow) and compared with the
    reference. A value whose layout cannot be told is listed in ``report.not_compared`` with the
    reason, never guessed. An ``SpmdTypeError`` raised by the parallel step propagates unchanged:
    types first.

    Example::

        report = check_equivalence(build, step, {"tokens": (tokens, {"dp": spmd.S(0), "tp": spmd.I})})
        print(report)                 # the table, first divergence highlighted with its source line
        report.raise_if_diverged()    # DivergenceError (an AssertionError) unless report.ok
    """
    mesh_shape, names = tuple(mesh_shape), tuple(names)
    _check_arguments(mesh_shape, names, batch, dtype)
    spec = _Spec(build, step, batch, names, Sources(layouts, reference_names), seed)
    rng = torch.get_rng_state()  # the runs seed torch's generator; the caller's stream is left as it was
    try:
        return _check(spec, mesh_shape, output_dims, state_dict, dtype)
    finally:
        torch.set_rng_state(rng)


def _check(spec: _Spec, mesh_shape: tuple[int, ...], output_dims: Mapping[str, Mapping[str, int]] | None,
           state_dict: Mapping[str, torch.Tensor] | None, dtype: torch.dtype) -> EquivalenceReport:
    """The parallel run first (its type errors come first), then the reference twice, and its twin.

    The twin measures round-off: below float64 it runs in float64; a float64 step that computes in
    a coarser dtype somewhere (a loss in float32) gets a twin in that dtype.
    """
    one = tuple(1 for _ in spec.names)
    start = _initial(spec, one, dtype, state_dict)
    found: dict[str, Sources] = {}
    par = _run(spec, mesh_shape, dtype, start, True, found=found)  # its SpmdTypeError propagates as raised
    tape = DrawTape([s for s in par.outputs if s.kind == "random"], par.mesh, output_dims)  # type: ignore[arg-type]
    held: list[BaseException] = []
    ref = _attempt(spec, one, dtype, start, tape, held)
    again = _attempt(spec, one, dtype, start, tape, held) if not held else ref
    if held:
        raise held[0]
    check_repeats(ref.snapshots(), again.snapshots(), dtype)
    twin, strayed = None, {}
    other = torch.float64 if dtype != torch.float64 else _coarsest(par)
    if other != dtype:  # below float64, or a float64 step computing in float32 somewhere: its round-off measured
        twin = _attempt(spec, one, other, {k: v.to(other) for k, v in start.items()}, tape, held)
        if held:
            raise held[0]
        if dtype != torch.float64:
            strayed = gross_gaps(ref.snapshots(), twin.snapshots(), dtype)
    return compare(ref, twin, par, Asked(spec.batch, found["sources"], output_dims), dtype, strayed)


def _coarsest(run: Run) -> torch.dtype:
    """The coarsest float dtype the step computed in (float32 for a float64 model whose loss is in float32)."""
    found = [s.precision for s in run.snapshots() if s.precision is not None]
    return max(found, key=lambda d: torch.finfo(d).eps, default=torch.float64)


def _initial(spec: _Spec, shape: tuple[int, ...], dtype: torch.dtype,
             state_dict: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The reference model's parameters at the start: ``state_dict`` loaded, else its own initialisation."""
    import spmd_types as spmd

    with _default_dtype(dtype), simulate(shape, spec.names, ranks="local", device="cpu") as mesh:
        torch.manual_seed(spec.seed)
        with spmd.typecheck():
            model = _built(spec, mesh)
        params = dict(model.named_parameters())
        if state_dict is not None:
            load_parameters(params, state_dict, MeshInfo.of(mesh), None, parallel=False)
        return {n: _whole(p) for n, p in params.items()}


def _built(spec: _Spec, mesh: Any) -> torch.nn.Module:
    model = spec.build(mesh)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check_equivalence: build(mesh) must return an nn.Module, got {type(model).__name__}")
    return model


def _check_arguments(mesh_shape: tuple[int, ...], names: tuple[str, ...], batch: Mapping[str, Any],
                     dtype: torch.dtype) -> None:
    if len(mesh_shape) != len(names):
        raise ValueError(f"check_equivalence: {len(mesh_shape)} mesh sizes but {len(names)} axis names")
    if dtype not in _DTYPES:
        raise ValueError(f"check_equivalence: dtype must be one of float64, float32, bfloat16, float16; got {dtype}")
    for key, entry in batch.items():
        pair = isinstance(entry, tuple) and len(entry) == 2
        full, types = (entry if pair else (entry, None))
        if type(full).__module__ == "numpy":
            raise TypeError(f"check_equivalence: batch entry '{key}' holds a numpy.{type(full).__name__}: give a torch "
                            "tensor (torch.from_numpy(array))")
        if (isinstance(entry, tuple) and not pair) or not isinstance(full, torch.Tensor) or not (
                types is None or isinstance(types, Mapping)):
            raise TypeError(f"check_equivalence: batch entry '{key}' must be (global tensor, {{axis: type}}) or a "
                            f"tensor, got {type(entry).__name__}")
        extra = [a for a in (types or {}) if a not in names]
        if extra:
            raise ValueError(f"check_equivalence: batch entry '{key}' is typed on '{extra[0]}', which is not a mesh "
                             f"axis ({', '.join(names)})")
        for axis, t in (types or {}).items():
            if not isinstance(t, SpmdType):
                raise TypeError(f"check_equivalence: batch entry '{key}' types axis '{axis}' with {_not_a_type(t)}")


def _not_a_type(t: Any) -> str:
    """What a batch type that is not an SPMD type is, and the type to give instead."""
    if isinstance(t, str):
        return f"the string {t!r}: give the type itself, e.g. spmd.{t if t in ('R', 'I', 'S(0)') else 'S(0)'}"
    if t is Shard:
        return "the class spmd.S: give a shard of one dim, e.g. spmd.S(0)"
    return (f"{t!r} ({type(t).__name__}): give an SPMD type: spmd.R, spmd.I, spmd.S(d) (V and P say nothing about how "
            "the global batch splits)")


def _attempt(spec: _Spec, shape: tuple[int, ...], dtype: torch.dtype, start: Mapping[str, torch.Tensor],
             tape: DrawTape, held: list[BaseException]) -> Run:
    """A reference run (replaying the parallel run's draws) whose failure is held, to be raised in order."""
    run = Run()
    try:
        _run(spec, shape, dtype, start, False, run, tape)
    except Exception as err:  # noqa: BLE001 - re-raised unchanged once the parallel run had its turn
        held.append(err)
    return run


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _run(spec: _Spec, shape: tuple[int, ...], dtype: torch.dtype, start: Mapping[str, torch.Tensor] | None,
         parallel: bool, run: Run | None = None, tape: DrawTape | None = None,
         found: dict[str, Sources] | None = None) -> Run:
    """Build, load and run one step on a mesh of ``shape``; record everything in ``run``.

    The parallel run records its random draws; a reference run replays them from ``tape``. The parallel
    run's sources (the given ones, and a layout for each parameter FSDP2 shards with a strided shard)
    are put in ``found["sources"]``.
    """
    import spmd_types as spmd

    run = run if run is not None else Run()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_default_dtype(dtype))
        mesh = stack.enter_context(simulate(shape, spec.names, ranks="local", device="cpu"))
        info = run.mesh = MeshInfo.of(mesh)
        run.dtype = dtype
        torch.manual_seed(spec.seed)
        with spmd.typecheck():
            model = _built(spec, mesh)
        params = dict(model.named_parameters())
        sources = spec.sources.with_layouts(strided_layouts(params, mesh)) if parallel else None
        if found is not None:
            found["sources"] = sources or spec.sources
        if start is not None:
            load_parameters(params, start, info, sources, parallel=parallel)
        run.initial = {n: _whole(p) for n, p in params.items()}
        run.before = {n: snapshot(p, n, "update", mesh).values for n, p in params.items()}
        recorder = Recorder(model, mesh, sources=parallel, dtype=dtype)
        batch = None
        try:
            with spmd.typecheck():
                batch = local_batch(spec.batch, info, dtype)
            torch.manual_seed(spec.seed)
            with spmd.typecheck(), recorder.sources(), DrawMode(recorder, tape):
                loss = spec.step(model, batch, mesh)
        finally:
            recorder.remove()
            run.outputs, run.calls = recorder.outputs, recorder.calls
        _record_end(run, model, loss, recorder, mesh)
    return run


def _whole(p: torch.Tensor) -> torch.Tensor:
    """Rank 0's value (on the one-device mesh: the whole parameter), a plain detached copy."""
    base = dtensor_local(p) if is_dtensor(p) else p
    if local_tensors_of(base) is not None:
        return rank_values(base)[0].clone()
    with DisableTorchFunctionSubclass():
        return base.detach().clone()


def _record_end(run: Run, model: torch.nn.Module, loss: Any, recorder: Recorder, mesh: Any) -> None:
    if isinstance(loss, torch.Tensor):
        run.loss = snapshot(loss, "loss", "loss", mesh, source=recorder.source_of(loss))
    else:
        run.loss = Snapshot("loss", "loss", why_not=f"step returned {type(loss).__name__}, not a tensor")
    run.loss.precision = recorder.precision
    for name, p in model.named_parameters():
        if p.grad is not None:
            run.grads.append(snapshot(p.grad, name, "grad", mesh, source=recorder.source_of(p.grad)))
            run.grads[-1].precision = recorder.precision
        update = snapshot(p, name, "update", mesh, source=recorder.source_of(p))
        update.values = {r: v - run.before[name][r] for r, v in update.values.items()}
        update.precision = recorder.precision
        run.updates.append(update)
        run.changed = run.changed or any(bool(v.any()) for v in update.values.values())
