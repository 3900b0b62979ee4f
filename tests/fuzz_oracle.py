"""The soundness fuzzer's oracle: a denotational interpreter of straight-line SPMD programs, in plain torch.

This module never imports ``spmd_types``: it is the independent side of the
comparison in ``tests/test_fuzz.py``. It reads the program's type annotations
(the ``src``/``dst`` of each type-changing call, the declared types of inputs
and outputs) as strings, and gives every value its meaning (CONTRACT section 1):

* on an axis where a value is ``R`` or ``I`` it denotes one tensor (every rank holds it);
* ``V`` or ``S(d)``: a list of tensors, one per rank (``S(d)`` additionally says that the
  list means its concatenation on dim ``d``: the collectives that read or write an
  ``S(d)`` value concatenate or chunk on ``d``);
* ``P``: one tensor, the sum of the per-rank values.

A :class:`Den` holds a value's meaning on all axes at once: one tensor per
coordinate of the axes on which it is a list. Ordinary torch ops act on the
meaning (an op of lists is the op of their entries); each type-changing call
acts by its specification (``all_reduce`` of ``P``: the sum, which the
denotation already is; ``all_gather`` of ``V``: the stacked list; ``convert``
``R -> V``: ``x.unbind(0)``; ``reinterpret`` ``R -> P``: ``n * x``; ...).
Gradients are ``torch.autograd`` on the meaning.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = [
    "Inp", "Stmt", "Step", "Program", "Den", "Mismatch", "ORDINARY", "FOREACH", "TYPE_OPS", "TYPE_FUNCTIONS",
    "TYPE_ONLY_FIRST",
    "step",
    "read", "evaluate", "gradients", "is_list_type", "backward_type",
]

# ---------------------------------------------------------------------------
# Programs: plain data, types spelled "R", "I", "V", "P", "S0", "S1", ...


@dataclass(frozen=True)
class Inp:
    """A program input: its type on each mesh axis (mesh order) and its local (per-rank) shape."""

    name: str
    types: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Stmt:
    """``out = op(*args, **params)``; a type-changing op also has ``axis``, ``src`` and ``dst``."""

    out: str
    op: str
    args: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()
    axis: str | None = None
    src: str | None = None
    dst: str | None = None

    def code(self) -> str:
        args = ", ".join(self.args)
        kw = "".join(f", {k}={v!r}" for k, v in self.params)
        if self.op in TYPE_FUNCTIONS:
            return (f"{self.out} = {TYPE_FUNCTIONS[self.op][1]}.apply({args}, group({self.axis!r}))  "
                    f"# claims spmd.{TYPE_FUNCTIONS[self.op][0]}(src={_code(self.src)}, dst={_code(self.dst)})")
        if self.op in FOREACH:
            return f"{self.out}_0, {self.out}_1 = {FOREACH[self.op][2].format(*self.args)}"
        if self.op in TYPE_OPS:
            return f"{self.out} = spmd.{self.op}({args}, {self.axis!r}, src={_code(self.src)}, dst={_code(self.dst)}{kw})"
        return f"{self.out} = {ORDINARY[self.op][1].format(*self.args, **dict(self.params))}"


@dataclass(frozen=True)
class Step:
    """After backward: all-reduce the gradients ``syncs`` ((input, axis) pairs), then one optimizer step on ``params``."""

    optimizer: str  # a torch.optim class name
    options: tuple[tuple[str, Any], ...]
    params: tuple[str, ...]
    syncs: tuple[tuple[str, str], ...]

    def code(self) -> list[str]:
        lines = [f"{x}.grad = spmd.all_reduce({x}.grad, {a!r}, src=P, dst=R)  # if {x} has a gradient"
                 for x, a in self.syncs]
        opts = "".join(f", {k}={v!r}" for k, v in self.options)
        return lines + [f"torch.optim.{self.optimizer}([{', '.join(self.params)}]{opts}).step()"]


@dataclass(frozen=True)
class Program:
    """A straight-line program on a mesh of ``axes`` ((name, size) pairs); ``outputs`` are its results."""

    axes: tuple[tuple[str, int], ...]
    inputs: tuple[Inp, ...]
    stmts: tuple[Stmt, ...]
    outputs: tuple[str, ...]
    well_typed: bool = True  # the generator's intent (the checker decides)
    seed: int = 0
    notes: tuple[str, ...] = field(default=())
    step: Step | None = None  # an optimizer step after the backward (with random cotangents)

    def __repr__(self) -> str:
        mesh = ", ".join(f"{a}={n}" for a, n in self.axes)
        lines = [f"# mesh ({mesh}); generated {'well' if self.well_typed else 'ill'}-typed; seed {self.seed}"]
        for i in self.inputs:
            types = ", ".join(f"{a!r}: {_code(t)}" for (a, _), t in zip(self.axes, i.types))
            lines.append(f"{i.name} = input({{{types}}}, local_shape={i.shape})")
        lines += [s.code() for s in self.stmts]
        lines.append(f"return {', '.join(self.outputs)}")
        if self.step is not None:
            lines += ["# backward from the outputs with random cotangents, then:"] + self.step.code()
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis prints failing examples with this
        printer.text("\n" + repr(self))


def _code(t: str | None) -> str:
    return f"S({t[1:]})" if t and t.startswith("S") else str(t)


def is_list_type(t: str) -> bool:
    """V and S(d) denote one tensor per rank."""
    return t == "V" or t.startswith("S")


def backward_type(t: str) -> str:
    """The type of a gradient: R <-> P swap; I, V, S(d) keep theirs."""
    return {"R": "P", "P": "R"}.get(t, t)


# ---------------------------------------------------------------------------
# Ordinary torch ops: (function, code template). The same function runs on the
# typed per-rank tensors (in the runner) and on the meaning (here).

ORDINARY: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "add": (lambda a, b: torch.add(a, b), "torch.add({0}, {1})"),
    "sub": (lambda a, b: a - b, "{0} - {1}"),
    "mul": (lambda a, b: a * b, "{0} * {1}"),
    "iadd": (lambda a, b: a.clone().add_(b), "{0}.clone().add_({1})"),
    "imul": (lambda a, b: a.clone().mul_(b), "{0}.clone().mul_({1})"),
    "div": (lambda a, b: a / (torch.sigmoid(b) + 0.5), "{0} / (torch.sigmoid({1}) + 0.5)"),
    "neg": (lambda a: -a, "-{0}"),
    "scale": (lambda a: a * 0.5, "{0} * 0.5"),
    "tanh": (torch.tanh, "torch.tanh({0})"),
    "sin": (torch.sin, "torch.sin({0})"),
    "exp": (lambda a: torch.exp(a), "torch.exp({0})"),
    "sum": (lambda a, dim: a.sum(dim), "{0}.sum({dim})"),
    "mean": (lambda a, dim: torch.mean(a, dim, keepdim=True), "torch.mean({0}, {dim}, keepdim=True)"),
    "amax": (lambda a, dim: torch.amax(a, dim), "torch.amax({0}, {dim})"),
    "gelu": (lambda a: F.gelu(a), "F.gelu({0})"),
    "layer_norm": (lambda a: F.layer_norm(a, a.shape[-1:]), "F.layer_norm({0}, {0}.shape[-1:])"),
    "where": (lambda c, a, b: torch.where(c > 0, a, b), "torch.where({0} > 0, {1}, {2})"),
    "matmul": (lambda a, b: a @ b, "{0} @ {1}"),
    "linear": (lambda a, b: F.linear(a, b), "F.linear({0}, {1})"),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), "torch.einsum('ij,jk->ik', {0}, {1})"),
    "softmax": (lambda a: torch.softmax(a, -1), "torch.softmax({0}, -1)"),
    "getitem": (lambda a: a[1:], "{0}[1:]"),
    "cat": (lambda a, b, dim: torch.cat([a, b], dim), "torch.cat([{0}, {1}], {dim})"),
    "transpose": (lambda a: a.transpose(0, 1), "{0}.transpose(0, 1)"),
    "flatten": (lambda a: a.flatten(), "{0}.flatten()"),
    "reshape": (lambda a, shape: a.reshape(shape), "{0}.reshape({shape})"),
    "unsqueeze": (lambda a: a.unsqueeze(0), "{0}.unsqueeze(0)"),
    "narrow": (lambda a, dim, length: a.narrow(dim, 0, length), "{0}.narrow({dim}, 0, {length})"),
    # custom autograd Functions (tests/fuzz_functions.py): the function each one computes
    "fn:tanh": (torch.tanh, "FusedTanh.apply({0})"),
    "fn:silu": (lambda a: a * torch.sigmoid(a), "CheckpointedSilu.apply({0})"),
    "fn:scale3": (lambda a: a * 3.0, "TransparentScale.apply({0})"),
    "fn:add_scaled": (lambda a, b: 2 * a + b, "AddScaled.apply({0}, {1})"),
    "fn:unregistered": (torch.tanh, "UnregisteredTanh.apply({0})"),
}


# Writing values along dim 0 into a buffer (issue 16 item 1): a plain buffer of zeros, the zeros of
# zeros_like / new_zeros of another value (whose type the buffer gets, not its values), ones, or zeros
# that require grad. Rows are folded onto the first half, so some entries get two values and some none.
def _rows(a: torch.Tensor) -> torch.Tensor:
    return torch.arange(a.shape[0], device=a.device) % max(1, a.shape[0] // 2)


def _grid(a: torch.Tensor) -> torch.Tensor:
    return torch.arange(a.numel(), device=a.device).view(a.shape) % max(1, a.shape[0] // 2)


def _filled(a: torch.Tensor, value: float, grad: bool = False) -> torch.Tensor:
    return torch.full(a.shape, value, dtype=a.dtype, device=a.device, requires_grad=grad)


ORDINARY.update({
    "zeros.scatter_add_": (lambda a: _filled(a, 0.0).scatter_add_(0, _grid(a), a),
                           "torch.zeros({0}.shape).scatter_add_(0, grid({0}), {0})"),
    "scatter_add(zeros)": (lambda a: torch.scatter_add(_filled(a, 0.0), 0, _grid(a), a),
                           "torch.scatter_add(torch.zeros({0}.shape), 0, grid({0}), {0})"),
    "zeros.index_add_": (lambda a: _filled(a, 0.0).index_add_(0, _rows(a), a),
                         "torch.zeros({0}.shape).index_add_(0, rows({0}), {0})"),
    "zeros.index_add": (lambda a: _filled(a, 0.0).index_add(0, _rows(a), a, alpha=2.0),
                        "torch.zeros({0}.shape).index_add(0, rows({0}), {0}, alpha=2.0)"),
    "zeros.index_put_": (lambda a: _filled(a, 0.0).index_put_((_rows(a),), a, accumulate=True),
                         "torch.zeros({0}.shape).index_put_((rows({0}),), {0}, accumulate=True)"),
    "index_put(zeros)": (lambda a: torch.index_put(_filled(a, 0.0), (_rows(a),), a, accumulate=True),
                         "torch.index_put(torch.zeros({0}.shape), (rows({0}),), {0}, accumulate=True)"),
    "zeros.scatter_reduce_": (lambda a: _filled(a, 0.0).scatter_reduce_(0, _grid(a), a, "sum"),
                              "torch.zeros({0}.shape).scatter_reduce_(0, grid({0}), {0}, 'sum')"),
    "scatter_reduce(zeros)": (lambda a: torch.scatter_reduce(_filled(a, 0.0), 0, _grid(a), a, "sum", include_self=False),
                              "torch.scatter_reduce(torch.zeros({0}.shape), 0, grid({0}), {0}, 'sum', include_self=False)"),
    "zeros_like.index_add": (lambda b, a: torch.zeros_like(b).index_add(0, _rows(a), a),
                             "torch.zeros_like({0}).index_add(0, rows({1}), {1})"),
    "new_zeros.scatter_add": (lambda b, a: b.new_zeros(a.shape).scatter_add(0, _grid(a), a),
                              "{0}.new_zeros({1}.shape).scatter_add(0, grid({1}), {1})"),
    "zeros_like.scatter_add_": (lambda b, a: torch.zeros_like(b).scatter_add_(0, _grid(a), a),
                                "torch.zeros_like({0}).scatter_add_(0, grid({1}), {1})"),
    "ones.scatter_add": (lambda a: _filled(a, 1.0).scatter_add(0, _grid(a), a),
                         "torch.ones({0}.shape).scatter_add(0, grid({0}), {0})"),
    "ones.index_add_": (lambda a: _filled(a, 1.0).index_add_(0, _rows(a), a),
                        "torch.ones({0}.shape).index_add_(0, rows({0}), {0})"),
    "zeros.scatter_amax": (lambda a: _filled(a, 0.0).scatter_reduce(0, _grid(a), a, "amax"),
                           "torch.zeros({0}.shape).scatter_reduce(0, grid({0}), {0}, 'amax')"),
    "zeros_grad.index_add": (lambda a: _filled(a, 0.0, grad=True).index_add(0, _rows(a), a),
                             "torch.zeros({0}.shape, requires_grad=True).index_add(0, rows({0}), {0})"),
})
# the ops whose first argument gives only a type (and a shape) to a buffer of zeros: no gradient reaches it
TYPE_ONLY_FIRST = frozenset({"zeros_like.index_add", "new_zeros.scatter_add", "zeros_like.scatter_add_"})

# torch._foreach_X over two-element lists: element i is the single-tensor op on element i of every list.
# name -> (lists taken, the single-tensor op, code)
FOREACH: dict[str, tuple[int, Callable[..., torch.Tensor], str]] = {
    "foreach_add": (2, torch.add, "torch._foreach_add([{0}, {1}], [{2}, {3}])"),
    "foreach_mul": (2, torch.mul, "torch._foreach_mul([{0}, {1}], [{2}, {3}])"),
    "foreach_scale": (1, lambda a: a * 0.5, "torch._foreach_mul([{0}, {1}], 0.5)"),
    "foreach_exp": (1, torch.exp, "torch._foreach_exp([{0}, {1}])"),
    "foreach_norm": (1, torch.linalg.vector_norm, "torch._foreach_norm([{0}, {1}])"),
}

# Custom autograd Functions registered as a type-changing op: (the op whose specification they claim, class)
TYPE_FUNCTIONS = {
    "fn:copy_to": ("reinterpret", "CopyToRegion"),
    "fn:reduce_from": ("all_reduce", "ReduceFromRegion"),
    "fn:gather_from": ("all_gather", "GatherFromRegion"),
    "fn:scatter_to": ("convert", "ScatterToRegion"),
    "fn:wrong_reduce": ("all_reduce", "WrongReduceFrom"),
}

TYPE_OPS = ("reinterpret", "convert", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "redistribute")


# ---------------------------------------------------------------------------
# Meanings


class Mismatch(AssertionError):
    """Per-rank values that do not have the meaning their type claims (an R value differing across ranks)."""


@dataclass
class Den:
    """A value's meaning: ``data[c]`` for each coordinate ``c`` of the axes (indices) in ``vary``."""

    vary: tuple[int, ...]
    data: dict[tuple[int, ...], torch.Tensor]
    unused: bool = False  # a gradient: the loss does not depend on the input at all


def read(values: dict[tuple[int, ...], torch.Tensor], types: tuple[str, ...], names: tuple[str, ...]) -> Den:
    """The meaning of per-rank ``values`` (keyed by mesh coordinate) of ``types``.

    V/S(d) axes index the result; on R/I axes every rank must hold the same
    value (else :class:`Mismatch`); P axes are summed.
    """
    vary = tuple(k for k, t in enumerate(types) if is_list_type(t))
    same = [k for k, t in enumerate(types) if t in ("R", "I")]
    groups: dict[tuple[int, ...], dict[tuple[int, ...], torch.Tensor]] = {}
    for coord, v in values.items():
        groups.setdefault(tuple(coord[k] for k in vary), {})[coord] = v
    data = {}
    for key, grid in groups.items():
        total = None
        for coord, v in sorted(grid.items()):
            if any(coord[k] != 0 for k in same):
                first = grid[tuple(0 if k in same else c for k, c in enumerate(coord))]
                if v.shape != first.shape or not torch.allclose(v, first, rtol=1e-9, atol=1e-9, equal_nan=True):
                    axis = next(names[k] for k in same if coord[k] != 0)
                    raise Mismatch(f"a {types[names.index(axis)]} value differs across ranks of axis '{axis}' "
                                   f"(rank coordinates {coord} vs {tuple(0 if k in same else c for k, c in enumerate(coord))})")
                continue
            total = v if total is None else total + v
        data[key] = total
    return Den(vary, data)


def _broadcast(dens: list[Den], sizes: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], list]]]:
    """An ordinary op on lists acts entrywise: the result is a list on the union of the operands' list axes."""
    vary = tuple(sorted(set().union(*(d.vary for d in dens))))
    rows = []
    for key in itertools.product(*(range(sizes[k]) for k in vary)):
        at = dict(zip(vary, key))
        rows.append((key, [d.data[tuple(at[k] for k in d.vary)] for d in dens]))
    return vary, rows


def _ordinary(stmt: Stmt, dens: list[Den], sizes: tuple[int, ...]) -> Den:
    fn = ORDINARY[stmt.op][0]
    if stmt.op in TYPE_ONLY_FIRST:  # zeros_like(b): zeros whatever b holds, so one tensor, never a list
        dens = [Den((), {(): next(iter(dens[0].data.values()))})] + dens[1:]
    vary, rows = _broadcast(dens, sizes)
    return Den(vary, {key: fn(*ts, **dict(stmt.params)) for key, ts in rows})


# One axis at a time: ``item`` is the list of per-rank tensors (src V/S(d)) or the one tensor.


def _full(item: Any, src: str, params: dict) -> torch.Tensor:
    """The one tensor a list means: stacked (V, on a new dim gather_dim when given) or concatenated (S(d))."""
    if src.startswith("S"):
        return torch.cat(item, int(src[1:]))
    return torch.stack(item, params.get("gather_dim") or 0)  # V: stacked, on gather_dim when given


def _slices(x: torch.Tensor, dst: str, n: int, params: dict) -> list[torch.Tensor]:
    """The list a tensor becomes when each rank keeps its part: x[rank] (V) or chunk rank of dim d (S(d))."""
    if dst.startswith("S"):
        return list(x.chunk(n, int(dst[1:])))
    return list(x.unbind(params.get("scatter_dim") or 0))  # V: this rank's entry of dim 0, or of scatter_dim


def _total(item: Any, src: str) -> torch.Tensor:
    """src=V on a reduction means reinterpret(V, P) first: the list's sum."""
    return torch.stack(item).sum(0) if is_list_type(src) else item


def _reinterpret(item: Any, src: str, dst: str, n: int, params: dict) -> Any:
    if is_list_type(src):  # V -> P: the per-rank values become a pending sum
        return torch.stack(item).sum(0)
    if is_list_type(dst):  # R/I -> V: every rank keeps its copy
        return [item] * n
    return item * n if dst == "P" else item  # R -> P: n copies summed; R <-> I: same value


def _convert(item: Any, src: str, dst: str, n: int, params: dict) -> Any:
    if is_list_type(src):  # V -> P: each rank places its slice in zeros, then the sum
        return torch.stack(item) if src == "V" else torch.cat(item, int(src[1:]))
    if is_list_type(dst):
        return _slices(item, dst, n, params)
    return item  # R/I -> R/I/P: same value


def _all_to_all(item: list, src: str, dst: str, n: int, params: dict) -> list:
    if src.startswith("S") and dst.startswith("S"):  # the meaning is kept: re-slice the concatenation
        return list(torch.cat(item, int(src[1:])).chunk(n, int(dst[1:])))
    split = int(src[1:]) if src.startswith("S") else params.get("split_dim") or 0  # the published meaning
    concat = int(dst[1:]) if dst.startswith("S") else params.get("concat_dim") or 0
    if src == "V" and dst == "V" and split != concat:  # unbind split_dim, stack what arrives on concat_dim
        return [torch.stack([x.select(split, j) for x in item], concat) for j in range(n)]
    pieces = [x.chunk(n, split) for x in item]  # rank j receives piece j of every rank's value
    return [torch.cat([pieces[r][j] for r in range(n)], concat) for j in range(n)]


def _redistribute(item: Any, src: str, dst: str, n: int, params: dict) -> Any:
    whole = _full(item, src, {}) if is_list_type(src) else item  # the meaning is kept
    return _slices(whole, dst, n, {}) if is_list_type(dst) else whole


_SPECS: dict[str, Callable[..., Any]] = {
    "reinterpret": _reinterpret,
    "convert": _convert,
    "all_reduce": lambda item, src, dst, n, params: _total(item, src),
    "all_gather": lambda item, src, dst, n, params: _full(item, src, params),
    "reduce_scatter": lambda item, src, dst, n, params: _slices(_total(item, src), dst, n, params),
    "all_to_all": _all_to_all,
    "redistribute": _redistribute,
}


def _type_op(stmt: Stmt, spec: str, den: Den, axis_names: tuple[str, ...], sizes: tuple[int, ...]) -> Den:
    k = axis_names.index(stmt.axis)
    n = sizes[k]
    src, dst = stmt.src, stmt.dst
    assert src is not None and dst is not None
    rest = tuple(a for a in den.vary if a != k)
    grouped: dict[tuple[int, ...], Any] = {}
    for key, t in den.data.items():
        at = dict(zip(den.vary, key))
        other = tuple(at[a] for a in rest)
        if k in den.vary:
            grouped.setdefault(other, [None] * n)[at[k]] = t
        else:
            grouped[other] = t
    if is_list_type(src) != (k in den.vary):
        raise Mismatch(f"{stmt.code()}: src={src} but the value is {'a list' if k in den.vary else 'one tensor'} "
                       f"on axis '{stmt.axis}'")
    out_vary = tuple(sorted(rest + (k,))) if is_list_type(dst) else rest
    data = {}
    for other, item in grouped.items():
        res = _SPECS[spec](item, src, dst, n, dict(stmt.params))
        at = dict(zip(rest, other))
        if is_list_type(dst):
            for r, t in enumerate(res):
                at[k] = r
                data[tuple(at[a] for a in out_vary)] = t
        else:
            data[tuple(at[a] for a in out_vary)] = res
    return Den(out_vary, data)


def evaluate(program: Program, inputs: dict[str, Den]) -> dict[str, Den]:
    """Run ``program`` on meanings: every value's meaning, by name."""
    names = tuple(a for a, _ in program.axes)
    sizes = tuple(n for _, n in program.axes)
    env = dict(inputs)
    for stmt in program.stmts:
        args = [env[a] for a in stmt.args]
        if stmt.op in FOREACH:
            lists, single, _ = FOREACH[stmt.op]
            for i in range(2):  # element i of each list: args i, 2 + i
                vary, rows = _broadcast([args[i + 2 * k] for k in range(lists)], sizes)
                env[f"{stmt.out}_{i}"] = Den(vary, {key: single(*ts) for key, ts in rows})
        elif stmt.op in TYPE_OPS or stmt.op in TYPE_FUNCTIONS:
            spec = TYPE_FUNCTIONS[stmt.op][0] if stmt.op in TYPE_FUNCTIONS else stmt.op
            env[stmt.out] = _type_op(stmt, spec, args[0], names, sizes)
        else:
            env[stmt.out] = _ordinary(stmt, args, sizes)
    return env


def gradients(outputs: list[Den], cotangents: list[Den], inputs: dict[str, Den]) -> dict[str, Den]:
    """The gradient of the loss sum <output, cotangent> (over every list entry) with respect to each input's meaning."""
    loss = torch.zeros((), dtype=torch.float64)
    for out, cot in zip(outputs, cotangents):
        if out.vary != cot.vary:
            raise Mismatch(f"an output is a list on axes {out.vary} but its gradient on {cot.vary}")
        for key, t in out.data.items():
            loss = loss + (t * cot.data[key]).sum()
    leaves = [(name, key, t) for name, d in inputs.items() for key, t in d.data.items()]
    grads: Any = [None] * len(leaves)
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, [t for _, _, t in leaves], allow_unused=True)
    out: dict[str, Den] = {name: Den(d.vary, {}, unused=True) for name, d in inputs.items()}
    for (name, key, t), g in zip(leaves, grads):
        out[name].data[key] = torch.zeros_like(t) if g is None else g
        out[name].unused &= g is None
    return out


def step(program: Program, inputs: dict[str, Den], grads: dict[str, Den]) -> dict[str, Den]:
    """The parameters after ``program.step``: the same optimizer, on the meanings, with the meanings' gradients.

    An optimizer updates each element from that element's own gradient, so a list (V) parameter is
    one parameter per entry, and an R parameter one tensor whose gradient is the whole gradient.
    """
    assert program.step is not None
    params = []
    new: dict[str, Den] = {}
    for name in program.step.params:
        d = inputs[name]
        new[name] = Den(d.vary, {})
        for key, t in d.data.items():
            p = t.detach().clone().requires_grad_()
            # contiguous: torch 2.13's fused CPU Adam reads a non-contiguous gradient (autograd's gradient of a
            # transposed input) as if it were contiguous (test_fuzz.py pins that torch bug)
            p.grad = None if grads[name].unused else grads[name].data[key].detach().clone(memory_format=torch.contiguous_format)
            params.append(p)
            new[name].data[key] = p
    getattr(torch.optim, program.step.optimizer)(params, **dict(program.step.options)).step()
    return new
