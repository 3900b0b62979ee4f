"""The erased path: a typed-communication call on a plain tensor outside ``typecheck()``, at the cost of one lookup.

The first such call runs the full path (``call.py``'s checks, then the op's Function) and is remembered
here; the next call with the same key (its arguments, the input's dtype, its shape where a check reads
it, the current mesh) runs the remembered call directly, through the op's Function below its Python
wrapper, with the backward's dual already resolved. A hit is exactly what the full path would run
(``tests/test_erased_cache.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._core.mesh import _MESHES, current_mesh
from .._core.state import STATE
from .call import (
    _APPLY,
    _FUNCTIONS,
    _PARAMETER,
    _PRE_REDUCE,
    _TENSOR,
    Call,
    _below_autograd,
    _compiling,
    _functorch_active,
    _grad_enabled,
    _unwrap_if_dead,
    _with_casts,
    dual,
)
from .dtypes import REDUCED, backward_reduces
from .kernels import KERNELS, is_alias

__all__ = ["Erased", "erased", "remember_erased"]


class Erased(NamedTuple):
    """An erased call, checked once by the full path: what the next call with the same key runs directly.

    The key holds everything the full path's checks read (the op's arguments, the input's dtype, shape
    where a check reads it, the current mesh), so a hit runs exactly the call the full path would make.
    """

    call: Call
    function: type[torch.autograd.Function]
    apply: Any  # the Function's apply below its Python wrapper (what the wrapper runs when no transform is active)
    kernel: Any
    alias: bool  # the forward kernel is an alias of its input (reinterpret, convert R <-> I)
    back: Call | None  # the dual, resolved (None: resolved per gradient, as the full path does)
    back_kernel: Any
    back_alias: bool  # the dual's kernel is an alias of the gradient
    back_dtype: torch.dtype | None  # backward_options={"op_dtype": d}: the resolved dual serves gradients in d


# (args, dtype, backward op_dtype, mesh) -> the call; or _BY_SHAPE, and (args, shape, dtype, ...) -> the call
_ERASED: dict[tuple, Any] = {}
_ERASED_LIMIT = 4096  # distinct keys kept; past it the cache starts again (shapes that never repeat)
_BY_SHAPE = object()


def _shape_free(call: Call) -> bool:
    """Whether the full path's checks and call are the same for every input shape (no dim, no split checked)."""
    if getattr(call.src, "dim", None) is not None or getattr(call.dst, "dim", None) is not None:
        return False
    return call.op in ("reinterpret", "all_reduce") or (call.op == "convert" and not call.dst.is_varying)


def erased(x: Any, args: tuple, op_dtype: Any, out_dtype: Any, backward_options: Any) -> torch.Tensor | None:
    """The result of a call on ``x`` with ``args`` that the full path ran before (``remember_erased``), or None.

    None also when the call is not erased: checking on, ``x`` not a plain tensor or parameter, torch.compile
    tracing, or a dtype option other than ``backward_options={"op_dtype": d}`` (what torchtitan passes on
    every redistribute). Kept to the fewest steps: it is every erased call's cost.
    """
    if op_dtype is not None or out_dtype is not None or STATE.checking:
        return None
    tp = type(x)
    if tp is not _TENSOR and tp is not _PARAMETER:
        return None
    back_dtype = None if backward_options is None else _backward_op_dtype(backward_options)
    if back_dtype is False or _compiling():
        return None
    top = _MESHES.top
    mesh = None if top is None else top._token
    try:
        fast = _ERASED.get((args, x.dtype, back_dtype, mesh))
    except TypeError:  # an unhashable argument (a list of axes, a wrong value): the full path says what is wrong
        return None
    if fast is _BY_SHAPE:
        fast = _ERASED.get((args, x.shape, x.dtype, back_dtype, mesh))
    if fast is None:
        return None
    call = fast.call
    if x.requires_grad and _grad_enabled():
        if _functorch_active():
            return fast.function.apply(x, call, fast)
        return fast.apply(_unwrap_if_dead(x), call, fast)  # Function.apply without its Python wrapper
    return _below_autograd(fast.kernel if call.dtypes is None else _with_casts(fast.kernel, call), x, call)


def _backward_op_dtype(backward_options: Any) -> torch.dtype | bool:
    """d for ``backward_options={"op_dtype": d}``, the one form the erased path takes; False for any other."""
    if type(backward_options) is not dict or len(backward_options) != 1:
        return False
    d = backward_options.get("op_dtype")
    return d if type(d) is torch.dtype else False


def remember_erased(x: Any, args: tuple | None, op_dtype: Any, out_dtype: Any, backward_options: Any,
                    call: Call) -> None:
    """Remember ``call``, which the full path built and ran on ``x``, unless a later hit could differ from it."""
    if (args is None or op_dtype is not None or out_dtype is not None or STATE.checking or _compiling()
            or (type(x) is not _TENSOR and type(x) is not _PARAMETER)):
        return
    back_dtype = None if backward_options is None else _backward_op_dtype(backward_options)
    if back_dtype is False or (call.src.is_varying and call.op in _PRE_REDUCE):
        return  # src=V on a reduction runs two calls: left to the full path
    in_dtype = x.dtype
    if call.dtypes is None:
        if in_dtype in REDUCED and backward_reduces(call.op, call.src, call.dst):
            return  # a narrow input is refused when it needs a gradient: checked per call by the full path
    elif back_dtype is None or call.dtypes.op is not None or call.dtypes.out is not None:
        return
    else:  # the plan of backward_options={"op_dtype": d}: no cast forward; keep our own copy of the options
        call = call._replace(dtypes=call.dtypes._replace(backward={"op_dtype": back_dtype}))
    back = dual(call)
    if back.src.is_varying and back.op in _PRE_REDUCE:
        back = None
    elif back_dtype is not None and back_dtype is not in_dtype:
        back = None  # the dual casts: resolved per gradient
    if len(_ERASED) >= _ERASED_LIMIT:
        _ERASED.clear()
    mesh = current_mesh()
    key = (args, in_dtype, back_dtype, None if mesh is None else mesh.token)
    try:
        if not _shape_free(call):
            _ERASED[key] = _BY_SHAPE
            key = (args, x.shape, *key[1:])
        _ERASED[key] = Erased(call, _FUNCTIONS[call.op], _APPLY[call.op], KERNELS[call.op], is_alias(call), back,
                              None if back is None else KERNELS[back.op], back is not None and is_alias(back),
                              back_dtype)
    except TypeError:  # an unhashable argument
        pass
