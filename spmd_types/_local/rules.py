"""Per-axis type inference for ordinary torch ops, driven by the rules table.

One function, :func:`infer`, reads an op's row (``_rules_table``), binds the
call's arguments to the row's parameters, and runs one per-axis rule over the
op's algebra (a sum of products of its linear arguments, plus non-linear
arguments). A failed check returns a :class:`Rejection`; the tensor layer
turns it into an ``SpmdTypeError`` with the user's source line.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from .._core.errors import Rejection
from .._core.mesh import current_mesh
from .._core.spaces import move_types
from .._core.state import BY_GRADIENT, BY_MESH, mark_uncacheable
from .._core.types import I, P, R, SpmdType, TypeMap, V
from .._torch.private import is_fwd_grad_enabled
from .op_registry import OpEntry
from .rules_table import RuleKind

__all__ = ["Operand", "infer", "WEAK", "backward_possible"]


class _Weak:
    """A plain tensor or Python number: no type of its own (see docs/rules.md)."""

    def __repr__(self) -> str:
        return "untyped"


WEAK = _Weak()


@dataclass
class Operand:
    label: str
    types: TypeMap | _Weak
    is_tensor: bool
    zero: bool = False  # a Python number equal to 0, or a buffer of zeros (see infer's zero_buffer)
    grad: bool = False  # can carry a gradient: a tensor that requires grad, with grad mode on

    def on(self, axis: str) -> SpmdType | None:
        t = self.types
        if t is WEAK:
            return None
        found = t.get(axis)  # type: ignore[union-attr]
        return found

    def shown(self) -> str:
        if self.types is WEAK:
            if self.is_tensor and self.zero:
                return "all zeros (takes the written values' type)"
            return "plain tensor (untyped)" if self.is_tensor else "Python number"
        return self.types.format()  # type: ignore[union-attr]


def types_of(x: Any) -> TypeMap | None:
    return getattr(x, "_spmd_types", None) if isinstance(x, torch.Tensor) else None


def _operand(label: str, value: Any) -> Operand | None:
    if isinstance(value, torch.Tensor):
        t = types_of(value)
        return Operand(label, t if t is not None else WEAK, True, grad=value.requires_grad and backward_possible())
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return Operand(label, WEAK, False, _is_zero(value))
    return None


def backward_possible() -> bool:
    """Grad mode on, or off only because a custom Function's forward runs (forward-mode AD off too).

    A registered ``transparent=True`` Function (activation checkpointing) runs
    its forward with grad mode off, yet its backward differentiates that code.
    """
    return torch.is_grad_enabled() or not is_fwd_grad_enabled()


def _is_zero(value: Any) -> bool:
    # Only plain int/float zeros count: the tensor layer's result cache tells exactly these apart.
    return value is None or (type(value) in (int, float) and value == 0)


def _bind(entry: OpEntry, args: Sequence[Any], kwargs: dict[str, Any], zero_buffer: bool) -> dict[str, list[Operand]]:
    """Map each parameter name to the operands passed for it (lists expanded).

    With ``zero_buffer``, the row's ``zero_buffer`` operand is a weak zero: it
    holds only zeros, so it adds nothing and takes the other operands' type.
    """
    params = entry.row.params
    bound: dict[str, list[Operand]] = {}
    raw: list[tuple[str, Any]] = []
    star = next((i for i, p in enumerate(params) if p.startswith("*")), None)
    for i, a in enumerate(args):
        if star is not None and i >= star:
            name = params[star]
        else:
            name = params[i] if i < len(params) else f"arg{i}"
        raw.append((name, a))
    # out= is where the result goes, not an operand: the tensor layer checks it against the result.
    raw.extend((k, v) for k, v in kwargs.items() if k != "out")
    counts: dict[str, int] = {}
    for name, value in raw:
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            items = [(f"{name.lstrip('*')}[{j}]", v) for j, v in enumerate(value)]
        elif name.startswith("*"):
            j = counts.get(name, 0)
            counts[name] = j + 1
            items = [(f"{name.lstrip('*')}[{j}]", value)]
        else:
            items = [(name, value)]
        for label, v in items:
            op = _operand(label, v)
            if op is not None:
                if zero_buffer and name == entry.row.zero_buffer and op.is_tensor:
                    op = Operand(label, WEAK, True, zero=True)
                bound.setdefault(name, []).append(op)
    return bound


def _structure(entry: OpEntry, bound: dict[str, list[Operand]], linear_here: bool):
    """Split operands into linear terms (each a list of factors) and non-linear operands."""
    row = entry.row
    in_terms: set[str] = set()
    terms: list[list[Operand]] = []
    linear = linear_here and row.kind in (RuleKind.LINEAR, RuleKind.MULTILINEAR)
    if linear:
        for group in row.terms:
            in_terms.update(group)
            factors = [op for name in group for op in bound.get(name, ())]
            if not factors:
                continue
            if row.kind is RuleKind.LINEAR:
                terms.extend([op] for op in factors)
            else:
                terms.append(factors)
    others = [
        op for name, ops in bound.items() if name not in in_terms and name not in row.ignored for op in ops
    ]
    return terms, others


def _fill_is_zero(entry: OpEntry, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    name = entry.row.linear_if_zero
    if name is None:
        return True
    if name in kwargs:
        return _is_zero(kwargs[name])
    idx = entry.row.params.index(name)
    if idx < len(args):
        return _is_zero(args[idx])
    # No fill value given: F.pad pads with zero, but ones_like / rand_like fill with non-zero values.
    return entry.row.kind is not RuleKind.FACTORY


def _mode_is_linear(entry: OpEntry, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """The row's ``linear_if`` argument (scatter's ``reduce=``) has a value for which the op is linear."""
    if entry.row.linear_if is None:
        return True
    name, allowed = entry.row.linear_if
    params = entry.row.params
    if name in kwargs:
        value = kwargs[name]
    elif name in params and params.index(name) < len(args):
        value = args[params.index(name)]
    else:  # not given (scatter's reduce= is keyword-only)
        value = None
    return isinstance(value, (str, type(None))) and value in allowed


def infer(entry: OpEntry, args: Sequence[Any], kwargs: dict[str, Any], strict: bool,
          zero_buffer: bool = False) -> TypeMap | Rejection | None:
    """The output type of ``entry.func(*args, **kwargs)``, or why it is ill typed.

    Returns None when no operand is typed (the result stays a plain tensor).
    ``zero_buffer=True`` says that the row's ``zero_buffer`` tensor (the one the
    op writes into) holds only zeros and carries no gradient: the caller has
    looked, and this function reads it as a zero term of the sum.
    """
    row = entry.row
    bound = _bind(entry, args, kwargs, zero_buffer)
    operands = [op for ops in bound.values() for op in ops]
    typed = [op for op in operands if op.types is not WEAK]
    if not typed:
        return None
    if strict:
        for op in operands:
            if op.is_tensor and op.types is WEAK and not op.zero:  # a buffer of zeros is a valid value of any type
                return _strict_rejection(entry, op, typed[0])
    for op in typed:
        if op.types.pending and not _claimed_by_destination(entry, typed, op):  # type: ignore[union-attr]
            return _unclaimed(entry, op)
    moved = _onto_one_mesh(entry, typed)
    if moved is not None:
        return moved
    axes: list[str] = []
    for op in typed:
        for a in op.types.axes():  # type: ignore[union-attr]
            if a not in axes:
                axes.append(a)
    for op in typed:
        if len(op.types.items) != len(axes):  # type: ignore[union-attr]
            return _two_meshes(entry, typed, op, axes)
    if row.kind is RuleKind.NEW:
        first = typed[0].types
        return TypeMap.of(((a, R) for a, _ in first.items), first.space)  # type: ignore[union-attr]
    if row.kind in (RuleKind.PASSTHROUGH, RuleKind.FACTORY):
        first = typed[0].types
        assert isinstance(first, TypeMap)
        if row.kind is RuleKind.FACTORY and not _fill_is_zero(entry, args, kwargs):
            return TypeMap.of(((a, R if t is P else t) for a, t in first.items), first.space)
        return first
    linear_here = _fill_is_zero(entry, args, kwargs) and _mode_is_linear(entry, args, kwargs)
    terms, others = _structure(entry, bound, linear_here)
    out: list[tuple[str, SpmdType]] = []
    relaxed = False
    for axis in axes:
        result = _axis_type(entry, terms, others, operands, axis)
        if isinstance(result, Rejection) and result.rule.startswith(_I_MIX_RULE):
            again = _gradient_free(entry, terms, others, operands, axis)
            if again is not None and not isinstance(again, Rejection):
                result, relaxed = again, True
        if isinstance(result, Rejection):
            return result
        if result is not None:
            out.append((axis, result))
    if relaxed:
        # accepted only because some operands carry no gradient: cacheable by types and those operands' gradients
        mark_uncacheable(BY_GRADIENT)
    return TypeMap.of(out, next((op.types.space for op in typed if op.types.space is not None), None))


# ---------------------------------------------------------------------------
# operands typed on different presentations of the ranks (a dense and an expert mesh)


def _onto_one_mesh(entry: OpEntry, typed: list[Operand]) -> Rejection | None:
    """Move operands typed on another mesh onto the current one (``reinterpret_mesh``'s rule), or refuse.

    Only when the spaces differ; the result then depends on the current mesh too,
    so it is cached by types and the mesh (``BY_MESH``).
    """
    spaces = {op.types.space for op in typed if op.types.space is not None}  # type: ignore[union-attr]
    if len(spaces) <= 1:
        return None
    mesh = current_mesh()
    target = mesh.space if mesh is not None else typed[0].types.space  # type: ignore[union-attr]
    mark_uncacheable(BY_MESH)
    for op in typed:
        have = op.types
        if have.space is None or have.space is target:  # type: ignore[union-attr]
            continue
        found = move_types(have, target)  # type: ignore[arg-type]
        if isinstance(found, str):
            return Rejection(
                f"{entry.display} mixes tensors typed on different meshes, and {op.label} cannot be moved onto the "
                f"current mesh: {found}.",
                [("op", entry.display), ("operands", "\n".join(f"{o.label}: {o.shown()}" for o in typed)),
                 ("current mesh", ", ".join(f"{n}={r!r}" for n, r in target.pairs))],  # type: ignore[union-attr]
                [f"spmd.reinterpret_mesh({op.label}, mesh) onto a mesh over the same ranks, or type the operands "
                 "under one `spmd.set_current_mesh(mesh)`"],
            )
        op.types = found[0]
    return None


# ---------------------------------------------------------------------------
# values that carry no gradient (seed 003's I rule exists for the backward)


def _gradient_free(entry, terms, others, operands, axis):
    """The per-axis type when the I-mixing rule is relaxed for operands that carry no gradient.

    Seed 003 keeps I apart from R, V and P because the backward would hand an
    I operand a gradient that is not summed (or sum one twice). An operand
    that carries no gradient (an integer tensor, one that does not require
    grad, anything under ``torch.no_grad``) has no backward, and I and R hold
    the same data, so it may be read as the other: a gradient-free I is read
    as R; when a differentiable I operand is present, a gradient-free R is
    read as I instead (the result is I, so its gradient reaches the I operand
    whole). A gradient-free V still never meets a differentiable I.
    """
    grad_i = any(op.grad and op.on(axis) is I for op in operands)
    swap: dict[int, Operand] = {}
    for op in operands:
        if op.grad or op.types is WEAK:
            continue
        t = op.on(axis)
        new = R if (t is I and not grad_i) else I if (t is R and grad_i) else None
        if new is not None:
            swap[id(op)] = replace(op, types=op.types.replace(axis, new))  # type: ignore[union-attr]
    if not swap:
        return None

    def sub(op: Operand) -> Operand:
        return swap.get(id(op), op)

    return _axis_type(entry, [[sub(o) for o in term] for term in terms], [sub(o) for o in others],
                      [sub(o) for o in operands], axis)


# ---------------------------------------------------------------------------
# the per-axis rule


def _axis_type(entry, terms, others, operands, axis):
    term_types: list[tuple[list[Operand], SpmdType | None]] = []
    for term in terms:
        ps = [op for op in term if op.on(axis) is P]
        if len(ps) > 1:
            return _p_times_p(entry, operands, axis, ps[0], ps[1])
        if ps:
            bad = [op for op in term if op.on(axis) not in (None, P, R)]
            if bad:
                return _p_times_non_r(entry, operands, axis, ps[0], bad[0])
            term_types.append((term, P))
        else:
            term_types.append((term, None))
    p_term = next((term for term, t in term_types if t is P), None)
    if p_term is not None:
        p_op = next(op for op in p_term if op.on(axis) is P)
        for term, t in term_types:
            if t is not P and not all(op.zero for op in term):
                # adding a zero constant keeps a pending sum (where(c, p, 0), p[i] = 0)
                return _p_plus_non_p(entry, operands, axis, p_op, term)
        for op in others:
            t = op.on(axis)
            if t is P:
                return _p_nonlinear(entry, operands, axis, op)
            if t is not None and t is not R:
                return _p_with_non_r(entry, operands, axis, p_op, op)
        return P
    seen = [(op, op.on(axis)) for term in terms for op in term] + [(op, op.on(axis)) for op in others]
    seen = [(op, t) for op, t in seen if t is not None]
    for op, t in seen:
        if t is P:
            return _p_nonlinear(entry, operands, axis, op)
    invariant = [op for op, t in seen if t is I]
    other = [(op, t) for op, t in seen if t is not I]
    if invariant and other:
        return _i_mix(entry, operands, axis, invariant[0], other[0][0])
    if any(t.is_varying for _, t in seen):
        return V
    if any(t is R for _, t in seen):
        return R
    if invariant:
        return I
    return None


# ---------------------------------------------------------------------------
# rejections: the rule broken, what was seen, the fix


def _seen(entry: OpEntry, operands: Sequence[Operand], axis: str, detail: str) -> list[tuple[str, str]]:
    shown = "\n".join(f"{op.label}: {op.shown()}" for op in operands)
    return [("op", entry.display), ("operands", shown), ("axis", f"'{axis}': {detail}")]


def _call(fn: str, x: str, axis: str, src: SpmdType, dst: SpmdType) -> str:
    return f"spmd.{fn}({x}, '{axis}', src={src.code()}, dst={dst.code()})"


def _reduce_fix(label: str, axis: str) -> str:
    return _call("all_reduce", label, axis, P, R)


def _p_times_p(entry, operands, axis, a, b) -> Rejection:
    return Rejection(
        f"Partial * Partial: {entry.display} is linear in each factor separately, not in both, "
        "so at most one factor may be a pending sum (P).",
        _seen(entry, operands, axis, f"{a.label} is P and {b.label} is P"),
        [_reduce_fix(b.label, axis)],
    )


def _p_times_non_r(entry, operands, axis, p_op, other) -> Rejection:
    t = other.on(axis)
    fix = _call("convert", other.label, axis, I, R) if t is I else _reduce_fix(p_op.label, axis)
    return Rejection(
        f"A pending sum (P) can only be multiplied by a Replicate (R) value: {entry.display} "
        f"multiplies P by {t}, and a sum times a per-rank value is not the sum of the products.",
        _seen(entry, operands, axis, f"{p_op.label} is P and {other.label} is {t}"),
        [fix],
    )


def _p_plus_non_p(entry, operands, axis, p_op, term) -> Rejection:
    typed = [op for op in term if op.on(axis) is not None]
    if not typed:
        what = f"{term[0].label} is a constant"
        rule = (
            f"A pending sum (P) can only be added to another pending sum: {entry.display} adds a "
            "constant to P, and it would be added once on every rank."
        )
        fixes = [_reduce_fix(p_op.label, axis)]
    else:
        other = typed[0]
        t = other.on(axis)
        what = f"{p_op.label} is P and {other.label} is {t}"
        rule = (
            f"A pending sum (P) can only be added to another pending sum: {entry.display} adds P to "
            f"{t}, and the {t} value would be added once on every rank."
        )
        alt = {
            R: _call("convert", other.label, axis, R, P),
            I: _call("convert", other.label, axis, I, P),
        }.get(t, _call("reinterpret", other.label, axis, V, P))
        fixes = [_reduce_fix(p_op.label, axis), alt]
    return Rejection(rule, _seen(entry, operands, axis, what), fixes)


def _p_nonlinear(entry, operands, axis, op) -> Rejection:
    unknown = "" if entry.known else (
        f" ({entry.display} is not in the typing-rules table, so it is treated as non-linear.)"
    )
    return Rejection(
        f"{entry.display} is not linear in {op.label}, so {op.label} cannot be a pending sum (P)."
        + unknown,
        _seen(entry, operands, axis, f"{op.label} is P"),
        [_reduce_fix(op.label, axis)],
    )


def _p_with_non_r(entry, operands, axis, p_op, other) -> Rejection:
    t = other.on(axis)
    fix = _call("convert", other.label, axis, I, R) if t is I else _reduce_fix(p_op.label, axis)
    return Rejection(
        f"{entry.display} is linear in {p_op.label} but not in {other.label}: with a pending sum (P) "
        f"in {p_op.label}, {other.label} must be Replicate (R), and it is {t}.",
        _seen(entry, operands, axis, f"{p_op.label} is P and {other.label} is {t}"),
        [fix],
    )


_I_MIX_RULE = "Invariant (I) values only combine with other I values"


def _i_mix(entry, operands, axis, inv, other) -> Rejection:
    t = other.on(axis)
    return Rejection(
        f"{_I_MIX_RULE}: {entry.display} combines "
        f"{inv.label} (I) with {other.label} ({t}). Convert the I operand to R, so that its "
        "gradient is all-reduced in backward.",
        _seen(entry, operands, axis, f"{inv.label} is I and {other.label} is {t}"),
        [_call("convert", inv.label, axis, I, R)],
    )


def _claimed_by_destination(entry: OpEntry, typed: list[Operand], op: Operand) -> bool:
    """Added in place into a tensor typed P on those axes: the destination's type is the claim."""
    if not entry.inplace or op is typed[0]:
        return False
    dest = typed[0].types
    return not dest.pending and all(dest.get(a) is P for a in op.types.pending)  # type: ignore[union-attr]


def _unclaimed(entry: OpEntry, op: Operand) -> Rejection:
    axes = sorted(op.types.pending)  # type: ignore[union-attr]
    shown = ", ".join(f"'{a}'" for a in axes)
    claim = "{" + ", ".join(f"'{a}': spmd.P" for a in axes) + "}"
    partial = "'" + axes[0] + "'" if len(axes) == 1 else "(" + ", ".join(f"'{a}'" for a in axes) + ")"
    return Rejection(
        f"Global SPMD: {op.label} sums over a sharded dim (a contraction or a reduction): it is a pending sum (P) on "
        f"{shown}, used by {entry.display} before anything claimed it. Claim it (an assert, a declared output type) "
        "or ask for it with out_partial_axes.",
        [("op", entry.display), ("operand", f"{op.label}: {op.shown()} (P on {shown} not yet claimed)")],
        [f"spmd.assert_type({op.label}, {claim}) right after it",
         f"spmd.sum / spmd.linear / spmd.matmul / spmd.einsum(..., out_partial_axes={partial})"],
    )


def _two_meshes(entry, typed, op, axes) -> Rejection:
    missing = [a for a in axes if a not in op.types]  # type: ignore[operator]
    return Rejection(
        f"{entry.display} mixes tensors typed on different meshes: {op.label} has no type on axis "
        f"{', '.join(repr(a) for a in missing)}. A type names every axis of the mesh it was given on, so "
        "these operands come from two meshes.",
        [("op", entry.display), ("operands", "\n".join(f"{o.label}: {o.shown()}" for o in typed))],
        ["type both operands under the same `spmd.set_current_mesh(mesh)`"],
    )


def _strict_rejection(entry, op, typed) -> Rejection:
    types = typed.types.format()
    return Rejection(
        f"Strict typechecking: {entry.display} got a plain (untyped) tensor as {op.label}; "
        "give it a type first.",
        [("op", entry.display), ("operand", f"{op.label}: plain tensor (untyped)")],
        [f"spmd.assert_type({op.label}, {typed.types.code()})"],
        notes=[f"the typed operand {typed.label} is {types}"],
    )
