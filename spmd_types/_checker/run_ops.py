"""Running an op on typed tensors: subclass dispatch off, typed wrappers of other subclasses unwrapped.

On a plain device an op runs with torch-function subclass dispatch disabled.
Under a dispatch mode such as ``LocalTensorMode`` (simulated ranks) the mode
must meet its own tensor classes: inside ``typecheck()`` an op runs on the
typed objects with their classes swapped to their bases for the call (no
alias per operand), and a backward pass started from a typed value runs
under ``_SwapMode``, which hands the typed objects autograd saved to the
mode in its class. Checking off, ops run on plain aliases instead (so that
a plain result can start a backward pass). The class registries live here
so that this module does not import the tensor layer.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch

from .._core.state import STATE
from .._local.op_registry import ENTRIES
from .._local.rules_table import RuleKind
from .._torch.private import (
    DisableTorchFunctionSubclass,
    TorchDispatchMode,
    call_without_subclass_dispatch,
    execution_engine,
    len_torch_dispatch_stack,
    local_tensors_of,
)

_DisableTF = DisableTorchFunctionSubclass
# _OFF_CALL(func, _NO_TYPES, args[, kwargs]): func(*args, **kwargs) with subclass dispatch off in one C call (kwargs
# passed only when there are some); _run's common case, which the typed op path inlines
_OFF_CALL = call_without_subclass_dispatch
_NO_TYPES = ()
_dispatch_depth = len_torch_dispatch_stack

# typed class -> the class it is swapped to for a call; every typed class (filled by the tensor layer)
_SWAP_BACK: dict[type, type] = {}
_TYPED_CLASSES: set[type] = set()
# Metadata queries; torch.autograd.grad computes gradients, whose types follow by duality.
_UNCHECKED = (
    frozenset(f for f, e in ENTRIES.items() if e.row.kind is RuleKind.METADATA)
    | {torch.autograd.grad}
)
_BACKWARD = torch.Tensor.backward
_PASSTHROUGH = frozenset(f for f, e in ENTRIES.items() if e.row.kind is RuleKind.PASSTHROUGH)


def _run(func, args, kwargs):
    """Run ``func`` with subclass dispatch off (and typed wrappers of other subclasses unwrapped)."""
    if func in _AUTOGRAD_RUNS:
        return _run_backward(func, args, kwargs)
    if _dispatch_depth():
        if STATE.checking:
            return _run_checked_simulated(func, args, kwargs)
        if func in _UNCHECKED or func in _PASSTHROUGH:
            return _run_swapped(func, args, kwargs)
        return _run_on_aliases(func, args, kwargs)
    return _OFF_CALL(func, _NO_TYPES, args, kwargs) if kwargs else _OFF_CALL(func, _NO_TYPES, args)


def _run_checked_simulated(func, args, kwargs):
    """A checked op under a dispatch mode: run on the typed objects, and leave its backward node a hook.

    A backward pass from a typed value runs under ``_SwapMode``. One from a plain
    value (computed from typed ones with checking off) does not: the node's
    pre-hook then gives this op's typed operands, which autograd may have saved,
    their base classes until the pass ends.
    """
    out = _run_swapped(func, args, kwargs, _inplace_destination(func, args))
    with _DisableTF():
        first = out[0] if type(out) in (list, tuple) and out else out
        node = first.grad_fn if isinstance(first, torch.Tensor) else None
    if node is not None:
        typed = [weakref.ref(x) for x in _typed_operands(args, kwargs)]
        if typed:
            node.register_prehook(functools.partial(_swap_for_plain_root, typed))
    return out


def _typed_operands(args, kwargs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if type(x) in _SWAP_BACK:
            found.append(x)
        elif type(x) is list or type(x) is tuple:
            for y in x:
                visit(y)

    for a in (*args, *kwargs.values()):
        visit(a)
    return found


class _Backward(threading.local):
    under_swap_mode: int = 0


_BACKWARD_STATE = _Backward()


def _swap_for_plain_root(refs, grad_outputs) -> None:
    if _BACKWARD_STATE.under_swap_mode:
        return None
    swapped = []
    for ref in refs:
        x = ref()
        if x is not None and type(x) in _SWAP_BACK:
            swapped.append((x, type(x)))
            x.__class__ = _SWAP_BACK[type(x)]
    if swapped:
        execution_engine.queue_callback(functools.partial(_restore, swapped))
    return None


def _restore(swapped) -> None:
    for x, tp in reversed(swapped):
        x.__class__ = tp


def _swap_to_base(args, kwargs) -> list[tuple[torch.Tensor, type]]:
    """Give every typed wrapper of another subclass its base class back; return what to restore."""
    swapped: list[tuple[torch.Tensor, type]] = []

    def visit(x: Any) -> None:
        tp = type(x)
        base = _SWAP_BACK.get(tp)
        if base is not None:
            x.__class__ = base
            swapped.append((x, tp))
        elif tp is list or tp is tuple:
            for y in x:
                visit(y)

    for a in args:
        visit(a)
    for v in kwargs.values():
        visit(v)
    return swapped


def _run_swapped(func, args, kwargs, dest=None):
    """Run ``func`` with its typed wrappers given their base classes (and an in-place destination's base).

    Inside typecheck() this is how every op runs under a dispatch mode: autograd
    then saves the typed objects themselves, and a backward pass started from a
    typed root (``_run_backward``) hands them to the mode in its own class.
    """
    if func in _AUTOGRAD_RUNS:
        return _run_backward(func, args, kwargs)
    swapped = _swap_to_base(args, kwargs)
    if dest is not None and type(dest._base) in _SWAP_BACK:
        # an in-place op on a view makes autograd replay the view on its base
        swapped.append((dest._base, type(dest._base)))
        dest._base.__class__ = _SWAP_BACK[type(dest._base)]
    try:
        with _DisableTF():
            return func(*args, **kwargs)
    finally:
        for x, tp in swapped:
            x.__class__ = tp


_AUTOGRAD_RUNS = frozenset({_BACKWARD, torch.autograd.backward, torch.autograd.grad})


def _run_backward(func, args, kwargs):
    """Run a backward pass with subclass dispatch on, its typed arguments given their plain classes.

    Python code the engine runs (checkpoint recomputation, hooks) is then checked
    like any code, and under a dispatch mode it meets typed tensors through the
    usual path instead of the mode meeting them raw.
    """
    swapped: list[tuple[torch.Tensor, type]] = []

    def visit(x: Any) -> None:
        tp = type(x)
        if tp in _TYPED_CLASSES or tp in _SWAP_BACK:
            x.__class__ = _SWAP_BACK.get(tp, torch.Tensor)
            swapped.append((x, tp))
        elif tp is list or tp is tuple:
            for y in x:
                visit(y)

    for a in (*args, *kwargs.values()):
        visit(a)
    try:
        if _dispatch_depth():
            _BACKWARD_STATE.under_swap_mode += 1
            try:
                with _SwapMode():
                    return func(*args, **kwargs)
            finally:
                _BACKWARD_STATE.under_swap_mode -= 1
        return func(*args, **kwargs)
    finally:
        for x, tp in swapped:
            x.__class__ = tp


class _SwapMode(TorchDispatchMode):
    """Backward formulas meet the typed objects autograd saved: hand them to the mode below in its class."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        swapped = _swap_to_base(args, kwargs)
        try:
            return func(*args, **kwargs)
        finally:
            for x, tp in swapped:
                x.__class__ = tp


def _run_on_aliases(func, args, kwargs):
    """Run ``func`` on plain aliases of typed wrappers of other subclasses (LocalTensor, Parameter).

    Under a dispatch mode such as LocalTensorMode, autograd must save tensors of
    the mode's own classes: a backward formula that meets a typed wrapper fails
    the mode's type checks. The aliases share storage and autograd history; an
    op that returns an alias (in place) returns the typed object instead.
    """
    originals: dict[int, torch.Tensor] = {}
    dest = _inplace_destination(func, args)
    swapped = _swap_destination(dest) if dest is not None else []

    def alias(x: Any) -> Any:
        tp = type(x)
        base = _SWAP_BACK.get(tp)
        if base is None or x is dest:
            return type(x)(alias(y) for y in x) if tp is list or tp is tuple else x
        x.__class__ = base
        try:
            with _DisableTF():
                a = x.view_as(x)
        finally:
            x.__class__ = tp
        originals[id(a)] = x
        return a

    try:
        new_args = tuple(alias(a) for a in args)
        new_kwargs = {k: alias(v) for k, v in kwargs.items()}
        with _DisableTF():
            out = func(*new_args, **new_kwargs)
    finally:
        for x, tp in swapped:
            x.__class__ = tp
    return originals.get(id(out), out) if isinstance(out, torch.Tensor) else out


def _inplace_destination(func, args) -> torch.Tensor | None:
    """The typed wrapper an in-place op writes (its first operand), or None."""
    if not args or type(args[0]) not in _SWAP_BACK:
        return None
    entry = ENTRIES.get(func)
    inplace = entry.inplace if entry is not None else getattr(func, "__name__", "").endswith("_")
    return args[0] if inplace else None


def holds_only_zeros(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is zero (on every simulated rank under ``LocalTensorMode``).

    Reads the values: one reduction, and a host sync on an accelerator.
    """
    swapped = _swap_to_base((t,), {})
    try:
        with _DisableTF(), torch.no_grad():
            if t.device.type == "meta":
                return False
            nonzero = t.any()
            per_rank = local_tensors_of(nonzero)  # a LocalTensor: one flag per simulated rank
            return not any(bool(f) for f in (per_rank.values() if per_rank is not None else (nonzero,)))
    finally:
        for x, tp in swapped:
            x.__class__ = tp


def _swap_destination(dest: torch.Tensor) -> list[tuple[torch.Tensor, type]]:
    """Give an in-place op's destination, and the base it views, their simulator classes for the call.

    An in-place op on a view makes autograd replay the view on its base, and
    the mode must meet its own class there: the destination is written as
    itself (not through an alias), and its base is swapped too.
    """
    swapped = []
    for x in (dest, dest._base):
        tp = type(x)
        base = _SWAP_BACK.get(tp)
        if base is not None:
            x.__class__ = base
            swapped.append((x, tp))
    return swapped
