"""What one run of ``check_equivalence`` records: module outputs, the loss, gradients, parameters, source lines.

A run (the reference on a one-device mesh, or the parallel one on simulated ranks) hooks every
submodule's forward and keeps, for each floating-point tensor it returns, a :class:`Snapshot`:
its SPMD types (from ``spmd.get_type``, or a DTensor's placements), the dims its partition spec
names, every rank's value (a float64 copy, taken at once: later in-place ops do not change it) and
the user's source line that produced it. The source lines come from a torch-function mode that,
for every op the step runs, notes the innermost frame outside ``spmd_types``, torch and the
standard library: the same rule as the ``at:`` line of an ``SpmdTypeError``.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from .._core.dtensor_hook import is_dtensor
from .._core.errors import _PKG_DIR
from .._core.types import SpmdType
from .._torch.private import DisableTorchFunctionSubclass, dtensor_local, dtensor_local_or_none, local_tensors_of, tree_leaves
from ._eq_dtensor import dtensor_types
from ._simulate import rank_values

__all__ = ["Snapshot", "Recorder", "snapshot", "types_on", "format_source", "module_names"]

Where = tuple  # (filename, line number)


@dataclass
class Snapshot:
    """One recorded value of one run: ``values`` is ``{rank: float64 tensor}`` (one entry on one device)."""

    key: str
    kind: str
    module: str | None = None
    types: dict[str, SpmdType] | None = None
    dims: dict[str, int] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    source: Where | None = None
    why_not: str | None = None  # set when the value cannot be reassembled (untyped, an odd placement)
    precision: torch.dtype | None = None  # the lowest float dtype the step had computed in when this was recorded
    op: str | None = None  # kind "random": the op that drew the numbers (``bernoulli_``)


# ---------------------------------------------------------------------------
# snapshots


def _plain_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    if type(t).__name__ == "AsyncCollectiveTensor":  # a functional collective's pending result (DTensor's)
        t = t.elem  # type: ignore[attr-defined]
    if local_tensors_of(t) is not None:
        return {r: v.to(torch.float64, copy=True) for r, v in rank_values(t).items()}
    with DisableTorchFunctionSubclass():
        return {0: t.detach().to(torch.float64, copy=True)}


def types_on(t: torch.Tensor, mesh: Any) -> dict[str, SpmdType] | None:
    """``t``'s types presented on ``mesh`` (typed on another presentation of the same ranks, such as an
    expert mesh whose ``ep`` runs over the ranks of ``tp``: moved onto ``mesh``'s axes by region)."""
    from .._checker.reading import present
    from .._core.mesh import set_current_mesh

    if getattr(t, "_spmd_types", None) is None:
        return None
    with set_current_mesh(mesh):
        types, _ = present(t, "check_equivalence", strict=False)
    return types.as_dict()


def snapshot(t: torch.Tensor, key: str, kind: str, mesh: Any, *, module: str | None = None,
             source: Where | None = None) -> Snapshot:
    """Record ``t``: its types on ``mesh``'s axes, its partition-spec dims, every rank's value."""
    snap = Snapshot(key, kind, module=module, source=source)
    if is_dtensor(t):
        snap.types, snap.why_not = dtensor_types(t, mesh)
        snap.values = _plain_values(dtensor_local(t))
        return snap
    types = types_on(t, mesh)
    snap.values = _plain_values(t)
    if types is None:
        snap.why_not = "untyped (give it a type with spmd.assert_type, or type the module's output)"
        return snap
    snap.types = dict(types)  # an axis of one rank may carry no type: its one piece is the whole
    spec = getattr(t, "_spmd_spec", None)  # per dim, the names of the axes that shard it
    if spec is not None:
        for d, entry in enumerate(spec):
            for axis in entry:
                snap.dims[axis] = d
    return snap


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(out) if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]


def module_names(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """``{module: qualified name}``; the root is named by its class (its qualified name is empty).

    A root that ``fully_shard`` gave its class ``FSDP<name>`` (a subclass of ``FSDPModule`` and the
    model's class) is named by the model's class, as on one device where FSDP is not applied.
    """
    cls = type(model)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == "FSDP" + bases[1].__name__:
        cls = bases[1]
    return {m: (name or cls.__name__) for name, m in model.named_modules()}


# ---------------------------------------------------------------------------
# the recorder: forward hooks and source lines


class Recorder:
    """Hooks every submodule of ``model``; ``outputs`` lists their snapshots in the order forwards finish."""

    def __init__(self, model: torch.nn.Module, mesh: Any, *, sources: bool, dtype: torch.dtype) -> None:
        self.mesh = mesh
        self.precision = dtype  # lowered when an op of the step returns a float tensor of less precision
        self.outputs: list[Snapshot] = []
        self.calls: dict[str, int] = {}  # how many times each module's forward ran
        self.pending: list[Snapshot] = []  # draws not yet given the type of the value they were drawn for
        self._running: list[str] = []  # the modules whose forward is running, innermost last
        self._drawn: dict[str, int] = {}
        self._handles: list[Any] = []
        self._where: dict[int, tuple[weakref.ref, Where]] = {}
        self._sources = sources
        for module, name in module_names(model).items():
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def _enter(self, name: str):
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._running.append(name)

        return hook

    def note_draw(self, op: str, t: torch.Tensor) -> Snapshot:
        """A random draw (``t``: the drawn numbers), recorded in execution order, named by the running module."""
        base = self._running[-1] if self._running else "step"
        k = self._drawn.get(base, 0)
        self._drawn[base] = k + 1
        snap = Snapshot(base if k == 0 else f"{base}#{k}", "random", module=base, values=_plain_values(t),
                        source=_user_frame(), op=op)
        self.outputs.append(snap)
        self.pending.append(snap)
        return snap

    def type_draws(self, out: Any) -> None:
        """The draws of one call take the type of its output of their shape (dropout's mask: its output's)."""
        leaves = _tensor_leaves(out)
        for snap in self.pending:
            shape = tuple(next(iter(snap.values.values())).shape)
            found = next((t for t in leaves if tuple(t.shape) == shape), None)
            if found is not None:
                typed = snapshot(found, snap.key, "random", self.mesh)
                snap.types, snap.dims = typed.types, typed.dims
        self.pending.clear()

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._running and self._running[-1] == name:
                self._running.pop()
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            base = name if k == 0 else f"{name}#{k}"
            leaves = _tensor_leaves(output)
            for i, t in enumerate(leaves):
                key = base if len(leaves) == 1 else f"{base}[{i}]"
                snap = snapshot(t, key, "output", self.mesh, module=name, source=self.source_of(t))
                snap.precision = self.precision
                self.outputs.append(snap)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def source_of(self, t: Any) -> Where | None:
        """Where ``t`` was last produced or written in place (a DTensor: its local tensor), if seen."""
        for x in (t, dtensor_local_or_none(t)):
            found = self._where.get(id(x)) if x is not None else None
            if found is not None and found[0]() is x:
                return found[1]
        return None

    @contextlib.contextmanager
    def sources(self) -> Iterator[None]:
        """Note the producing source line of every tensor made inside (nothing when not asked to)."""
        if not self._sources:
            yield
            return
        with _SourceMode(self):
            yield

    def note_dtype(self, dtype: torch.dtype) -> None:
        """An op computed in ``dtype``: values recorded from now on carry its round-off (if it is coarser)."""
        if torch.finfo(dtype).eps > torch.finfo(self.precision).eps:
            self.precision = dtype


_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__ipow__", "__imod__", "__iand__", "__ior__", "__ixor__"})
_SKIP_CODE: dict[Any, bool] = {}
_SKIP_DIRS: list[str] = []


def _skip_dirs() -> tuple[str, ...]:
    """This package's, torch's and the standard library's folders, each ending in a separator: a library
    whose folder only starts with one of their names (``site-packages/torchtitan``) is not skipped."""
    if not _SKIP_DIRS:
        dirs = [_PKG_DIR, os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(contextlib.__file__)]
        _SKIP_DIRS.extend(os.path.join(os.path.abspath(d), "") for d in dirs)
    return tuple(_SKIP_DIRS)


def _skipped(filename: str) -> bool:
    """True for a frame of spmd_types, torch or the standard library (the ``at:`` line names none of them)."""
    return (filename.startswith("<") or filename.endswith("typing_extensions.py")
            or os.path.abspath(filename).startswith(_skip_dirs()))


def _user_frame() -> Where | None:
    """The innermost frame outside spmd_types, torch and the standard library (cached per code object)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        skip = _SKIP_CODE.get(code)
        if skip is None:
            skip = _SKIP_CODE[code] = _skipped(code.co_filename)
        if not skip:
            return (code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


class _SourceMode(TorchFunctionMode):
    """Notes, for every tensor an op returns or writes in place, the user line that ran the op.

    It also tells the recorder when an op returns a float tensor of less precision than the run's
    dtype (Megatron's cross entropy computes in float32 whatever the model's dtype).
    """

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.table = recorder._where
        self.recorder = recorder
        self.eps = torch.finfo(recorder.precision).eps

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recorder.pending:
            self.recorder.type_draws(args[0] if out is None and args else out)
        name = getattr(func, "__name__", "")
        if name == "__get__" or name == "__set__":  # attribute reads and writes (t.grad, t.shape) make nothing
            return out
        where = _user_frame()
        if where is None:
            return out
        if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
            if args and isinstance(args[0], torch.Tensor):
                self._note(args[0], where)
        elif "out" in kwargs and isinstance(kwargs["out"], torch.Tensor):
            self._note(kwargs["out"], where)
        elif isinstance(out, torch.Tensor):
            if not (args and out is args[0]):
                self._note(out, where)
            if out.is_floating_point() and torch.finfo(out.dtype).eps > self.eps:
                self.recorder.note_dtype(out.dtype)
                self.eps = torch.finfo(self.recorder.precision).eps
        elif isinstance(out, (tuple, list)):
            for x in out:
                if isinstance(x, torch.Tensor):
                    self._note(x, where)
        return out

    def _note(self, t: torch.Tensor, where: Where) -> None:
        self.table[id(t)] = (weakref.ref(t), where)


def format_source(where: Where | None) -> str | None:
    """``path:line: code`` (the path relative to the working directory where it is inside it)."""
    if where is None:
        return None
    filename, line = where
    code = linecache.getline(filename, line).strip()
    shown = os.path.abspath(filename)
    try:
        rel = os.path.relpath(shown)
        if not rel.startswith(".."):
            shown = rel
    except ValueError:
        pass
    return f"{shown}:{line}: {code}"
