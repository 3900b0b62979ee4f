"""``rules.einsum``'s typing: an einsum equation read as a sharding rule, per mesh axis.

Labels are single letters, ``_`` (a dim that must not be sharded) or ``...``
(passed-through dims). Per axis: the operands' local types combine by the
standard rule (all R is R, all I is I, R with V is V, I mixes with nothing);
in global SPMD a label's sharding carries to the output, a sharded label that
reaches no output makes the result P (the kernel sums over it), and an operand
without a sharded label must not be V there (it would not be a broadcast). A P
operand passes only through the operands ``linear_in`` names, with every other
operand R on that axis.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from .._core.errors import SpmdTypeError
from .._core.types import I, P, R, V

__all__ = ["einsum_type"]

_TOKEN = re.compile(r"\s*(?:(\.\.\.)|([^\W\d]))")


def _parse_term(term: str, equation: str) -> list[str]:
    labels, pos = [], 0
    if not term.strip():
        raise TypeError(f"rules.einsum: empty operand in {equation!r}")
    while pos < len(term):
        m = _TOKEN.match(term, pos)
        if m is None or m.end() == pos:
            if not term[pos:].strip():
                break
            raise TypeError(f"rules.einsum: unexpected {term[pos:].strip()[0]!r} in {equation!r}; labels are single "
                            "letters, '_' or '...'")
        pos = m.end()
        labels.append(m.group(1) or m.group(2))
    named = [x for x in labels if x not in ("...", "_")]
    if labels.count("...") > 1 or len(named) != len(set(named)):
        raise TypeError(f"rules.einsum: operand {term.strip()!r} repeats a label or '...' in {equation!r}")
    return labels


def _parse(equation: str) -> tuple[list[list[str]], list[str]]:
    if equation.count("->") != 1:
        raise TypeError(f"rules.einsum: equation {equation!r} must contain exactly one '->'")
    lhs, rhs = equation.split("->")
    if "," in rhs:
        raise TypeError(f"rules.einsum: {equation!r} lists several outputs; write one rules.einsum per output")
    inputs = [_parse_term(t, equation) for t in lhs.split(",")]
    output = [] if not rhs.strip() else _parse_term(rhs, equation)
    known = {x for t in inputs for x in t}
    for label in output:
        if label not in ("...", "_") and label not in known:
            raise TypeError(f"rules.einsum: output label {label!r} does not appear on any input in {equation!r}")
    return inputs, output


def _expand(terms: list[list[str]], output: list[str], values: list, equation: str) -> tuple[list[list[str]], list[str]]:
    """Labels per dim of each operand and of the output, ``...`` expanded to the same number of dims everywhere."""
    if len(values) != len(terms):
        raise TypeError(f"rules.einsum: {equation!r} has {len(terms)} operand(s) but {len(values)} were passed")
    rank = None
    for i, (term, (ndim, _, _)) in enumerate(zip(terms, values)):
        explicit = len(term) - (1 if "..." in term else 0)
        if "..." not in term and ndim != explicit:
            raise SpmdTypeError(f"rules.einsum: {equation!r}: operand {i} has {explicit} label(s) but {ndim} dim(s)")
        if "..." in term:
            if ndim < explicit or (rank is not None and ndim - explicit != rank):
                raise SpmdTypeError(f"rules.einsum: {equation!r}: '...' stands for a different number of dims on "
                                    f"operand {i}")
            rank = ndim - explicit

    def expand(term: list[str]) -> list[str]:
        return [x for lab in term for x in ([f"...{k}" for k in range(rank or 0)] if lab == "..." else [lab])]

    return [expand(t) for t in terms], expand(output)


def _label_axes(labels: list[list[str]], values: list, equation: str, global_of: Callable) -> dict[str, tuple]:
    """Per label, the (global) axes sharding it; checked consistent, one label per axis, ``_`` unsharded."""
    found: dict[str, tuple] = {}
    owner: dict[Any, str] = {}
    every = {a for _, local, dims in values for a in list(local) + [x for e in dims for x in e]}
    glob = global_of(every)
    for i, (labs, (_, _, dims)) in enumerate(zip(labels, values)):
        for d, (lab, axes) in enumerate(zip(labs, dims)):
            axes = tuple(a for a in axes if a in glob)
            if lab == "_":
                if axes:
                    raise SpmdTypeError(f"rules.einsum: operand {i} of {equation!r} is sharded at dim {d}, which the "
                                        "equation marks '_' (must not be sharded)")
                continue
            if found.setdefault(lab, axes) != axes:
                raise SpmdTypeError(f"rules.einsum: label {lab!r} of {equation!r} is sharded differently on "
                                    f"operand {i} (dim {d})")
            for a in axes:
                if owner.setdefault(a, lab) != lab:
                    raise SpmdTypeError(f"rules.einsum: axis {a!r} shards both {owner[a]!r} and {lab!r} in "
                                        f"{equation!r}; an axis shards one dim")
    for a, lab in owner.items():
        for i, (labs, (_, local, _)) in enumerate(zip(labels, values)):
            if lab not in labs and local.get(a) is V:
                raise SpmdTypeError(f"rules.einsum: operand {i} of {equation!r} broadcasts over {lab!r}, which is "
                                    f"sharded on {a!r}, so it must not be V there")
    return found


def _groups(linear_in: Sequence[Any], n: int) -> list[frozenset]:
    groups, seen = [], set()
    for entry in linear_in:
        members = (entry,) if isinstance(entry, int) else tuple(entry)
        for i in members:
            if not isinstance(i, int) or not 0 <= i < n or i in seen:
                raise TypeError(f"rules.einsum: linear_in names operand {i!r} twice or out of range ({n} operands)")
            seen.add(i)
        if members:
            groups.append(frozenset(members))
    return groups


def _combine(axis: Any, types: list, groups: list[frozenset], equation: str) -> Any:
    """One axis: the operands' local types (None: not typed there) combined, P only through ``linear_in``."""
    present = [(i, t) for i, t in enumerate(types) if t is not None]
    partial = [i for i, t in present if t is P]
    if partial:
        owners = [g for g in groups if any(i in g for i in partial)]
        if len(owners) != 1 or any(not any(i in g for g in groups) for i in partial):
            raise SpmdTypeError(f"rules.einsum: {equation!r}: operand(s) {partial} are P on axis {axis!r}; a P passes "
                                "only through operands the op is linear in, all in one linear_in group")
        if len(owners[0]) > 1 and any(types[i] not in (P,) for i in owners[0]):
            raise SpmdTypeError(f"rules.einsum: {equation!r}: operands {sorted(owners[0])} are jointly linear, so on "
                                f"axis {axis!r} all or none of them are P")
        for i, t in present:
            if i not in partial and t is not R:
                raise SpmdTypeError(f"rules.einsum: {equation!r}: operand {i} is {t} on axis {axis!r} while "
                                    f"operand(s) {partial} are P there; a P combines only with R")
        return P
    kinds = {t for _, t in present}
    if I in kinds and len(kinds) > 1:
        raise SpmdTypeError(f"rules.einsum: {equation!r}: I mixes with {sorted(str(k) for k in kinds - {I})} on axis "
                            f"{axis!r}; convert first")
    return V if V in kinds else (I if kinds == {I} else R)


def einsum_type(equation: str, values: list, linear_in: Sequence[Any], global_of: Callable) -> tuple[int, dict, list]:
    """(ndim, ``{axis: local type}``, per output dim its sharding axes) of an einsum over typed ``values``."""
    terms, output = _parse(equation)
    labels, out_labels = _expand(terms, output, values, equation)
    label_axes = _label_axes(labels, values, equation, global_of)
    groups = _groups(linear_in, len(values))
    axes = {a for _, local, _ in values for a in local}
    local = {a: _combine(a, [v[1].get(a) for v in values], groups, equation) for a in axes}
    for lab, sharding in label_axes.items():
        if lab not in out_labels:  # contracted over a sharded dim: the kernel's sum over it is pending
            for a in sharding:
                local[a] = P
    dims = [() if lab == "_" else label_axes.get(lab, ()) for lab in out_labels]
    return len(out_labels), local, dims
