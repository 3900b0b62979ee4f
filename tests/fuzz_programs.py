"""The soundness fuzzer's generator and runner (the oracle is ``fuzz_oracle``, which never imports spmd_types).

:func:`programs` is a hypothesis strategy for random straight-line programs on
a mesh: typed inputs, then ordinary torch ops from the rules table
(elementwise linear, multilinear and non-linear ops, reductions, matmul,
cat, shape ops) and the type-changing ops of ``_transitions.TRANSITIONS``
(plus ``redistribute``). A small model of seed 003's rules (below) steers
generation towards well-typed programs; about one in four programs instead
ends in a statement the model says is ill-typed. The model only steers: the
package's checker decides, and :func:`run_program` then

* for a rejected program, requires ``spmd.SpmdTypeError`` (any other exception fails);
* for an accepted one, reads every output by the type the checker gave it and
  every input gradient by the input's backward type, and compares them with
  the oracle's meaning and ``torch.autograd`` on it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from fuzz_functions import FUNCTIONS, TYPE_FUNCTIONS
from fuzz_oracle import ORDINARY, Den, Inp, Mismatch, Program, Stmt, backward_type, evaluate, gradients, is_list_type, read
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensorMode, maybe_disable_local_tensor_mode

import spmd_types as spmd
from spmd_types._transitions import TRANSITIONS
from spmd_types.testing import per_rank, rank_values

__all__ = ["programs", "run_program", "COUNTS", "MAX_NUMEL"]

DTYPE = torch.float64
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


_UNARY_LIN = ("neg", "scale", "transpose", "flatten", "reshape", "unsqueeze", "narrow", "sum", "mean", "fn:scale3")
# "fn:silu" (CheckpointedSilu, registered transparent=True) is left out: KNOWN BUG, see fuzz_functions.py.
_UNARY_NL = ("tanh", "sin", "exp", "fn:tanh")
_BINARY = {"add": "lin", "sub": "lin", "cat": "lin", "mul": "ml", "matmul": "ml", "linear": "ml", "div": "div",
           "fn:add_scaled": "lin"}


def _binary_types(kind: str, a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...] | None:
    out = []
    for x, y in zip(a, b):
        t = _join([x, y], True) if kind == "lin" else _mul(x, y) if kind == "ml" else _div(x, y)
        if t is None:
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
    if op == "sum":
        return [(s[:d] + s[d + 1:], {"dim": d}) for d in range(nd)] if nd >= 2 else []
    if op == "mean":
        return [(s[:d] + (1,) + s[d + 1:], {"dim": d}) for d in range(nd)]
    raise KeyError(op)


def _binary_shapes(op: str, a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[tuple[int, ...], dict]]:
    if op in ("add", "sub", "mul", "div", "fn:add_scaled"):
        return [(a, {})] if a == b else []
    if op == "matmul":
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
            out.append(("V", {key: d}, _times(s, d, 1 / n)))
    return out


def _gathered(src: str, s: tuple[int, ...], n: int, key: str) -> list[tuple[str, dict, tuple[int, ...]]]:
    """How a V/S(d) value of local shape ``s`` may be put together: (src spelling, params, shape)."""
    if src.startswith("S"):
        d = int(src[1:])
        if d >= len(s):
            return []
        return [(src, {}, _times(s, d, n)), ("V", {}, (n,) + s)]  # S(d) refines V: gathering it stacked is allowed
    return [("V", {}, (n,) + s)] + [("V", {key: d}, _times(s, d, n)) for d in range(len(s))]


_ROWS = [(t.op, str(t.src), str(t.dst)) for t in TRANSITIONS]
# src=V on a reduction is shorthand for reinterpret(V, P) first (CONTRACT 4).
_SHORTHAND = [("all_reduce", "V", "R"), ("all_reduce", "V", "I"), ("reduce_scatter", "V", "V")]


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
            if _split_ok(s, j, n):
                for i in range(len(s)):
                    out.append(("all_to_all", "V", "V", {"split_dim": j, "concat_dim": i},
                                _times(_times(s, j, 1 / n), i, n)))
    elif int(t[1:]) < len(s):
        i = int(t[1:])
        # KNOWN BUG (issue 11 item 6): all_to_all(src=S(d), dst=S(d)) scrambles blocks; j == i is left out.
        for j in range(len(s)):
            if j != i and _split_ok(s, j, n):
                out.append(("all_to_all", t, f"S{j}", {}, _times(_times(s, j, 1 / n), i, n)))
    return out


def _redistribute_moves(t: str, s: tuple[int, ...], n: int) -> list:
    """redistribute keeps the meaning; only with src equal to the value's type (KNOWN BUG, issue 11
    item 6: redistribute does not check src, so a wrong src is never generated for it)."""
    b = _base(t)
    if b != "V":
        out = [("redistribute", t, d, {}, s) for d in ("R", "I", "P") if d != b]
        return out + [("redistribute", t, d, {}, sh) for d, p, sh in _dst_choices(s, n, "") if not p]
    if t == "V":
        return [("redistribute", "V", d, {}, (n,) + s) for d in ("R", "I")]
    i = int(t[1:])
    if i >= len(s):
        return []
    out = [("redistribute", t, d, {}, _times(s, i, n)) for d in ("R", "I")]
    return out + [("redistribute", t, f"S{j}", {}, _times(_times(s, j, 1 / n), i, n))
                  for j in range(len(s)) if j != i and _split_ok(s, j, n)]


# ---------------------------------------------------------------------------
# The strategy


@dataclass(frozen=True)
class _Val:
    name: str
    types: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Move:
    op: str
    args: tuple[str, ...]
    params: tuple[tuple[str, Any], ...]
    types: tuple[str, ...]
    shape: tuple[int, ...]
    axis: str | None = None
    src: str | None = None
    dst: str | None = None


def _unary_moves(v: _Val, good: bool) -> dict[str, list[_Move]]:
    out: dict[str, list[_Move]] = {"unary": [], "nonlinear": []}
    for op in _UNARY_LIN + _UNARY_NL:
        linear = op in _UNARY_LIN
        types = tuple(_join([t], linear) for t in v.types)
        if (None not in types) != good:
            continue
        for shape, params in _unary_shapes(op, v.shape):
            out["unary" if linear else "nonlinear"].append(
                _Move(op, (v.name,), tuple(params.items()), types, shape))  # type: ignore[arg-type]
    if not good:  # an unregistered autograd Function on a typed tensor is always an error
        out["nonlinear"].append(_Move("fn:unregistered", (v.name,), (), (), v.shape))
    return out


def _binary_moves(vals: list[_Val], good: bool) -> dict[str, list[_Move]]:
    out: dict[str, list[_Move]] = {"elementwise": [], "contract": []}
    for a in vals:
        for b in vals:
            for op, kind in _BINARY.items():
                types = _binary_types(kind, a.types, b.types)
                if (types is not None) != good:
                    continue
                for shape, params in _binary_shapes(op, a.shape, b.shape):
                    cat = "contract" if op in ("matmul", "linear") else "elementwise"
                    out[cat].append(_Move(op, (a.name, b.name), tuple(params.items()), types or (), shape))
    return out


def _type_op_moves(v: _Val, axes: tuple[tuple[str, int], ...], good: bool) -> list[_Move]:
    out = []
    for k, (axis, n) in enumerate(axes):
        t = v.types[k]
        claims = [t] if good else [c for c in ("R", "I", "V", "P", "S0") if _base(c) != _base(t)]
        for c in claims:
            for op, src, dst, params, shape in _type_moves(c, v.shape, n):
                if not good and op == "redistribute":
                    continue  # KNOWN BUG (issue 11 item 6): redistribute does not check src
                types = v.types[:k] + (dst,) + v.types[k + 1:]
                out.append(_Move(op, (v.name,), tuple(params.items()), types, shape, axis, src, dst))
            out += _function_moves(v, k, axis, n, c)
    return out


def _function_moves(v: _Val, k: int, axis: str, n: int, claim: str) -> list[_Move]:
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
            out.append(_Move(name, (v.name,), (), v.types[:k] + (dst,) + v.types[k + 1:], shape, axis, src, dst))
    return out


# Categories a statement is drawn from (type-changing ops twice as often as the others).
_GOOD = ("type-op", "unary", "elementwise", "type-op", "nonlinear", "contract")
_BAD = ("type-op", "nonlinear", "elementwise", "contract")


def _moves(vals: list[_Val], axes: tuple[tuple[str, int], ...], good: bool, cat: str) -> list[_Move]:
    """The statements of category ``cat`` the model says are well-typed (``good``) or ill-typed."""
    if cat == "type-op":
        ms = [m for v in vals for m in _type_op_moves(v, axes, good)]
    elif cat in ("unary", "nonlinear"):
        ms = [m for v in vals for m in _unary_moves(v, good)[cat]]
    else:
        ms = _binary_moves(vals[:6], good)[cat]  # the six newest values: keeps generation cheap
    return [m for m in ms if 0 < math.prod(m.shape) <= MAX_NUMEL]


_INPUT_TYPES = ("R", "V", "P", "I", "S0", "S1")


@st.composite
def programs(draw: Any, axes: tuple[tuple[str, int], ...], max_stmts: int = 8) -> Program:
    """A random straight-line program on a mesh of ``axes``; about one in four ends in an ill-typed statement."""
    n = math.lcm(*(size for _, size in axes))
    a, b = draw(st.sampled_from([(n, 2 * n), (2 * n, n), (n, n), (2 * n, 2 * n)]))
    vals: list[_Val] = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(st.sampled_from([(a, b), (b, a), (a, a), (n,) + (a, b)[:1]]))
        vals.append(_Val(f"x{i}", tuple(draw(st.sampled_from(_INPUT_TYPES)) for _ in axes), shape))
    inputs = tuple(Inp(v.name, v.types, v.shape) for v in vals)
    count = draw(st.integers(1, max_stmts))
    ill = draw(st.integers(0, 3)) == 3
    stmts = []
    for i in range(count):
        bad = ill and i == count - 1
        cat = draw(st.sampled_from(_BAD if bad else _GOOD))
        moves = _moves(vals[::-1], axes, not bad, cat) or _moves(vals[::-1], axes, not bad, "type-op")
        if not moves:  # nothing ill-typed to write here: the program stays well-typed
            ill, moves = False, _moves(vals[::-1], axes, True, "type-op")
        m = draw(st.sampled_from(moves))
        name = f"v{i}"
        stmts.append(Stmt(name, m.op, m.args, m.params, m.axis, m.src, m.dst))
        vals.append(_Val(name, m.types, m.shape))
    outputs = [vals[-1].name]
    extra = draw(st.sampled_from([None] + [v.name for v in vals[:-1]]))
    if extra is not None:
        outputs.append(extra)
    return Program(axes, inputs, tuple(stmts), tuple(outputs), well_typed=not ill, seed=draw(st.integers(0, 2**16)))


# ---------------------------------------------------------------------------
# The runner

COUNTS: Counter[str] = Counter()  # programs run / accepted / rejected, and the surprises (see test_fuzz)
SURPRISES: list[str] = []  # the first few programs the generator meant well-typed that the checker rejected


def _spmd_type(t: str) -> spmd.SpmdType:
    return spmd.S(int(t[1:])) if t.startswith("S") else getattr(spmd, t)


def _type_str(t: spmd.SpmdType) -> str:
    return str(t).replace("(", "").replace(")", "")


def _apply(stmt: Stmt, env: dict[str, torch.Tensor], mesh: Any) -> torch.Tensor:
    args = [env[a] for a in stmt.args]
    if stmt.op in TYPE_FUNCTIONS:  # Megatron-style: the process group is an argument
        return TYPE_FUNCTIONS[stmt.op][0].apply(args[0], mesh.get_group(stmt.axis))
    if stmt.op in FUNCTIONS:
        return FUNCTIONS[stmt.op].apply(*args)
    if stmt.axis is not None:
        fn = getattr(spmd, stmt.op)
        return fn(args[0], stmt.axis, src=_spmd_type(stmt.src), dst=_spmd_type(stmt.dst), **dict(stmt.params))
    return ORDINARY[stmt.op][0](*args, **dict(stmt.params))


def _random_per_rank(types: tuple[str, ...], shape: tuple[int, ...], coords: list, seed: int) -> dict:
    """Per-rank values of ``types``: equal across the ranks of an R or I axis, independent otherwise."""
    out = {}
    for coord in coords:
        key = tuple(c if types[k] not in ("R", "I") else 0 for k, c in enumerate(coord))
        g = torch.Generator().manual_seed(hash((seed, key)) % (2**31))
        out[coord] = torch.randn(shape, generator=g, dtype=DTYPE)
    return out


def _by_coord(t: torch.Tensor | None, coord_of: dict[int, tuple]) -> dict | None:
    """``{mesh coordinate: plain tensor}`` of a per-rank tensor (None stays None: an unused input)."""
    if t is None:
        return None
    return {coord_of[r]: v for r, v in rank_values(t).items()}


def _close(got: Den, want: Den, what: str, program: Program) -> None:
    if got.vary != want.vary:
        raise AssertionError(f"{what}: the checker's type makes it a list on axes {got.vary}, the meaning "
                             f"on axes {want.vary}\n{program!r}")
    for key, w in want.data.items():
        try:
            torch.testing.assert_close(got.data[key], w.detach(), rtol=1e-6, atol=1e-6, equal_nan=True)
        except AssertionError as e:
            raise AssertionError(f"{what} (list entry {key}) differs from the oracle: {e}\n{program!r}") from None


def run_program(program: Program, mesh: Any) -> str:
    """Run ``program`` typed on simulated ranks, check it against the oracle; 'accepted' or 'rejected'.

    The typed run is under ``LocalTensorMode`` (entered here); the oracle runs outside it.
    """
    names = tuple(a for a, _ in program.axes)
    coord_of = {int(mesh.mesh[c]): c for c in _all_coords(mesh.mesh.shape)}
    coords = sorted(coord_of.values())
    values = {i.name: _random_per_rank(i.types, i.shape, coords, program.seed * 31 + j)
              for j, i in enumerate(program.inputs)}
    COUNTS["run"] += 1
    try:
        with LocalTensorMode(len(coords)), spmd.set_current_mesh(mesh):
            typed = _run_typed(program, mesh, names, coord_of, values)
    except spmd.SpmdTypeError as e:
        COUNTS["rejected"] += 1
        if program.well_typed:
            COUNTS["rejected, generated well-typed"] += 1
            if len(SURPRISES) < 5:
                SURPRISES.append(f"{program!r}\n  -> {str(e).splitlines()[0]}")
        return "rejected"
    COUNTS["accepted"] += 1
    COUNTS["accepted, generated ill-typed"] += not program.well_typed
    COUNTS["statements checked"] += len(program.stmts)
    _check_against_oracle(program, names, values, *typed)
    return "accepted"


def _run_typed(program: Program, mesh: Any, names: tuple[str, ...], coord_of: dict, values: dict) -> tuple:
    """The typed run, forward and backward: per-rank outputs, their types, cotangents, input gradients."""
    leaves = {i.name: per_rank(lambda r, i=i: values[i.name][coord_of[r]].clone()).requires_grad_()
              for i in program.inputs}
    with spmd.typecheck():
        env = {i.name: spmd.assert_type(leaves[i.name], dict(zip(names, map(_spmd_type, i.types))))
               for i in program.inputs}
        for stmt in program.stmts:
            env[stmt.out] = _apply(stmt, env, mesh)
        outs = [env[o] for o in program.outputs]
        out_types = [tuple(_type_str(_type_of(o)[a]) for a in names) for o in outs]
        with maybe_disable_local_tensor_mode():
            cot_values = [_random_per_rank(tuple(map(backward_type, t)), tuple(o.shape), sorted(coord_of.values()),
                                           program.seed + 7 + k) for k, (o, t) in enumerate(zip(outs, out_types))]
        cots = [per_rank(lambda r, c=c: c[coord_of[r]].clone()) for c in cot_values]
        torch.autograd.backward(outs, cots)
    got_outs = [_by_coord(o, coord_of) for o in outs]
    grads = {i.name: _by_coord(leaves[i.name].grad, coord_of) for i in program.inputs}
    return got_outs, out_types, cot_values, grads


def _type_of(t: torch.Tensor) -> dict:
    ty = spmd.get_type(t)
    if ty is None:
        raise AssertionError("an output of an accepted program is untyped")
    return ty


def _check_against_oracle(program: Program, names: tuple[str, ...], values: dict, got_outs: list,
                          out_types: list, cot_values: list, grads: dict) -> None:
    den_in = {}
    for i in program.inputs:
        d = read(values[i.name], i.types, names)
        den_in[i.name] = Den(d.vary, {k: t.clone().requires_grad_() for k, t in d.data.items()})
    env = evaluate(program, den_in)
    want_out, cot_dens = [], []
    for o, got_values, types, cv in zip(program.outputs, got_outs, out_types, cot_values):
        try:
            got = read(got_values, types, names)
        except Mismatch as e:
            raise AssertionError(f"output {o} typed {types}: {e}\n{program!r}") from None
        _close(got, env[o], f"output {o} (typed {types})", program)
        want_out.append(env[o])
        cot_dens.append(read(cv, tuple(map(backward_type, types)), names))
    want_grads = gradients(want_out, cot_dens, den_in)
    for i in program.inputs:
        back = tuple(map(backward_type, i.types))
        per_rank_grads = grads[i.name] or {c: torch.zeros_like(v) for c, v in values[i.name].items()}
        try:
            got = read(per_rank_grads, back, names)
        except Mismatch as e:
            raise AssertionError(f"gradient of {i.name} (typed {back}): {e}\n{program!r}") from None
        _close(got, want_grads[i.name], f"gradient of {i.name} (typed {back})", program)


def _all_coords(shape: Any) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [c + (i,) for c in out for i in range(n)]
    return out
