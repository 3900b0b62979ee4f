"""Catch custom ``torch.autograd.Function`` classes that touch typed tensors without a registration.

A custom Function's backward is written by hand, so its forward ops say
nothing about the communication its backward does (Megatron's copy-to region
is an identity forward with an all-reduce backward). The package therefore
refuses to type one from its forward alone: inside :func:`spmd_types.typecheck`,
a typed tensor reaching an op while an unregistered Function's forward runs
raises :class:`SpmdTypeError` naming the class and the registration that fixes it.

How it is seen, with no patching of torch: a Function's forward always runs
with both grad mode and forward-mode AD off (plain ``torch.no_grad()`` leaves
forward-mode AD on, so it costs nothing). When a typed op runs in that state,
the stack is searched for the frames of Functions' ``forward``s. torch 2.13
runs them from a Python ``Function.apply`` frame, torch 2.14 from C (its
``apply`` makes no frame), so the forward frame itself is what is found, on
both: its ``ctx`` argument names the class (``ctx._forward_cls``); a forward
without ``ctx`` (one with ``setup_context``) is found by its code object.
One case runs no op inside ``forward``: a forward that returns an input as it
is (Megatron's copy-to region). torch then aliases that input with
``view_as`` from inside ``apply``, after ``forward`` returned, so no forward
frame is on the stack; the alias is watched, and the first typed op after
``apply`` returns (or the end of ``typecheck()``) reads the class from its
``grad_fn`` and refuses it there, naming the line that called ``apply``.
This module is the low layer (the tensor layer calls
:func:`check_no_unregistered_function`); registration itself lives in
``_autograd_functions``.
"""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from typing import Any

import torch

from .._core.errors import Rejection, SpmdTypeError, user_source

__all__ = ["ALLOWED", "torch_transparent", "check_no_unregistered_function", "forget_last_caller", "unregistered_error",
           "watch_apply_output", "check_apply_outputs", "WATCHED"]

# Function classes whose forward may run on typed tensors: registered ones, and the package's own.
ALLOWED: dict[type, str] = {}



# torch's own Functions whose backward is the true derivative of ordinary ops: their bodies are checked
# op by op (re-running ops on simulated ranks; identity with module backward hooks; checkpoint recomputation;
# the identities FSDP2 and DDP put on a module's activations to run their hooks when backward reaches them,
# whose communication is on the parameters, never on the activations' gradients).
_TORCH_TRANSPARENT = frozenset({
    "torch.distributed._local_tensor._LocalContiguous",
    "torch.nn.modules._functions.BackwardHookFunction",
    "torch.utils.checkpoint.CheckpointFunction",
    "torch.distributed.fsdp._fully_shard._fsdp_state.RegisterPreBackwardFunction",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction",
    "torch.nn.parallel.distributed._DDPSink",
})


class _LastCaller(threading.local):
    """The code frame whose op was checked last, and the answer: its next op needs no new search."""

    frame: Any = None
    inside = False


_LAST = _LastCaller()
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def check_no_unregistered_function() -> bool:
    """Raise if an unregistered custom Function's forward is running (call only with grad mode off).

    Every Function forward on the stack counts, not just the innermost: a
    transparent Function (its body checked op by op) may run inside an
    unregistered one. Returns whether any Function's forward is on the stack
    (False: the op runs in ``apply`` itself, or in user code with both
    gradient modes off).

    Called by the op's ``__torch_function__`` (or operator), whose caller is the code running the op. A
    running frame's callers stay what they are until it returns, so the next op of the same frame (a
    transparent Function's forward runs several) reuses the answer; the frame is held until another one
    is checked or :func:`forget_last_caller` runs (the end of ``typecheck()``). A generator's or
    coroutine's frame can resume under other callers: it is searched every time.
    """
    caller = sys._getframe(2)
    if caller is _LAST.frame:
        return _LAST.inside
    inside = _search(sys._getframe(1))
    if not caller.f_code.co_flags & _SUSPENDABLE:
        _LAST.frame, _LAST.inside = caller, inside
    return inside


def forget_last_caller() -> None:
    """Drop the frame :func:`check_no_unregistered_function` holds (its locals are freed with it)."""
    _LAST.frame = None


def _search(frame: Any) -> bool:
    inside = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code not in _NOT_FORWARDS:
            for cls in _function_classes(frame):
                inside = True
                if cls not in ALLOWED and not _own(cls) and not torch_transparent(cls):
                    raise unregistered_error(cls, _caller_line(frame))
        frame = frame.f_back
    return inside


class _Watched(threading.local):
    def __init__(self) -> None:
        self.outputs: list[tuple[Any, str | None]] = []


WATCHED = _Watched()


def watch_apply_output(out: Any) -> Any:
    """Remember an alias ``apply`` made of a typed input outside any forward (see the module docstring)."""
    if isinstance(out, torch.Tensor):
        found = user_source(sys._getframe(1))
        WATCHED.outputs.append((weakref.ref(out), found[0] if found else None))
    return out


def check_apply_outputs() -> None:
    """Refuse the watched aliases whose ``grad_fn`` belongs to an unregistered Function; forget them all."""
    watched, WATCHED.outputs = WATCHED.outputs, []
    for ref, line in watched:
        out = ref()
        grad_fn = None if out is None else out.grad_fn
        cls = getattr(type(grad_fn), "_forward_cls", None)
        if isinstance(cls, type) and cls not in ALLOWED and not _own(cls) and not torch_transparent(cls):
            raise unregistered_error(cls, line)


def _function_classes(frame: Any) -> tuple[type, ...]:
    """The Function class(es) whose ``forward`` this frame runs; () when it is no Function's forward."""
    code = frame.f_code
    if code.co_argcount:
        ctx = frame.f_locals.get(code.co_varnames[0])
        cls = getattr(type(ctx), "_forward_cls", None)
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            return (cls,)
    classes = _FORWARDS.get(code)
    if classes is None:
        _index_forwards()
        classes = _FORWARDS.get(code)
        if classes is None:
            _NOT_FORWARDS.add(code)  # a module's forward, say: never looked up again
            return ()
    # A forward inherited by several classes, none of them with ctx: refused only when none is allowed.
    if any(c in ALLOWED or _own(c) or torch_transparent(c) for c in classes):
        return ()
    return classes[:1]


# forward's code object -> the Function classes that run it (built from Function's subclasses when a
# forward frame is not found in it; a class defined later is found at the next miss)
_FORWARDS: dict[Any, tuple[type, ...]] = {}
_NOT_FORWARDS: set[Any] = set()


def _index_forwards() -> None:
    seen: set[type] = set()
    todo = [torch.autograd.Function]
    found: dict[Any, tuple[type, ...]] = {}
    while todo:
        cls = todo.pop()
        for sub in type.__subclasses__(cls):
            if sub in seen:
                continue
            seen.add(sub)
            todo.append(sub)
            fn = getattr(sub, "forward", None)
            while hasattr(fn, "__wrapped__"):  # a decorated forward: its own body's frame is the one seen
                fn = fn.__wrapped__
            code = getattr(fn, "__code__", None)
            if code is not None:
                found[code] = found.get(code, ()) + (sub,)
    _FORWARDS.clear()
    _FORWARDS.update(found)
    _NOT_FORWARDS.difference_update(found)


def _own(cls: type) -> bool:
    """The package's own Functions (the typed ops, the DTensor bridge): their forwards run on plain aliases.

    Only a reader of metadata sees the typed base of such an alias (torch.compile's frame
    conversion reads ``x._base``); that read is answered by the tensor layer, never refused here.
    """
    return cls.__module__.startswith(_PACKAGE)


_PACKAGE = __name__.split(".", 1)[0] + "."


def torch_transparent(cls: type) -> bool:
    return f"{cls.__module__}.{cls.__qualname__}" in _TORCH_TRANSPARENT


def _caller_line(forward_frame: Any) -> str | None:
    """The user's line that called ``cls.apply(...)`` (outside spmd_types and torch)."""
    found = user_source(forward_frame.f_back)
    return found[0] if found else None


def unregistered_error(cls: type, source: str | None) -> SpmdTypeError:
    name = f"{cls.__module__}.{cls.__qualname__}"
    return SpmdTypeError(
        Rejection(
            f"The custom autograd Function {cls.__name__} is applied to typed tensors, but it is not "
            "registered: its backward is written by hand, so its forward ops do not say what its backward "
            "communicates, and typing it from the forward alone could hide a wrong gradient.",
            [("function", name)],
            [
                f"spmd.register_autograd_function({cls.__name__}, local=True)  # no communication in "
                "forward or backward",
                f"spmd.register_autograd_function({cls.__name__}, op='all_reduce', axis='tp', src=spmd.P, "
                "dst=spmd.R)  # behaves like that spmd call",
                f"spmd.register_autograd_function({cls.__name__}, rule=lambda *types: ...)  # output types "
                "from input types",
            ],
            notes=["check a registration in your tests with spmd.testing.verify_registration"],
        ),
        source,
    )
