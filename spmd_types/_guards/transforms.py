"""torch.vmap, the other torch.func transforms and torch.compile meeting typed tensors: one clear error each.

A transform hands its function functorch's own wrapped tensors (batched, or
tracking gradients), plain tensors that cannot carry a type, and unwraps the
results into plain tensors: the types would silently disappear. So inside
:func:`spmd_types.typecheck` the package refuses, at the two places it can see:

* ``torch.vmap(f)(x)`` with a typed ``x``: vmap reads ``x.dim()`` while it
  sets up the batch; the tensor layer asks :func:`vmap_setup_caller` only for
  that metadata call (a frame lookup, nothing on any other op);
* a typed tensor meeting a transform's wrapped tensor inside ``f`` (a typed
  value closed over): the operand is marked by :func:`is_transform_tensor`,
  which makes the op a cache miss, and the slow path raises.

The fix is :func:`spmd_types.no_typecheck` with declared types around the
transform: the types go in and come out at its edges.

``torch.compile`` does not trace the checker (thread-local state, classes
swapped in place): dynamo would fail inside the package with an internal
error, or trace a typed op without its check. Dynamo reads the metadata of
every tensor it is handed (its inputs, a module's parameters) before it
traces a line; the tensor layer asks :func:`compiling` on metadata calls only
and raises :func:`compile_error`, an ``SpmdTypeError`` that dynamo lets
through unwrapped with ``fullgraph=True``; without it, dynamo runs that call
eagerly (checked). Erased code (plain tensors, checking off) compiles as
before.
"""

from __future__ import annotations

import sys

import torch

from .._core.errors import Rejection, SpmdTypeError, user_source_line

__all__ = [
    "vmap_setup_caller", "is_transform_tensor", "transform_error", "compiling", "compile_error",
    "forget_refused_frames",
]

compiling = torch.compiler.is_compiling

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_SETUP = "_process_batched_inputs"


def vmap_setup_caller(depth: int = 2) -> bool:
    """True when the frame ``depth`` levels up is torch.vmap setting up its batched inputs."""
    frame = sys._getframe(depth)
    return frame.f_code.co_name == _SETUP and frame.f_code.co_filename.endswith("vmap.py")


def is_transform_tensor(t: torch.Tensor) -> bool:
    """True for functorch's wrapped tensors (vmap's batched, grad's tracking tensors)."""
    return _is_wrapped(t)


def transform_error(shown: str) -> SpmdTypeError:
    return SpmdTypeError(
        Rejection(
            "torch.vmap and the other torch.func transforms cannot carry SPMD types: they hand their function "
            "plain wrapped tensors and return plain tensors, so the types would be silently dropped.",
            [("operand", shown)],
            ["spmd.no_typecheck(torch.vmap(f), in_types=[...], out_types=...)(x)"],
            notes=["the batch dim is local: declare the types f gives one slice, for the whole batch"],
        ),
        user_source_line(),
    )


_COMPILE_ERROR: type | None = None
# Frames refused for typed tensors, whose eager fallback dynamo remembers on the code object (see compile_error).
_REFUSED_CODES: set = set()


def compile_error(shown: str) -> SpmdTypeError:
    """The one error for typed tensors reaching torch.compile (dynamo re-raises its UserError unwrapped).

    With ``fullgraph=True`` it reaches the user. Without, dynamo runs the refused
    frame eagerly, so typed code runs checked; the error asks dynamo to run every
    frame that call makes eagerly too (its own and the package's: no piece of a
    typed program is compiled apart) and to try the frame again next call.
    Dynamo keeps that request on the code object, so :func:`forget_refused_frames`
    hands the code back when checking ends: the erased program then compiles whole.
    """
    global _COMPILE_ERROR
    if _COMPILE_ERROR is None:
        _COMPILE_ERROR = _make_compile_error_class()
    _remember_refused_frame()
    return _COMPILE_ERROR(
        Rejection(
            "torch.compile cannot trace typed tensors: the checker runs in Python beside each op and is not "
            "traced, so a compiled typed program would be either refused by dynamo or run unchecked.",
            [("tensor", shown)],
            ["check the program eagerly inside spmd.typecheck(), then compile the erased program: the same code "
             "on plain tensors, outside spmd.typecheck() (every spmd call compiles as its collective)"],
        ),
        user_source_line(),
    )


def _make_compile_error_class() -> type:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._dynamo.exc import UserError, UserErrorType

    eager_this_call = _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.SKIP)

    class SpmdCompileError(SpmdTypeError, UserError):
        """Typed tensors under torch.compile: an SpmdTypeError that dynamo passes through."""

        def __init__(self, rejection: Rejection, source: str | None) -> None:
            SpmdTypeError.__init__(self, rejection, source)
            # the fields dynamo reads on a UserError it passes through
            self._torch_dynamo_tracer_output = None
            self.frame_exec_strategy = eager_this_call
            self.real_stack = torch._guards.TracingContext.extract_stack()
            self.skip_frame, self.logged = False, False
            self.error_type = UserErrorType.INVALID_INPUT
            self.msg = self.message = self.plain

        def __reduce__(self):
            return (SpmdTypeError, (Rejection(self.rule, self.seen, self.fixes, self.notes), self.source))

    SpmdCompileError.__module__ = "spmd_types"
    SpmdCompileError.__qualname__ = "SpmdCompileError"
    return SpmdCompileError


def _remember_refused_frame() -> None:
    from torch._dynamo.symbolic_convert import tls

    code = getattr(getattr(tls, "current_tx", None), "f_code", None)  # the frame dynamo is converting
    if code is not None:
        _REFUSED_CODES.add(code)


def forget_refused_frames() -> None:
    """Let dynamo compile the frames it ran eagerly for typed tensors again (called when checking ends)."""
    if not _REFUSED_CODES:
        return
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    fresh = _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT)
    while _REFUSED_CODES:
        set_code_exec_strategy(_REFUSED_CODES.pop(), fresh)


def refuse_compile() -> None:
    """Raise :func:`compile_error` from code dynamo traces (it calls a function marked constant eagerly).

    For ``spmd.assert_type`` inside a compiled function under ``typecheck()``.
    """
    raise compile_error("a tensor given its type inside the compiled function (spmd.assert_type)")


refuse_compile._dynamo_marked_constant = True  # type: ignore[attr-defined]  # torch._dynamo.assume_constant_result
