"""Low-precision communication: ``op_dtype``, ``out_dtype`` and ``backward_options`` on every typed op.

A call casts its input to ``op_dtype``, runs the op in it (a reduction sums in
``op_dtype``), and casts the result to ``out_dtype``. ``backward_options``
holds the same three options for the op the backward runs (seed 003's dual,
from ``_local/transitions.py``); unless it says otherwise that op runs in the
gradient's dtype and hands the gradient back in the input's dtype. These are
the call shapes and the meaning of meta-pytorch's spmd-types 0.2.3, which
torchtitan calls (``backward_options={"op_dtype": x.dtype}`` on every
``redistribute``).

One rule guards the precision of gradients: a call in reduced precision (an
``op_dtype``, an ``out_dtype`` or the input itself narrower than 32 bits) whose
backward reduces (``all_reduce(dst=R)``, ``all_gather(dst=R)``, ``convert`` and
``reinterpret`` from I to R or V: read from the table) must say
``backward_options={"op_dtype": ...}``, so a gradient is never summed in bf16
by accident (FSDP gathers in bf16 and reduce-scatters gradients in fp32).

Everything is checked here, before any communication; :func:`plan` returns
None when the call casts nothing, so the common call pays a few attribute
reads.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import torch

from .._checker.tensor import _DisableTF
from .._core.types import P, R, SpmdType, V, base_type
from .._local.transitions import TRANSITIONS, backward_of

__all__ = ["DtypePlan", "plan", "for_call", "backward_plan", "backward_reduces", "casting", "KEYS", "REDUCED"]

KEYS = ("op_dtype", "out_dtype", "backward_options")
_REDUCTIONS = ("all_reduce", "reduce_scatter")

# Narrower than 32 bits: what "reduced precision" means for the rule above.
REDUCED = _REDUCED = frozenset(
    d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and ((d.is_floating_point and d.itemsize < 4) or (d.is_complex and d.itemsize < 8))
)

# (op, src, dst) rows whose backward sums the gradient over ranks, read from the table.
_BACKWARD_REDUCES = frozenset((t.op, t.src, t.dst) for t in TRANSITIONS if t.backward[0] in _REDUCTIONS)

# Rows that keep the input's precision when only out_dtype is given: a reduction sums at the input's
# precision and rounds once at the end; a slice (convert R/I -> V) is cast after it is cut, which is cheaper.
# Every other op moves or places values exactly, so it runs in the narrower of the two dtypes (less traffic).
_KEEPS_INPUT = frozenset((t.op, t.src, t.dst) for t in TRANSITIONS if t.comm in _REDUCTIONS or (
    t.op == "convert" and t.dst is V))


class DtypePlan(NamedTuple):
    """What one call casts: ``op`` before the op, ``out`` after it (None: no cast), and its backward's options."""

    op: torch.dtype | None
    out: torch.dtype | None
    backward: Mapping[str, Any]  # the backward call's options, checked
    src_dtype: torch.dtype  # the input's dtype: the gradient's dtype unless ``backward`` says out_dtype


def _key(op: str, src: SpmdType, dst: SpmdType) -> tuple[str, SpmdType, SpmdType]:
    src, dst = base_type(src), base_type(dst)
    if op in _REDUCTIONS and src is V:  # src=V on a reduction is reinterpret(V, P) first (CONTRACT 4)
        src = P
    return op, src, dst


def backward_reduces(op: str, src: SpmdType, dst: SpmdType) -> bool:
    """Whether the backward of ``op(src -> dst)`` sums the gradient over ranks (an all-reduce or reduce-scatter)."""
    return _key(op, src, dst) in _BACKWARD_REDUCES


def plan(
    opname: str, comm: Any, op: str, src: SpmdType, dst: SpmdType, x: torch.Tensor,
    op_dtype: Any, out_dtype: Any, backward_options: Any, *, reduces_back: bool | None = None,
    keeps_input: bool | None = None, nested: bool = False,
) -> DtypePlan | None:
    """Check a call's dtype options and resolve them; None when the call casts nothing and passes no options.

    ``reduces_back`` / ``keeps_input`` override the table for ops outside it (``all_reduce(op="max")``);
    ``nested`` marks the call a backward runs (its options sit one level down). Raises before any communication.
    """
    in_dtype, requires_grad = _facts(x)
    if op_dtype is None and out_dtype is None and backward_options is None:
        if in_dtype not in _REDUCED or not (requires_grad and torch.is_grad_enabled()):
            return None  # the hot path: nothing to cast, nothing to check
        if not (backward_reduces(op, src, dst) if reduces_back is None else reduces_back):
            return None
        raise ValueError(_missing_backward_op_dtype(opname, comm, op, src, dst, in_dtype, None, None, nested))
    op_dtype = _dtype(opname, "op_dtype", op_dtype)
    out_dtype = _dtype(opname, "out_dtype", out_dtype)
    backward = _backward_options(opname, "backward_options", backward_options)
    if requires_grad and torch.is_grad_enabled():
        _check_differentiable(opname, in_dtype, op_dtype, out_dtype)
        if "op_dtype" not in backward and (backward_reduces(op, src, dst) if reduces_back is None else reduces_back):
            if any(d is not None and d in _REDUCED for d in (op_dtype, out_dtype, in_dtype)):
                raise ValueError(
                    _missing_backward_op_dtype(opname, comm, op, src, dst, in_dtype, op_dtype, out_dtype, nested))
    keeps = (_key(op, src, dst) in _KEEPS_INPUT) if keeps_input is None else keeps_input
    op_d, out_d = _resolve(op_dtype, out_dtype, keeps, in_dtype)
    return DtypePlan(None if op_d == in_dtype else op_d, None if out_d == op_d else out_d, backward, in_dtype)


def _facts(x: torch.Tensor) -> tuple[torch.dtype, bool]:
    """``x``'s dtype and requires_grad, without a typed tensor's ``__torch_function__`` (microseconds a read)."""
    if type(x) is torch.Tensor:
        return x.dtype, x.requires_grad
    with _DisableTF():
        return x.dtype, x.requires_grad


def for_call(begun: Any, op: str, x: torch.Tensor, op_dtype: Any, out_dtype: Any, backward_options: Any,
             **overrides: Any) -> DtypePlan | None:
    """:func:`plan` for a begun call (``_comm.call.Begun``: its opname, axis and types)."""
    return plan(begun.opname, begun.comm, op, begun.src, begun.dst, x, op_dtype, out_dtype, backward_options,
                **overrides)


def backward_plan(fwd: DtypePlan, comm: Any, op: str, src: SpmdType, dst: SpmdType,
                  g: torch.Tensor) -> DtypePlan | None:
    """The plan of the backward call ``op(src -> dst)`` on gradient ``g``, from the forward's ``backward_options``.

    Its default ``out_dtype`` is the forward input's dtype. When ``g`` itself
    needs a gradient (a double backward), the backward call is checked like a
    forward one: its own backward may reduce.
    """
    bw = fwd.backward
    return plan(f"spmd.{op}", comm, op, src, dst, g, bw.get("op_dtype"), bw.get("out_dtype", fwd.src_dtype),
                bw.get("backward_options", {}), nested=True)


def _resolve(op_dtype: torch.dtype | None, out_dtype: torch.dtype | None, keeps_input: bool,
             in_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype the op runs in, the result's dtype). ``op_dtype`` alone sets both."""
    if op_dtype is not None:
        return op_dtype, out_dtype if out_dtype is not None else op_dtype
    if out_dtype is None:
        return in_dtype, in_dtype
    if keeps_input or out_dtype.itemsize >= in_dtype.itemsize:
        return in_dtype, out_dtype
    return out_dtype, out_dtype


def casting(kernel: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """``kernel`` wrapped in its call's casts: to ``op`` before, to ``out`` after (one wrapper per kernel)."""
    found = _CASTING.get(kernel)
    if found is None:
        def cast_run(x: torch.Tensor, call: Any) -> torch.Tensor:
            p = call.dtypes
            if p.op is not None:
                x = x.to(p.op)
            out = kernel(x, call)
            return out if p.out is None else out.to(p.out)

        found = _CASTING[kernel] = cast_run
    return found


_CASTING: dict[Callable, Callable] = {}


# ---------------------------------------------------------------------------
# checks (every message lives here)


def _dtype(opname: str, what: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    raise TypeError(
        f"{opname}: {what}= takes a torch.dtype such as torch.bfloat16 or torch.float32, "
        f"got {value!r} of type {type(value).__name__}"
    )


def _backward_options(opname: str, what: str, value: Any) -> Mapping[str, Any]:
    """``value`` checked to the bottom (nested ``backward_options`` included), so nothing fails mid-backward.

    The common case (a dict of floating dtypes) costs a loop over its keys; messages are built only on failure.
    """
    if value is None:
        return _NO_OPTIONS
    if type(value) is not dict and not isinstance(value, Mapping):
        raise TypeError(
            f"{opname}: {what}= takes a dict such as {{'op_dtype': torch.float32}}, got {value!r} of type "
            f"{type(value).__name__}"
        )
    for key, v in value.items():
        if key == "op_dtype" or key == "out_dtype":
            if v is not None and not (isinstance(v, torch.dtype) and (v.is_floating_point or v.is_complex)):
                _bad_backward_dtype(opname, f"{what}['{key}']", v)
        elif key == "backward_options":
            _backward_options(opname, f"{what}['backward_options']", v)
        else:
            unknown = ", ".join(repr(k) for k in value if k not in KEYS)
            raise ValueError(
                f"{opname}: {what} takes the keys 'op_dtype', 'out_dtype' and 'backward_options' (the options of "
                f"the call the backward runs), got {unknown}. Dims and sizes follow from the forward call."
            )
    return value


_NO_OPTIONS: Mapping[str, Any] = {}


def _bad_backward_dtype(opname: str, what: str, value: Any) -> None:
    d = _dtype(opname, what, value)  # raises for a value that is no dtype at all
    raise TypeError(f"{opname}: {what}={d} is not a floating-point dtype, and gradients are; use torch.float32 or "
                    "torch.bfloat16")


def _check_differentiable(opname: str, in_dtype: torch.dtype, op_dtype: torch.dtype | None,
                          out_dtype: torch.dtype | None) -> None:
    """A cast to an integer dtype would cut the gradient of an input that needs one: refuse it."""
    for what, d in (("op_dtype", op_dtype), ("out_dtype", out_dtype)):
        if d is not None and not (d.is_floating_point or d.is_complex) and (in_dtype.is_floating_point
                                                                              or in_dtype.is_complex):
            raise TypeError(
                f"{opname}: {what}={d} is not a floating-point dtype, so the result could not carry the gradient "
                "of x, which requires grad. Use a floating dtype (torch.bfloat16, torch.float32), or pass "
                "x.detach() (or run under torch.no_grad()) for data that needs no gradient."
            )


def _missing_backward_op_dtype(opname: str, comm: Any, op: str, src: SpmdType, dst: SpmdType, in_dtype: torch.dtype,
                               op_dtype: torch.dtype | None, out_dtype: torch.dtype | None, nested: bool) -> str:
    seen = [f"{w}={d}" for w, d in (("op_dtype", op_dtype), ("out_dtype", out_dtype)) if d is not None and d in _REDUCED]
    if in_dtype in _REDUCED:
        seen.append(f"x is {in_dtype}")
    back = _backward_name(op, src, dst)
    narrow = next(d for d in (op_dtype, out_dtype, in_dtype) if d is not None and d in _REDUCED)
    if nested:  # the backward's own call, in a double backward: its options are the forward's, one level down
        call_text = f"the backward's {opname}(g, {comm.label}, src={src.code()}, dst={dst.code()})"
        fix = "backward_options={{..., 'backward_options': {{'op_dtype': {}}}}}"
        seen = [s.replace("x is", "the gradient is") for s in seen]
    else:
        call_text = f"{opname}(x, {comm.label}, src={src.code()}, dst={dst.code()})"
        fix = "backward_options={{'op_dtype': {}}}"
    return (
        f"{call_text}: a call in reduced precision whose backward sums the gradient over ranks must say the dtype "
        f"of that sum with backward_options={{'op_dtype': ...}}. Seen: {', '.join(seen)}, and the backward is "
        f"{back}. Fix: {fix.format('torch.float32')} (FSDP's norm: bf16 all-gather, fp32 reduce-scatter), or "
        f"{fix.format(narrow)} to sum in {narrow} on purpose."
    )


def _backward_name(op: str, src: SpmdType, dst: SpmdType) -> str:
    key = _key(op, src, dst)
    if key in _BACKWARD_REDUCES:
        bop, bsrc, bdst = backward_of(*key)
        return f"{bop}(src={bsrc}, dst={bdst})"
    return f"all_reduce(src={P}, dst={R})"  # all_reduce(op="max"|"min", dst=R): the pending gradient is summed
