"""The soundness fuzzer's moves: which statements may come next, by a small model of seed 003's rules.

``fuzz_programs.programs`` draws each statement from :func:`moves`: for every
live value (and pair of values) the ops whose local shapes fit, split into
those the model says are well typed and those it says are not. The model
(``_join``, ``_mul``, ``_div`` and the type-changing rows of
``_transitions.TRANSITIONS``) only steers generation; the package's checker
decides what is accepted, and the oracle what is right.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from fuzz_functions import TYPE_FUNCTIONS
from fuzz_oracle import is_list_type

from spmd_types._local.transitions import TRANSITIONS

__all__ = ["Val", "Move", "moves", "GOOD", "BAD", "MAX_NUMEL"]

MAX_NUMEL = 96  # growing ops (gather, cat, unsqueeze) stop here, to keep programs cheap

# ---------------------------------------------------------------------------
# The generator's model of the rules (per axis; "S<d>" acts as V in ordinary ops)


def _base(t: str) -> str:
    return "V" if is_list_type(t) else t


def _join(ts: list[str], linear: bool) -> str | None:
    """op(R..)->R, op(I..)->I, op(V..)->V, op(R, V)->V; P only in a linear op of P's; I never mixes."""
    bases = {_base(t) for t in ts}
    if "P" in bases:
        return "P" if linear and bases == {"P"} else None
    if "I" in bases:
        return "I" if bases == {"I"} else None
    return "V" if "V" in bases else "R"


def _mul(a: str, b: str) -> str | None:
    return "P" if {a, b} == {"P", "R"} else _join([a, b], linear=False)


def _div(a: str, b: str) -> str | None:
    return ("P" if b == "R" else None) if a == "P" else _join([a, b], linear=False)


_UNARY_LIN = ("neg", "scale", "transpose", "flatten", "reshape", "unsqueeze", "narrow", "sum", "mean", "getitem",
              "fn:scale3")
_UNARY_NL = ("tanh", "sin", "exp", "softmax", "gelu", "layer_norm", "amax", "fn:tanh", "fn:silu")
_BINARY = {"add": "lin", "sub": "lin", "cat": "lin", "mul": "ml", "matmul": "ml", "linear": "ml", "einsum": "ml",
           "div": "div", "iadd": "ilin", "imul": "iml", "fn:add_scaled": "lin"}


@functools.cache
def _binary_types(kind: str, a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...] | None:
    out = []
    for x, y in zip(a, b):
        k = kind.lstrip("i")  # "ilin", "iml": in place into a's storage, which may not change a's type
        t = _join([x, y], True) if k == "lin" else _mul(x, y) if k == "ml" else _div(x, y)
        if t is None or (kind.startswith("i") and t != _base(x)):
            return None
        out.append(t)
    return tuple(out)


# ---------------------------------------------------------------------------
# Shapes


def _unary_shapes(op: str, s: tuple[int, ...]) -> list[tuple[tuple[int, ...], dict]]:
    """(result shape, params) of each way ``op`` applies to a tensor of local shape ``s``."""
    nd = len(s)
    if op in ("neg", "scale", "tanh", "sin", "exp", "fn:tanh", "fn:silu", "fn:scale3", "fn:unregistered"):
        return [(s, {})]
    if op in ("softmax", "gelu", "layer_norm"):  # (over the last dim)
        return [(s, {})] if nd >= 1 else []
    if op == "getitem":  # x[1:]
        return [((s[0] - 1,) + s[1:], {})] if nd >= 1 and s[0] >= 2 else []
    if op == "transpose":
        return [((s[1], s[0]) + s[2:], {})] if nd >= 2 else []
    if op == "flatten":
        return [((math.prod(s),), {})] if nd >= 2 else []
    if op == "reshape":
        if nd == 1 and s[0] % 2 == 0:
            return [((2, s[0] // 2), {"shape": (2, s[0] // 2)})]
        return [((s[1], s[0]), {"shape": (s[1], s[0])})] if nd == 2 and s[0] != s[1] else []
    if op == "unsqueeze":
        return [((1,) + s, {})] if nd <= 2 else []
    if op == "narrow":
        return [(s[:d] + (s[d] // 2,) + s[d + 1:], {"dim": d, "length": s[d] // 2}) for d in range(nd) if s[d] >= 2]
    if op in ("sum", "amax"):
        return [(s[:d] + s[d + 1:], {"dim": d}) for d in range(nd)] if nd >= 2 else []
    if op == "mean":
        return [(s[:d] + (1,) + s[d + 1:], {"dim": d}) for d in range(nd)]
    raise KeyError(op)


def _binary_shapes(op: str, a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[tuple[int, ...], dict]]:
    if op in ("add", "sub", "mul", "div", "iadd", "imul", "fn:add_scaled"):
        return [(a, {})] if a == b else []
    if op in ("matmul", "einsum"):
        return [((a[0], b[1]), {})] if len(a) == len(b) == 2 and a[1] == b[0] else []
    if op == "linear":
        return [((a[0], b[0]), {})] if len(a) == len(b) == 2 and a[1] == b[1] else []
    if op == "cat":
        out = []
        for d in range(len(a)):
            if len(a) == len(b) and a[:d] + a[d + 1:] == b[:d] + b[d + 1:]:
                out.append((a[:d] + (a[d] + b[d],) + a[d + 1:], {"dim": d}))
        return out
    raise KeyError(op)


def _split_ok(s: tuple[int, ...], d: int, n: int) -> bool:
    return 0 <= d < len(s) and s[d] % n == 0 and s[d] > 0


def _times(s: tuple[int, ...], d: int, f: float) -> tuple[int, ...]:
    return s[:d] + (int(s[d] * f),) + s[d + 1:]


# ---------------------------------------------------------------------------
# Type-changing moves on one axis: (op, src, dst, params, result local shape)


def _dst_choices(s: tuple[int, ...], n: int, key: str) -> list[tuple[str, dict, tuple[int, ...]]]:
    """How a value of local shape ``s`` may become V/S(d) by keeping one part per rank."""
    out = []
    if s and s[0] == n:
        out.append(("V", {}, s[1:]))
    for d in range(len(s)):
        if _split_ok(s, d, n):
            out.append((f"S{d}", {}, _times(s, d, 1 / n)))
        if d > 0 and s[d] == n:  # V with a dim: this rank's entry of dim d (the published meaning: unstacked)
            out.append(("V", {key: d}, s[:d] + s[d + 1:]))
    return out


def _gathered(src: str, s: tuple[int, ...], n: int, key: str) -> list[tuple[str, dict, tuple[int, ...]]]:
    """How a V/S(d) value of local shape ``s`` may be put together: (src spelling, params, shape)."""
    if src.startswith("S"):
        d = int(src[1:])
        if d >= len(s):
            return []
        return [(src, {}, _times(s, d, n)), ("V", {}, (n,) + s)]  # S(d) refines V: gathering it stacked is allowed
    return [("V", {}, (n,) + s)] + [("V", {key: d}, s[:d] + (n,) + s[d:]) for d in range(1, len(s) + 1)]  # stacked on d


_ROWS = [(t.op, str(t.src), str(t.dst)) for t in TRANSITIONS]
# src=V on a reduction is shorthand for reinterpret(V, P) first (CONTRACT 4).
_SHORTHAND = [("all_reduce", "V", "R"), ("all_reduce", "V", "I"), ("reduce_scatter", "V", "V")]


@functools.cache
def _type_moves(t: str, s: tuple[int, ...], n: int) -> list[tuple[str, str, str, dict, tuple[int, ...]]]:
    """Every (op, src, dst, params, shape) on an axis where the value is ``t`` (src spelled as ``t`` claims)."""
    out = []
    for op, src, dst in _ROWS + _SHORTHAND:
        if src != _base(t):
            continue
        if op == "all_to_all":
            out += _all_to_all_moves(t, s, n)
        elif op == "all_gather":
            out += [(op, sp, dst, p, sh) for sp, p, sh in _gathered(t, s, n, "gather_dim")]
        elif op in ("all_reduce", "reinterpret") and dst != "V":
            out.append((op, t, dst, {}, s))
        elif op == "reinterpret":  # R/I -> V keeps the local data: V or any S(d)
            out += [(op, t, d, {}, s) for d in ["V"] + [f"S{k}" for k in range(len(s))]]
        elif op == "reduce_scatter":
            out += [(op, t, d, p, sh) for d, p, sh in _dst_choices(s, n, "scatter_dim")]
        elif op == "convert" and dst == "V":
            out += [(op, t, d, {}, sh) for d, p, sh in _dst_choices(s, n, "scatter_dim") if not p]
        elif op == "convert" and src == "V":
            if t == "V" or int(t[1:]) < len(s):
                out.append((op, t, dst, {}, (n,) + s if t == "V" else _times(s, int(t[1:]), n)))
        elif op == "convert":
            out.append((op, t, dst, {}, s))
    return out + _redistribute_moves(t, s, n)


def _all_to_all_moves(t: str, s: tuple[int, ...], n: int) -> list:
    out = []
    if t == "V":
        for j in range(len(s)):
            if _split_ok(s, j, n):  # one dim: split it, concatenate what arrives on it
                out.append(("all_to_all", "V", "V", {"split_dim": j, "concat_dim": j}, s))
            if s[j] == n:  # two dims (the published meaning): unbind dim j, stack what arrives on dim i
                for i in range(len(s)):
                    if i != j:
                        rest = s[:j] + s[j + 1:]
                        out.append(("all_to_all", "V", "V", {"split_dim": j, "concat_dim": i},
                                    rest[:i] + (n,) + rest[i:]))
    elif int(t[1:]) < len(s):
        i = int(t[1:])
        for j in range(len(s)):  # j == i: the identity (it scrambled blocks before issue 11 item 6)
            if j == i or _split_ok(s, j, n):
                out.append(("all_to_all", t, f"S{j}", {}, _times(_times(s, j, 1 / n), i, n)))
    return out


def _redistribute_moves(t: str, s: tuple[int, ...], n: int) -> list:
    """redistribute keeps the meaning: to any type (X -> X included) but V -> V, which names no dims."""
    b = _base(t)
    if b != "V":
        out = [("redistribute", t, d, {}, s) for d in ("R", "I", "P")]
        return out + [("redistribute", t, d, {}, sh) for d, p, sh in _dst_choices(s, n, "") if not p]
    if t == "V":
        return [("redistribute", "V", d, {}, (n,) + s) for d in ("R", "I")]
    i = int(t[1:])
    if i >= len(s):
        return []
    out = [("redistribute", t, d, {}, _times(s, i, n)) for d in ("R", "I")]
    return out + [("redistribute", t, f"S{j}", {}, _times(_times(s, j, 1 / n), i, n))
                  for j in range(len(s)) if j == i or _split_ok(s, j, n)]


# ---------------------------------------------------------------------------
# Moves


@dataclass(frozen=True)
class Val:
    name: str
    types: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Move:
    op: str
    args: tuple[str, ...]
    params: tuple[tuple[str, Any], ...]
    types: tuple[str, ...]
    shape: tuple[int, ...]
    axis: str | None = None
    src: str | None = None
    dst: str | None = None
    second: tuple | None = None  # a foreach op's element 1: (types, shape)


# torch._foreach_X: name -> (lists taken, how each element is typed: "lin", "ml", or "nl")
_FOREACH = {"foreach_add": (2, "lin"), "foreach_mul": (2, "ml"), "foreach_scale": (1, "lin"),
            "foreach_exp": (1, "nl"), "foreach_norm": (1, "nl")}


def _element_types(kind: str, ts: list[tuple[str, ...]]) -> tuple[str, ...] | None:
    if len(ts) == 2:
        return _binary_types(kind, ts[0], ts[1])
    out = tuple(_join([t], kind == "lin") for t in ts[0])
    return None if None in out else out  # type: ignore[return-value]


def _foreach_moves(vals: list[Val], good: bool) -> list[Move]:
    """torch._foreach_X([a, b], ...) on the three newest values; element i typed like the single-tensor op."""
    out = []
    newest = vals[:3]
    pairs = [(a, c) for a in newest for c in newest if a.shape == c.shape]
    for op, (lists, kind) in _FOREACH.items():
        combos = ([(a, c, b, d) for a, c in pairs for b, d in pairs] if lists == 2
                  else [(a, None, b, None) for a in newest for b in newest])
        for a, c, b, d in combos:
            t0 = _element_types(kind, [a.types] + ([c.types] if c else []))
            t1 = _element_types(kind, [b.types] + ([d.types] if d else []))
            if (t0 is not None and t1 is not None) != good:
                continue
            shapes = ((), ()) if op == "foreach_norm" else (a.shape, b.shape)
            args = (a.name, b.name) + ((c.name, d.name) if c else ())
            out.append(Move(op, args, (), t0 or (), shapes[0], second=(t1 or (), shapes[1])))
    return out


def _unary_moves(v: Val, good: bool) -> dict[str, list[Move]]:
    out: dict[str, list[Move]] = {"unary": [], "nonlinear": []}
    for cat, op, params, types, shape in _unary_options(v.types, v.shape, good):
        out[cat].append(Move(op, (v.name,), params, types, shape))
    return out


@functools.cache
def _unary_options(vtypes: tuple[str, ...], vshape: tuple[int, ...], good: bool) -> tuple:
    out = []
    for op in _UNARY_LIN + _UNARY_NL:
        linear = op in _UNARY_LIN
        types = tuple(_join([t], linear) for t in vtypes)
        if (None not in types) != good:
            continue
        for shape, params in _unary_shapes(op, vshape):
            out.append(("unary" if linear else "nonlinear", op, tuple(params.items()), types, shape))
    if not good:  # an unregistered autograd Function on a typed tensor is always an error
        out.append(("nonlinear", "fn:unregistered", (), (), vshape))
    return tuple(out)


def _binary_moves(vals: list[Val], good: bool) -> dict[str, list[Move]]:
    out: dict[str, list[Move]] = {"elementwise": [], "contract": []}
    for a in vals:
        for b in vals:
            for cat, op, params, types, shape in _binary_options(a.types, a.shape, b.types, b.shape, good):
                out[cat].append(Move(op, (a.name, b.name), params, types, shape))
    return out


@functools.cache
def _binary_options(at: tuple, ash: tuple, bt: tuple, bsh: tuple, good: bool) -> tuple:
    out = []
    for op, kind in _BINARY.items():
        types = _binary_types(kind, at, bt)
        if (types is not None) != good:
            continue
        for shape, params in _binary_shapes(op, ash, bsh):
            cat = "contract" if op in ("matmul", "linear", "einsum") else "elementwise"
            out.append((cat, op, tuple(params.items()), types or (), shape))
    return tuple(out)


def _type_op_moves(v: Val, axes: tuple[tuple[str, int], ...], good: bool) -> list[Move]:
    out = []
    for k, (axis, n) in enumerate(axes):
        t = v.types[k]
        # an S(0) claim on a 0-d value is a bad argument (a ValueError), not an ill-typed program
        claims = [t] if good else [c for c in ("R", "I", "V", "P", "S0") if _base(c) != _base(t)
                                   and (c != "S0" or v.shape)]
        for c in claims:
            for op, src, dst, params, shape in _type_moves(c, v.shape, n):
                types = v.types[:k] + (dst,) + v.types[k + 1:]
                if len(shape) != len(v.shape):  # a stack or unbind moves every dim: other axes' S(d) now say V
                    types = tuple(t if i == k or not t.startswith("S") else "V" for i, t in enumerate(types))
                out.append(Move(op, (v.name,), tuple(params.items()), types, shape, axis, src, dst))
            out += _function_moves(v, k, axis, n, c)
    return out


def _function_moves(v: Val, k: int, axis: str, n: int, claim: str) -> list[Move]:
    """The Megatron-style Functions registered as type-changing ops, on a value claimed to be ``claim``."""
    out = []
    s = v.shape
    for name, (_, _, src, dst) in TYPE_FUNCTIONS.items():
        if name == "fn:wrong_reduce" or _base(src) != _base(claim) or (src == "S0" and claim not in ("S0", "V")):
            continue
        if name == "fn:gather_from":
            shape = _times(s, 0, n) if s else None
        elif name == "fn:scatter_to":
            shape = _times(s, 0, 1 / n) if s and _split_ok(s, 0, n) else None
        else:
            shape = s
        if shape is not None:
            out.append(Move(name, (v.name,), (), v.types[:k] + (dst,) + v.types[k + 1:], shape, axis, src, dst))
    return out


# ---------------------------------------------------------------------------
# Writing values into a buffer (issue 16 item 1; the ops are fuzz_oracle's): into zeros that carry
# no gradient the result is the values alone, so it takes their type where the ordinary rule refuses.

_INTO_PLAIN_ZEROS = ("zeros.scatter_add_", "scatter_add(zeros)", "zeros.index_add_", "zeros.index_add",
                     "zeros.index_put_", "index_put(zeros)", "zeros.scatter_reduce_", "scatter_reduce(zeros)")
# a buffer of ones, an amax, zeros that carry a gradient: the ordinary rule, so P values are refused
_P_REFUSED = ("ones.scatter_add", "zeros.scatter_amax", "zeros_grad.index_add")


def _into_typed_zeros(b: tuple[str, ...], a: tuple[str, ...]) -> tuple[str, ...]:
    """Out of place into zeros typed ``b``: the ordinary rule's type where it accepts, else the values' ``a``.

    The ordinary rule reads a gradient-free I buffer as R, and a gradient-free R buffer as I beside
    differentiable I values (the fuzzer's values all carry a gradient).
    """
    out = []
    for x, y in zip(b, a):
        t = _join([x, y], True)
        if t is None and x == "I" and _base(y) in ("R", "V"):
            t = _base(y)
        elif t is None and x == "R" and y == "I":
            t = "I"
        out.append(t)
    return tuple(out) if None not in out else tuple(_join([y], True) for y in a)  # type: ignore[misc]


def _in_place_into_fresh(b: tuple[str, ...], a: tuple[str, ...]) -> tuple[str, ...] | None:
    """``a`` added in place into a gradient-free, unaliased buffer typed ``b``: its type, or None (refused)."""
    out = []
    for x, y in zip(b, a):
        t = _join([x, y], True)
        if t is None:
            return None
        if t != _base(x):
            if not (_base(x) in ("R", "I") and t == "V"):
                return None
            out.append("V")
        else:
            out.append(x)
    return tuple(out)


def _accumulate_moves(vals: list[Val], good: bool) -> list[Move]:
    out = []
    newest = [v for v in vals[:4] if v.shape]
    for a in newest:
        lin = tuple(_join([t], True) for t in a.types)
        if good:
            out += [Move(op, (a.name,), (), lin, a.shape) for op in _INTO_PLAIN_ZEROS]
        if ("P" in lin) != good:
            out += [Move(op, (a.name,), (), lin if good else (), a.shape) for op in _P_REFUSED]
        if not good:  # a typed result written in place into a plain buffer that is not zeros
            out.append(Move("ones.index_add_", (a.name,), (), (), a.shape))
        for b in newest:
            # The oracle reads zeros_like(b) as one tensor whatever b is, so a result is a list exactly where the
            # values are; where the ordinary rule accepts with a list buffer beside values that are not a list
            # (V zeros + R values: V, sound but not the values' own type) the two would disagree on the form.
            into = _into_typed_zeros(b.types, a.types)
            same_form = _lists(into) == _lists(a.types)
            if good and same_form:
                out.append(Move("new_zeros.scatter_add", (b.name, a.name), (), into, a.shape))
            if b.shape != a.shape:
                continue
            if good and same_form:
                out.append(Move("zeros_like.index_add", (b.name, a.name), (), into, a.shape))
            # in place into typed zeros: the ordinary rule, the buffer keeps its type (S(d) included), except
            # that R or I may become V (choice 7: the buffer carries no gradient and nothing aliases it)
            kept = _in_place_into_fresh(b.types, a.types)
            if (kept is not None) == good and (not good or _lists(kept) == _lists(a.types)):
                out.append(Move("zeros_like.scatter_add_", (b.name, a.name), (), kept if good else (), a.shape))
    return out


def _lists(types: tuple[str, ...]) -> tuple[bool, ...]:
    return tuple(is_list_type(t) for t in types)


# Categories a statement is drawn from (type-changing ops twice as often as the others).
GOOD = ("type-op", "unary", "elementwise", "type-op", "nonlinear", "contract", "foreach", "where", "accumulate")
BAD = ("type-op", "nonlinear", "elementwise", "contract", "foreach", "where", "accumulate")


def _where_types(c: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...] | None:
    """torch.where(c > 0, a, b): linear in a and b jointly; the condition is non-linear (R where the result is P)
    and gradient-free, so an I condition reads as R (and as I beside I branches)."""
    out = []
    for x, y, z in zip(c, a, b):
        t, x = _join([y, z], True), _base(x)
        if t is None or x == "P":
            return None
        if t == "P":
            t = t if x == "R" else None
        elif x == "V":
            t = None if t == "I" else "V"
        if t is None:
            return None
        out.append(t)
    return tuple(out)


def _where_moves(vals: list[Val], good: bool) -> list[Move]:
    newest = vals[:3]
    return [Move("where", (c.name, a.name, b.name), (), types or (), a.shape)
            for c in newest for a in newest for b in newest if c.shape == a.shape == b.shape
            for types in [_where_types(c.types, a.types, b.types)] if (types is not None) == good]


def moves(vals: list[Val], axes: tuple[tuple[str, int], ...], good: bool, cat: str) -> list[Move]:
    """The statements of category ``cat`` the model says are well-typed (``good``) or ill-typed."""
    if cat == "where":
        ms = _where_moves(vals, good)
    elif cat == "accumulate":
        ms = _accumulate_moves(vals, good)
    elif cat == "type-op":
        ms = [m for v in vals for m in _type_op_moves(v, axes, good)]
    elif cat == "foreach":
        ms = _foreach_moves(vals, good)
    elif cat in ("unary", "nonlinear"):
        ms = [m for v in vals for m in _unary_moves(v, good)[cat]]
    else:
        ms = _binary_moves(vals[:6], good)[cat]  # the six newest values: keeps generation cheap
    return [m for m in ms if 0 < math.prod(m.shape) <= MAX_NUMEL]
