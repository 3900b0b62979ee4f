"""The soundness fuzzer's generator and runner (the oracle is ``fuzz_oracle``, which never imports spmd_types).

:func:`programs` is a hypothesis strategy for random straight-line programs on
a mesh: typed inputs, then ordinary torch ops from the rules table
(elementwise linear, multilinear and non-linear ops, reductions, matmul,
cat, shape ops) and the type-changing ops of ``_transitions.TRANSITIONS``
(plus ``redistribute``). A small model of seed 003's rules (``fuzz_moves``) steers
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
from typing import Any

import torch
from fuzz_functions import FUNCTIONS, TYPE_FUNCTIONS
from fuzz_moves import BAD, GOOD, Val, moves
from fuzz_oracle import (
    FOREACH,
    ORDINARY,
    TYPE_ONLY_FIRST,
    Den,
    Inp,
    Mismatch,
    Program,
    Step,
    Stmt,
    backward_type,
    evaluate,
    gradients,
    read,
    step,
)
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensorMode, maybe_disable_local_tensor_mode

import spmd_types as spmd
from spmd_types.testing import per_rank, rank_values

__all__ = ["programs", "run_program", "COUNTS", "SURPRISES", "ACCEPTED_ILL"]

DTYPE = torch.float64

_INPUT_TYPES = ("R", "V", "P", "I", "S0", "S1")


@st.composite
def programs(draw: Any, axes: tuple[tuple[str, int], ...], max_stmts: int = 8) -> Program:
    """A random straight-line program on a mesh of ``axes``; about one in four ends in an ill-typed statement."""
    n = math.lcm(*(size for _, size in axes))
    a, b = draw(st.sampled_from([(n, 2 * n), (2 * n, n), (n, n), (2 * n, 2 * n)]))
    vals: list[Val] = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(st.sampled_from([(a, b), (b, a), (a, a), (n,) + (a, b)[:1]]))
        vals.append(Val(f"x{i}", tuple(draw(st.sampled_from(_INPUT_TYPES)) for _ in axes), shape))
    inputs = tuple(Inp(v.name, v.types, v.shape) for v in vals)
    count = draw(st.integers(1, max_stmts))
    ill = draw(st.integers(0, 3)) == 3
    stmts = []
    for i in range(count):
        bad = ill and i == count - 1
        cat = draw(st.sampled_from(BAD if bad else GOOD))
        options = moves(vals[::-1], axes, not bad, cat) or moves(vals[::-1], axes, not bad, "type-op")
        if not options:  # nothing ill-typed to write here: the program stays well-typed
            ill, options = False, moves(vals[::-1], axes, True, "type-op")
        m = draw(st.sampled_from(options))
        name = f"v{i}"
        stmts.append(Stmt(name, m.op, m.args, m.params, m.axis, m.src, m.dst))
        if m.second is None:
            vals.append(Val(name, m.types, m.shape))
        else:
            vals += [Val(f"{name}_0", m.types, m.shape), Val(f"{name}_1", *m.second)]
    outputs = [vals[-1].name]
    extra = draw(st.sampled_from([None] + [v.name for v in vals[:-1]]))
    if extra is not None:
        outputs.append(extra)
    step, ill = draw(_steps(inputs, stmts, outputs, axes, ill))
    return Program(axes, inputs, tuple(stmts), tuple(outputs), well_typed=not ill, seed=draw(st.integers(0, 2**16)),
                   step=step)


_OPTIMIZERS = (
    ("SGD", (("lr", 0.1),)), ("SGD", (("lr", 0.1), ("foreach", True))), ("SGD", (("lr", 0.1), ("momentum", 0.9))),
    ("Adam", (("lr", 0.01), ("foreach", False))), ("Adam", (("lr", 0.01), ("foreach", True))),
    ("AdamW", (("lr", 0.01), ("fused", True))), ("AdamW", (("lr", 0.01), ("foreach", True), ("weight_decay", 0.1))),
)


def _used(inputs: tuple[Inp, ...], stmts: list[Stmt], outputs: list[str]) -> set[str]:
    """The inputs the outputs depend on."""
    deps: dict[str, set[str]] = {i.name: {i.name} for i in inputs}
    for s in stmts:
        if s.op in FOREACH:  # element i: the i-th entry of every list
            for i in range(2):
                deps[f"{s.out}_{i}"] = set().union(*(deps[a] for a in s.args[i::2]))
        else:
            args = s.args[1:] if s.op in TYPE_ONLY_FIRST else s.args
            deps[s.out] = set().union(*(deps[a] for a in args))
    return set().union(*(deps[o] for o in outputs))


@st.composite
def _steps(draw: Any, inputs: tuple[Inp, ...], stmts: list[Stmt], outputs: list[str], axes: tuple, ill: bool) -> tuple:
    """An optimizer step after the backward in one program of four: (step or None, ill-typed)."""
    if draw(st.integers(0, 3)) != 3 or ill:
        return None, ill
    optimizer, options = draw(st.sampled_from(_OPTIMIZERS))
    params = [i for i in inputs if "P" not in i.types]  # a P parameter's update would be counted on every rank
    syncs = [(i.name, a) for i in params for (a, _), t in zip(axes, i.types) if t == "R"]  # its gradient is P there
    used = _used(inputs, stmts, outputs)
    if draw(st.integers(0, 2)) == 2:  # ill-typed: a step on a P parameter, or a forgotten gradient sync
        bad = [("param", i) for i in inputs if "P" in i.types and i.name in used]
        bad += [("sync", k) for k, (x, _) in enumerate(syncs) if x in used]
        if bad:
            kind, what = draw(st.sampled_from(bad))
            if kind == "param":
                params.append(what)
            else:
                syncs.pop(what)
            ill = True
    if not params:
        return None, ill
    return Step(optimizer, options, tuple(p.name for p in params), tuple(syncs)), ill


# ---------------------------------------------------------------------------
# The runner

COUNTS: Counter[str] = Counter()  # programs run / accepted / rejected, and the surprises (see test_fuzz)
SURPRISES: list[str] = []  # the first few programs the generator meant well-typed that the checker rejected
ACCEPTED_ILL: list[str] = []  # the first few programs the generator meant ill-typed that the checker accepted


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
    if stmt.op in FOREACH:
        if stmt.op == "foreach_scale":
            return torch._foreach_mul(args[:2], 0.5)
        fn = getattr(torch, "_" + stmt.op)
        return fn(args[:2], args[2:]) if len(args) == 4 else fn(args)
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
    return {coord_of[r]: v.clone() for r, v in rank_values(t).items()}


def _close(got: Den, want: Den, what: str, program: Program) -> None:
    if got.vary != want.vary:
        raise AssertionError(f"{what}: the checker's type makes it a list on axes {got.vary}, the meaning "
                             f"on axes {want.vary}\n{program!r}")
    for key, w in want.data.items():
        w = w.detach()
        # float64; the two sides sum in different orders (a P value's shares before or after an op), so the
        # rounding error scales with the largest magnitude around; a wrong program is off by O(1) of the value
        finite = w[torch.isfinite(w)]
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        try:
            torch.testing.assert_close(got.data[key], w, rtol=1e-6, atol=1e-8 * scale, equal_nan=True)
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
    if not program.well_typed and len(ACCEPTED_ILL) < 5:
        ACCEPTED_ILL.append(repr(program))
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
            result = _apply(stmt, env, mesh)
            if isinstance(result, (list, tuple)):
                env[f"{stmt.out}_0"], env[f"{stmt.out}_1"] = result
            else:
                env[stmt.out] = result
        outs = [env[o] for o in program.outputs]
        out_types = [tuple(_type_str(_type_of(o)[a]) for a in names) for o in outs]
        with maybe_disable_local_tensor_mode():
            cot_values = [_random_per_rank(tuple(map(backward_type, t)), tuple(o.shape), sorted(coord_of.values()),
                                           program.seed + 7 + k) for k, (o, t) in enumerate(zip(outs, out_types))]
        cots = [per_rank(lambda r, c=c: c[coord_of[r]].clone()) for c in cot_values]
        try:
            torch.autograd.backward(outs, cots)
        except spmd.SpmdTypeError as e:  # the backward's types follow from the forward's: never a rejection here
            raise AssertionError(f"the checker accepted the forward but rejected its backward: {e}\n{program!r}") from None
        got_outs = [_by_coord(o, coord_of) for o in outs]  # copies: the step may write an output's storage
        grads = {i.name: _by_coord(leaves[i.name].grad, coord_of) for i in program.inputs}
        if program.step is not None:
            _step(program, leaves)
    stepped = {p: _by_coord(leaves[p], coord_of) for p in program.step.params} if program.step else {}
    return got_outs, out_types, cot_values, grads, stepped


def _step(program: Program, leaves: dict[str, torch.Tensor]) -> None:
    """Sync the gradients the step names, then one optimizer step on the parameters."""
    assert program.step is not None
    for x, axis in program.step.syncs:
        if leaves[x].grad is not None:
            leaves[x].grad = spmd.all_reduce(leaves[x].grad, axis, src=spmd.P, dst=spmd.R)
    params = [leaves[p] for p in program.step.params]
    getattr(torch.optim, program.step.optimizer)(params, **dict(program.step.options)).step()


def _type_of(t: torch.Tensor) -> dict:
    ty = spmd.get_type(t)
    if ty is None:
        raise AssertionError("an output of an accepted program is untyped")
    return ty


def _check_against_oracle(program: Program, names: tuple[str, ...], values: dict, got_outs: list,
                          out_types: list, cot_values: list, grads: dict, stepped: dict) -> None:
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
    if program.step is not None:
        COUNTS["optimizer steps checked"] += 1
        want = step(program, den_in, want_grads)
        types = {i.name: i.types for i in program.inputs}
        for p, per_rank_values in stepped.items():
            try:
                got = read(per_rank_values, types[p], names)
            except Mismatch as e:
                raise AssertionError(f"parameter {p} after the step: {e}\n{program!r}") from None
            _close(got, want[p], f"parameter {p} after the optimizer step", program)


def _all_coords(shape: Any) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [c + (i,) for c in out for i in range(n)]
    return out
