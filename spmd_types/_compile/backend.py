"""The checking compile backend: dynamo's graph is checked, then compiled by the real backend.

:class:`CheckingBackend` wraps any torch.compile backend. Given dynamo's graph it runs
:func:`~.graph_check.check_graph` (when checking is on), hands the graph to the backend it wraps, and
returns a :class:`Runner` around the compiled code. Under ``spmd.typecheck()`` it is installed on every
graph whose trace meets a typed tensor or an spmd call (:func:`install`); ``spmd.compile_backend()`` names
it explicitly.

The runner is what a compiled typed step costs beyond the erased one: with checking on, a look at the
typed inputs' types (the graph is checked again, once, for types it was not checked for), the typed
inputs handed to the compiled code as plain tensors (and to its backward), and the outputs given their
types. Checking off, only the hand-over.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch

from .._boundaries.autograd_functions import run_eagerly_under_compile
from .._checker.run_ops import _SWAP_BACK, _swap_for_plain_root, _swap_to_base
from .._checker.tensor import _wrap
from .._core.errors import SpmdTypeError
from .._core.state import STATE
from .._torch.private import (
    dynamo,
    dynamo_exc,
    dynamo_tls,
    inductor_backend,
    is_torch_function_enabled,
    len_torch_dispatch_stack,
    lookup_backend,
)
from .graph_check import Checked, check_graph, dynamo_fake_mode

__all__ = ["CheckingBackend", "Runner", "compile_backend", "install", "CHECKS"]

_tf_enabled = is_torch_function_enabled
_dispatch_modes = len_torch_dispatch_stack
# (graph name, seconds) of every check run in this process, for benchmarks and the docs' figures
CHECKS: list[tuple[str, float]] = []


class CheckingBackend:
    """A torch.compile backend that checks the graph's types, then compiles it with ``inner``."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        mode = dynamo_fake_mode()
        checked = _check(gm, example_inputs, mode) if STATE.checking else None
        swapped = _swap_to_base(tuple(example_inputs), {})  # the backend compiles the erased program
        try:
            compiled = self.inner(gm, example_inputs)
        finally:
            _restore(swapped)
        typed = tuple(i for i, x in enumerate(example_inputs) if type(x) in _SWAP_BACK)
        return Runner(compiled, gm, typed, checked, mode)


def _check(gm: torch.fx.GraphModule, example_inputs: list, mode: Any) -> Checked:
    try:
        checked = check_graph(gm, example_inputs, mode)
    except SpmdTypeError as err:
        raise compile_time_error(err) from None
    CHECKS.append((getattr(gm, "_spmd_name", type(gm).__name__), checked.seconds))
    return checked


class Runner:
    """The compiled graph as the program calls it: typed inputs in, typed outputs out."""

    def __init__(self, compiled: Callable[..., Any], gm: torch.fx.GraphModule, typed: tuple,
                 checked: Checked | None, mode: Any) -> None:
        self.compiled = compiled
        self.gm = gm
        self.mode = mode  # dynamo's fake mode, for checking the graph again
        self.typed = typed  # positions of the inputs that were typed when the graph was traced
        self.warm = False  # called once: AOTAutograd's first-call analysis has seen plain inputs
        self.checks: dict[tuple, Checked] = {}
        if checked is not None:
            self.checks[tuple(checked.inputs[i] for i in typed)] = checked

    def __call__(self, *args: Any) -> Any:
        typed = self.typed
        if not STATE.checking:
            return self._run(args) if typed else self.compiled(*args)
        key = tuple([(args[i]._spmd_types, getattr(args[i], "_spmd_spec", None)) for i in typed])
        checked = self.checks.get(key)
        if checked is None:  # types this graph was not checked for (or checking was off when it compiled)
            checked = self.checks[key] = _check(self.gm, list(args), self.mode)
        out = self._run(args) if typed else self.compiled(*args)
        for i, types, spec in checked.typed_inputs:
            _give(args[i], types, spec)
        flat = out if isinstance(out, (list, tuple)) else (out,)
        grads = False
        for o, found in zip(flat, checked.outputs):
            if found is not None:
                _give(o, *found)
                grads = grads or o.requires_grad
        if grads and typed:
            self._swap_in_backward(args, flat)
        return out

    def _run(self, args: tuple) -> Any:
        """The compiled code on the typed inputs as plain tensors (their classes swapped for the call).

        Dynamo calls a graph that met typed tensors with subclass dispatch off, so after the first call
        (where AOTAutograd's dispatch mode inspects the inputs' classes) no swap is needed, unless a dispatch
        mode is active to see the classes.
        """
        if self.warm and not _tf_enabled() and not _dispatch_modes():
            return self.compiled(*args)
        self.warm = True
        swapped = [(args[i], type(args[i])) for i in self.typed]
        for x, tp in swapped:
            x.__class__ = _SWAP_BACK[tp]
        try:
            return self.compiled(*args)
        finally:
            for x, tp in swapped:
                x.__class__ = tp

    def _swap_in_backward(self, args: tuple, outputs: Any) -> None:
        """The compiled backward may meet typed inputs it saved: it gets them plain, as the forward did."""
        typed = [weakref.ref(args[i]) for i in self.typed]
        seen = set()
        for o in outputs:
            node = o.grad_fn if isinstance(o, torch.Tensor) else None
            if node is not None and id(node) not in seen:
                seen.add(id(node))
                node.register_prehook(functools.partial(_swap_for_plain_root, typed))


def _give(t: torch.Tensor, types: Any, spec: Any) -> None:
    if type(t) in _SWAP_BACK:  # typed already (an input returned as it is): the checked type is its type now
        t._spmd_types = types
    else:
        _wrap(t, types)
    if spec is not None:
        t._spmd_spec = spec


def _restore(swapped: list) -> None:
    for x, tp in reversed(swapped):
        x.__class__ = tp


# ---------------------------------------------------------------------------
# the error a compile raises


_ERROR_CLASS: list = []


def compile_time_error(err: SpmdTypeError) -> SpmdTypeError:
    """``err`` as dynamo lets it through from a backend: an SpmdTypeError, with dynamo's frames cut."""
    if not _ERROR_CLASS:
        class SpmdCompileError(SpmdTypeError, dynamo_exc().ShortenTraceback):
            """An SpmdTypeError found while checking a compiled graph (dynamo re-raises it as it is).

            ``traced_stack``: the user's frames of the op, outermost first (``path:line: code``).
            """

            def __init__(self, rejection: Any, source: str | None) -> None:
                SpmdTypeError.__init__(self, rejection, source)
                self.rendered = self.args[0]
                self.first_useful_frame = None

            def __str__(self) -> str:  # the message as eager gives it (dynamo appends its own hints to args)
                return self.rendered

            def __reduce__(self):
                return (SpmdTypeError, (self.rejection, self.source))

        SpmdCompileError.__module__ = "spmd_types"
        SpmdCompileError.__qualname__ = "SpmdCompileError"
        _ERROR_CLASS.append(SpmdCompileError)
    out = _ERROR_CLASS[0](err.rejection, err.source)
    out.traced_stack = getattr(err, "traced_stack", ())
    if out.traced_stack:  # an eager traceback would show these frames of the user's code
        out.add_note("traced from (outermost first):\n" + "\n".join(f"  {f}" for f in out.traced_stack))
    return out


# ---------------------------------------------------------------------------
# installing it


class _Installing(threading.local):
    busy = False


_INSTALLING = _Installing()


def install() -> None:
    """Check the graph dynamo is building (a typed tensor or an spmd call met its trace): wrap its backend."""
    if _INSTALLING.busy:
        return
    _INSTALLING.busy = True
    try:
        _keep_functions_whole()
        run_eagerly_under_compile()  # a registered autograd Function runs (checked) eagerly, between graphs
        tx = getattr(dynamo_tls(), "current_tx", None)  # the frame dynamo is converting
        output = getattr(tx, "output", None)
        inner = getattr(output, "compiler_fn", None)
        if inner is None or _is_checking(inner):
            return
        output.compiler_fn = CheckingBackend(inner)
    finally:
        _INSTALLING.busy = False


# Torch functions written in Python that eager checks as one op, by their own rule (F.rms_norm, F.pad): kept as
# one graph node each (dynamo would trace into them), so that the checker meets the op eager meets.
_WHOLE = ("rms_norm", "pad")
_KEPT: list = []


def _keep_functions_whole() -> None:
    if _KEPT:
        return
    import torch.nn.functional as F
    for name in _WHOLE:
        dynamo().allow_in_graph(getattr(F, name))
    _KEPT.append(True)


def _is_checking(fn: Any) -> bool:
    while fn is not None:
        if isinstance(fn, CheckingBackend):
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return False


def compile_backend(backend: str | Callable[..., Any] = "inductor", **options: Any) -> CheckingBackend:
    """A torch.compile backend that checks SPMD types, then compiles with ``backend``.

    Inside :func:`spmd_types.typecheck` torch.compile checks typed code with any backend; name this one
    to say so explicitly (``options`` go to inductor, as ``torch.compile(options=...)`` would).

    Example::

        step = torch.compile(step, backend=spmd.compile_backend("inductor"), fullgraph=True)
        with spmd.typecheck():
            step(batch)   # checked once, when it compiles
    """
    if isinstance(backend, str):
        if backend == "inductor":
            inductor = inductor_backend()
            inner: Callable[..., Any] = functools.partial(inductor, options=options) if options else inductor
        else:
            if options:
                raise TypeError(f"spmd.compile_backend({backend!r}) takes no options (they are inductor's)")
            inner = lookup_backend(backend)
    else:
        inner = backend
    return CheckingBackend(inner)
