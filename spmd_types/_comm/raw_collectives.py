"""Raw ``torch.distributed`` collectives on typed tensors: typed as seed 003 says, or rejected.

A raw collective reaches ``LTensor.__torch_function__`` (``torch.distributed``
calls ``handle_torch_function``; ``torch.ops._c10d_functional`` ops are torch
ops). ``RAW_OPS`` says, as data, what each one is: which typed op it acts as,
and its form:

* ``FUNCTIONAL`` (``_functional_collectives``, ``torch.ops._c10d_functional``):
  a new tensor. It runs as the typed op (``spmd.all_reduce(x, 'tp', src=P,
  dst=R)`` for an all-reduce of a P tensor), so its result is typed and its
  backward is seed 003's.
* ``IN_PLACE`` (``dist.all_reduce``, ``dist.broadcast``): the rule for in-place
  ops applies: an in-place op cannot change its tensor's type (docs/index.md,
  decision 7). An all-reduce of a P (or V) tensor makes it R, so it is rejected,
  and the fix is the typed call, assigned: ``x = spmd.all_reduce(x, ...)``. What
  keeps the type (a broadcast of an R or I tensor, a max of one) runs.
* ``OUT`` (``dist.all_gather_into_tensor``, ``dist.reduce_scatter_tensor``,
  ``dist.all_to_all_single``): the result is written into ``output``, so
  ``output`` must already carry the result's type (decision 7: a typed result
  is never written into a plain tensor).

Raw ``torch.distributed`` collectives have no backward: one whose input
requires grad is rejected (its gradient would stop there silently). Every
other collective (list forms, point-to-point, coalesced, ``torch.ops.c10d``) on
a typed tensor is rejected, naming the typed op to use. All checks come before
any communication. The process group is read as the mesh axis it is (or the
flattening of several axes, e.g. the default group of a 2-D mesh).
"""

from __future__ import annotations

import enum
import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .._checker.tensor import HANDLERS, _DisableTF, _run, _wrap, format_tensor_type
from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.implicit_mesh import mesh_of_space
from .._core.mesh import current_mesh, set_current_mesh
from .._core.types import I, P, R, S, SpmdType, TypeMap, V
from .._torch.private import (
    c10d_functional,
    default_group,
    dispatch_get_all_op_names,
    functional_collectives,
    op_schema,
    resolve_process_group,
    simulator,
)
from .call import unwrap
from .collectives import all_gather, all_reduce, all_to_all, reduce_scatter

__all__ = ["RAW_OPS", "RawOp", "Form"]


class Form(enum.Enum):
    FUNCTIONAL = "returns a new tensor"
    IN_PLACE = "writes its input"
    OUT = "writes its output argument"
    PASS = "passes its input through"
    REJECTED = "not typed"


@dataclass(frozen=True)
class RawOp:
    """One raw collective: what it acts as (``kind``), its form, and where its arguments are."""

    kind: str  # all_reduce | broadcast | all_gather | reduce_scatter | all_to_all | pass | rejected
    form: Form
    display: str
    input: str = "input"
    output: str | None = None
    reduce: str | None = None  # the argument naming the reduction (None: not a reduction)
    group: str = "group"  # a ProcessGroup (None: the default group) or, for ops, a group name
    root: str | None = None  # broadcast's source rank
    typed: str = ""  # for a rejected op: the typed spelling to use instead


_F = "torch.ops._c10d_functional."
_D = "torch.distributed."
_UNSUPPORTED_FIX = "the typed ops: spmd.all_reduce, spmd.all_gather, spmd.reduce_scatter, spmd.all_to_all"

# name -> RawOp. Names starting with "op:" are _c10d_functional ops (both the packet and .default).
RAW_OPS: dict[str, RawOp] = {
    "all_reduce": RawOp("all_reduce", Form.IN_PLACE, _D + "all_reduce", "tensor", reduce="op"),
    "broadcast": RawOp("broadcast", Form.IN_PLACE, _D + "broadcast", "tensor", root="src"),
    # all_gather_single / reduce_scatter_single are the names torch 2.13 gives all_gather_into_tensor /
    # reduce_scatter_tensor (the old names call the new ones); older torch has only the old names
    **{n: RawOp("all_gather", Form.OUT, _D + n, "input_tensor", output="output_tensor")
       for n in ("all_gather_single", "all_gather_into_tensor")},
    **{n: RawOp("reduce_scatter", Form.OUT, _D + n, "input", output="output", reduce="op")
       for n in ("reduce_scatter_single", "reduce_scatter_tensor")},
    "all_to_all_single": RawOp("all_to_all", Form.OUT, _D + "all_to_all_single", "input", output="output"),
    "op:all_reduce": RawOp("all_reduce", Form.FUNCTIONAL, _F + "all_reduce", reduce="reduce_op",
                           group="group_name"),
    "op:all_reduce_": RawOp("all_reduce", Form.IN_PLACE, _F + "all_reduce_", reduce="reduce_op",
                            group="group_name"),
    "op:all_gather_into_tensor": RawOp("all_gather", Form.FUNCTIONAL, _F + "all_gather_into_tensor",
                                       group="group_name"),
    "op:reduce_scatter_tensor": RawOp("reduce_scatter", Form.FUNCTIONAL, _F + "reduce_scatter_tensor",
                                      reduce="reduce_op", group="group_name"),
    "op:all_to_all_single": RawOp("all_to_all", Form.FUNCTIONAL, _F + "all_to_all_single", group="group_name"),
    "op:broadcast": RawOp("broadcast", Form.FUNCTIONAL, _F + "broadcast", root="src", group="group_name"),
    "op:broadcast_": RawOp("broadcast", Form.IN_PLACE, _F + "broadcast_", root="src", group="group_name"),
    "op:wait_tensor": RawOp("pass", Form.PASS, _F + "wait_tensor", "tensor"),
    "op:_wrap_tensor_autograd": RawOp("pass", Form.PASS, _F + "_wrap_tensor_autograd"),
    # list forms, point-to-point, rooted and coalesced collectives: not typed
    "all_gather": RawOp("rejected", Form.REJECTED, _D + "all_gather",
                        typed="spmd.all_gather(x, axis, src=spmd.V, dst=spmd.R).unbind(0)"),
    "reduce_scatter": RawOp("rejected", Form.REJECTED, _D + "reduce_scatter",
                            typed="spmd.reduce_scatter(torch.stack(xs), axis, src=spmd.P, dst=spmd.V)"),
    "all_to_all": RawOp("rejected", Form.REJECTED, _D + "all_to_all",
                        typed="spmd.all_to_all(x, axis, src=spmd.V, dst=spmd.V, split_dim=, concat_dim=)"),
    **{n: RawOp("rejected", Form.REJECTED, _D + n) for n in (
        "all_reduce_coalesced", "all_gather_coalesced", "reduce", "gather", "scatter", "send", "recv",
        "isend", "irecv")},
}


class Plan(NamedTuple):
    """What a raw collective does to a value of type ``src``: its typed equivalent, or why there is none."""

    dst: SpmdType | None  # the result's type on the group's axes; None: no typed equivalent
    call: str = ""  # the typed call, as code ("x" when the value is unchanged)
    run: Callable[[torch.Tensor], torch.Tensor] | None = None  # runs the typed call (None: run the raw op)
    why: str = ""
    fixes: tuple[str, ...] = ()


class _Site(NamedTuple):
    """One call: its table row, bound arguments, the group's mesh axes, and the input's types."""

    raw: RawOp
    args: dict[str, Any]
    names: tuple[str, ...]
    types: TypeMap
    src: SpmdType

    @property
    def label(self) -> str:
        return f"'{self.names[0]}'" if len(self.names) == 1 else "(" + ", ".join(f"'{n}'" for n in self.names) + ")"

    @property
    def axis(self) -> Any:
        return self.names[0] if len(self.names) == 1 else self.names


# ---------------------------------------------------------------------------
# plans, one per kind


def _reinterpreted(site: _Site, dst: SpmdType) -> str:
    """``x`` reinterpreted from R or I to ``dst`` (P or V), as code."""
    x = "x"
    src = site.src
    if src is I and dst is P:
        x, src = f"spmd.reinterpret(x, {site.label}, src=spmd.I, dst=spmd.R)", R
    return f"spmd.reinterpret({x}, {site.label}, src={src.code()}, dst={dst.code()})"


def _plan_all_reduce(site: _Site, reduce: str) -> Plan:
    src, lab = site.src, site.label
    if src is R or src is I:
        if reduce in ("avg", "max", "min"):
            return Plan(src, "x")  # over equal copies: the value itself
        fix = f"spmd.all_reduce({_reinterpreted(site, P)}, {lab}, src=spmd.P, dst=spmd.R)"
        return Plan(None, why=f"every rank holds the same {src} value, so their {reduce} is not a typed "
                    "all_reduce (seed 003 reduces P or V values).", fixes=(fix,))
    if reduce in ("sum", "avg"):
        s = P if src is P else V
        opt = ', op="avg"' if reduce == "avg" else ""
        return Plan(R, f"spmd.all_reduce(x, {lab}, src={s.code()}, dst=spmd.R{opt})",
                    lambda x: all_reduce(x, site.axis, src=s, dst=R, op=reduce))
    if reduce in ("max", "min") and src is not P:
        return Plan(R, f'spmd.all_reduce(x, {lab}, src=spmd.V, dst=spmd.R, op="{reduce}")',
                    lambda x: all_reduce(x, site.axis, src=V, dst=R, op=reduce))
    if src is P:
        return Plan(None, why=f"a pending sum means the sum over ranks, and the {reduce} of its summands "
                    "is not a function of that sum.", fixes=(f"spmd.all_reduce(x, {lab}, src=spmd.P, dst=spmd.R)",))
    return Plan(None, why=f"op={reduce} has no typed all_reduce.",
                fixes=(f"spmd.all_gather(x, {lab}, src=spmd.V, dst=spmd.R), then reduce its dim 0 locally",))


def _plan_broadcast(site: _Site, root: int | str) -> Plan:
    src, lab = site.src, site.label
    if src is R or src is I:
        return Plan(src, "x")  # every rank already holds the value
    if src is P:
        return Plan(None, why="a broadcast keeps one rank's summand of a pending sum, which is not its value.",
                    fixes=(f"spmd.all_reduce(x, {lab}, src=spmd.P, dst=spmd.R)",))
    return Plan(None, why=f"a broadcast gives every rank rank {root}'s value: a V value would become R, "
                "with no backward in seed 003's table.",
                fixes=(f"spmd.all_gather(x, {lab}, src=spmd.V, dst=spmd.R)[{root}]",))


def _plan_all_gather(site: _Site) -> Plan:
    src, lab = site.src, site.label
    if src.is_varying:
        # the raw gather concatenates on dim 0: a V input read as its shards of dim 0 (V with gather_dim stacks)
        return Plan(R, f"spmd.all_gather(x, {lab}, src=spmd.S(0), dst=spmd.R)",
                    lambda x: all_gather(x, site.axis, src=S(0), dst=R))
    if src is P:
        return Plan(None, why="an all-gather takes per-rank (V) values, and a P value is one pending sum.",
                    fixes=(f"spmd.all_reduce(x, {lab}, src=spmd.P, dst=spmd.R)",))
    fix = f"spmd.all_gather({_reinterpreted(site, V)}, {lab}, src=spmd.S(0), dst=spmd.R)"
    return Plan(None, why=f"an all-gather takes per-rank (V) values; gathering the copies of an {src} value "
                "is not a typed all_gather.", fixes=(fix,))


def _plan_reduce_scatter(site: _Site, reduce: str) -> Plan:
    src, lab = site.src, site.label
    if reduce not in ("sum", "avg"):
        return Plan(None, why=f"op={reduce} has no typed reduce_scatter.")
    opt = ', op="avg"' if reduce == "avg" else ""
    if src is R or src is I:
        fix = f"spmd.reduce_scatter({_reinterpreted(site, P)}, {lab}, src=spmd.P, dst=spmd.S(0){opt})"
        return Plan(None, why=f"every rank holds the same {src} value, so their {reduce} is not a typed "
                    "reduce_scatter (seed 003 reduces P or V values).", fixes=(fix,))
    s = P if src is P else V
    return Plan(S(0), f"spmd.reduce_scatter(x, {lab}, src={s.code()}, dst=spmd.S(0){opt})",
                lambda x: reduce_scatter(x, site.axis, src=s, dst=S(0), op=reduce))


def _plan_all_to_all(site: _Site, even: bool) -> Plan:
    src, lab = site.src, site.label
    call = f"spmd.all_to_all(x, {lab}, src=spmd.V, dst=spmd.V, split_dim=0, concat_dim=0)"
    if src.is_varying:
        run = (lambda x: all_to_all(x, site.axis, src=V, dst=V, split_dim=0, concat_dim=0)) if even else None
        return Plan(V, call, run)
    fixes = () if src is P else (call.replace("(x,", f"({_reinterpreted(site, V)},", 1),)
    return Plan(None, why=f"an all-to-all exchanges per-rank (V) blocks; seed 003 has no all_to_all from {src}.",
                fixes=fixes)


def _plan(site: _Site) -> Plan:
    raw, a = site.raw, site.args
    if raw.kind == "all_reduce":
        return _plan_all_reduce(site, _reduce_name(a[raw.reduce]))
    if raw.kind == "broadcast":
        return _plan_broadcast(site, _group_root(a, raw))
    if raw.kind == "all_gather":
        return _plan_all_gather(site)
    if raw.kind == "reduce_scatter":
        return _plan_reduce_scatter(site, _reduce_name(a[raw.reduce]))
    return _plan_all_to_all(site, _even_splits(a))


def _reduce_name(op: Any) -> str:
    if isinstance(op, str):
        return op.lower()
    name = getattr(op, "name", None)
    return name.lower() if isinstance(name, str) else str(op).lower()


def _group_root(a: dict[str, Any], raw: RawOp) -> int | str:
    """The broadcast's source as a rank of its group (``"k"`` when torch itself will reject the arguments)."""
    if raw.group == "group_name":
        return int(a["src"])
    if a.get("group_src") is not None:
        return int(a["group_src"])
    if a.get("src") is None:
        return "k"
    group = a["group"] or default_group()
    try:
        return dist.get_group_rank(group, a["src"])
    except (ValueError, RuntimeError):  # not a rank of the group: torch says so when it runs
        return "k"


def _even_splits(a: dict[str, Any]) -> bool:
    sizes = [s for s in (a.get("output_split_sizes"), a.get("input_split_sizes")) if s]
    return all(all(type(v) is int for v in s) and len(set(s)) == 1 for s in sizes)  # SymInts: per-rank sizes


# ---------------------------------------------------------------------------
# the process group as mesh axes


_AXES_CACHE: dict[tuple, tuple[str, ...] | None] = {}


def _process_group(raw: RawOp, a: dict[str, Any]) -> Any:
    group = a.get(raw.group)
    if isinstance(group, str):
        return resolve_process_group(group)
    return group if group is not None else default_group()


def _axes_of(group: Any) -> tuple[str, ...] | None:
    """The mesh axes ``group`` runs over: one axis, or several flattened (e.g. the default group); or None."""
    mesh = current_mesh()
    if mesh is None:
        return None
    for name, g in mesh.groups.items():
        if g is group:
            return (name,)
    # the objects themselves, not their ids (a new mesh may reuse a dead one's id); bounded below
    key = (mesh.device_mesh if mesh.device_mesh is not None else mesh, mesh.axis_names, group)
    if key not in _AXES_CACHE:
        if len(_AXES_CACHE) > 256:
            _AXES_CACHE.clear()
        _AXES_CACHE[key] = _match_ranks(mesh, frozenset(dist.get_process_group_ranks(group)))
    return _AXES_CACHE[key]


def _match_ranks(mesh: Any, ranks: frozenset) -> tuple[str, ...] | None:
    dm = mesh.device_mesh
    if dm is None:
        found = [n for n, g in mesh.groups.items() if frozenset(dist.get_process_group_ranks(g)) == ranks]
        return (found[0],) if found else None
    with simulator().maybe_disable_local_tensor_mode():
        flat = [int(r) for r in dm.mesh.flatten().tolist()]
        shape = tuple(int(n) for n in dm.mesh.shape)
    coords = list(itertools.product(*[range(n) for n in shape]))  # row-major, as ``flat``
    where = {r: c for r, c in zip(flat, coords)}
    if not ranks or not ranks <= where.keys():
        return None
    me = where[min(ranks)]  # the group's line through one of its ranks: the other axes fixed there
    names = list(mesh.axis_names)
    for k in range(1, len(names) + 1):
        for chosen in itertools.combinations(range(len(names)), k):
            line = frozenset(r for r, c in zip(flat, coords)
                             if all(c[i] == me[i] for i in range(len(shape)) if i not in chosen))
            if line == ranks:
                return tuple(names[i] for i in chosen)
    return None


# ---------------------------------------------------------------------------
# the handler


def _handle(func: Any, args: tuple, kwargs: dict) -> Any:
    raw = _BY_FUNC[func]
    if raw.form is Form.REJECTED:
        raise _error(raw, f"{raw.display} on a typed tensor is not typed by spmd_types, so it would leave a "
                     "wrong type behind.", [("op", raw.display)], [raw.typed or _UNSUPPORTED_FIX])
    a = _bind(func, args, kwargs)
    x = a[raw.input]
    types = getattr(x, "_spmd_types", None)
    if raw.form is Form.PASS:
        return _pass(raw, x, types)
    if types is None:  # only another argument is typed (an output buffer): nothing to type here
        return _run(func, args, kwargs)
    if current_mesh() is None:  # typed by groups alone: the input's own mesh
        own = mesh_of_space(types.space)
        if own is not None:
            with set_current_mesh(own):
                return _handle(func, args, kwargs)
    site = _site(raw, a, x, types)
    plan = _plan(site)
    if plan.dst is None:
        raise _error(raw, f"{raw.display} on axis {site.label} has no typed equivalent for a {site.src} input: "
                     + plan.why, _seen(site, x), plan.fixes)
    result = _result_types(site, plan.dst)
    if raw.form is Form.FUNCTIONAL:
        return _functional(func, args, kwargs, x, plan, result)
    if raw.form is Form.IN_PLACE and plan.dst is not site.src:
        raise _error(raw, f"{raw.display} writes its input in place, and an in-place op cannot change its "
                     f"tensor's type: on axis {site.label} it takes {site.src} to {plan.dst}.",
                     _seen(site, x) + [("axis", f"{site.label}: {site.src} -> {plan.dst}")], [f"x = {plan.call}"])
    if raw.form is Form.OUT:
        _check_output(site, a[raw.output], result, plan)
    with _DisableTF():
        needs_grad = x.requires_grad and torch.is_grad_enabled()
    if needs_grad:
        fix = f"{'x' if raw.form is Form.IN_PLACE else 'out'} = {plan.call}"
        raise _error(raw, f"{raw.display} has no backward: its input requires grad, and the gradient would "
                     "stop at this collective silently.", _seen(site, x), [fix] if plan.call != "x" else [])
    return _run(func, args, kwargs)


def _site(raw: RawOp, a: dict[str, Any], x: torch.Tensor, types: TypeMap) -> _Site:
    group = _process_group(raw, a)
    names = _axes_of(group)
    if names is None:
        mesh = current_mesh()
        axes = ", ".join(mesh.axis_names) if mesh is not None else "no mesh is current"
        raise _error(raw, f"{raw.display} runs on a process group that is not an axis of the current mesh (nor "
                     "a flattening of some of its axes), so what it does to the types is unknown.",
                     [("op", raw.display), ("group", f"ranks {sorted(dist.get_process_group_ranks(group))}"),
                      ("mesh", axes)],
                     ["name the group as an axis: spmd.set_current_mesh({'name': group, ...})"])
    have = [types.get(n) for n in names]
    if any(h is None for h in have):
        missing = [n for n, h in zip(names, have) if h is None]
        raise _error(raw, f"{raw.display}: the input has no type on axis '{missing[0]}'.",
                     [("op", raw.display), ("input", format_tensor_type(x, types))],
                     [f"spmd.assert_type(x, {{'{missing[0]}': ...}})"])
    src = have[0]
    if any(h is not src for h in have[1:]):
        if not all(h.is_varying for h in have):
            shown = ", ".join(f"{n}: {h}" for n, h in zip(names, have))
            raise _error(raw, f"{raw.display} runs on the flattened axes {tuple(names)}, and the input's types "
                         f"differ on them ({shown}); one typed call per axis says what is meant.",
                         [("op", raw.display), ("input", format_tensor_type(x, types))], [])
        src = V
    return _Site(raw, a, names, types, src)


def _result_types(site: _Site, dst: SpmdType) -> TypeMap:
    types = site.types
    for n in site.names:
        types = types.replace(n, dst)
    return types


def _check_output(site: _Site, out: Any, result: TypeMap, plan: Plan) -> None:
    raw = site.raw
    out_types = getattr(out, "_spmd_types", None)
    if out_types is None:
        raise _error(raw, f"{raw.display} writes a typed result ({plan.dst} on axis {site.label}) into a plain "
                     "(untyped) output tensor, which would lose the type.",
                     [("op", raw.display), ("result", result.format()), ("output", "plain tensor (untyped)")],
                     [f"out = {plan.call}"])
    for axis, t in result.items:
        have = out_types.get(axis)
        if have is t or (have is not None and have.is_varying and t.is_varying):
            continue
        raise _error(raw, f"{raw.display} writes a result that is {t} on axis '{axis}' into an output tensor "
                     f"that is {have}.", [("op", raw.display), ("result", result.format()),
                                          ("output", out_types.format())], [f"out = {plan.call}"])


def _functional(func: Any, args: tuple, kwargs: dict, x: torch.Tensor, plan: Plan, result: TypeMap) -> Any:
    if plan.run is not None:
        return plan.run(x)
    plain = unwrap(x)

    def raw_op(t: torch.Tensor) -> torch.Tensor:
        if args and args[0] is x:
            out = func(t, *args[1:], **kwargs)
        else:
            out = func(*args, **{k: (t if v is x else v) for k, v in kwargs.items()})
        return c10d_functional.wait_tensor(out)

    if plain.requires_grad and torch.is_grad_enabled():
        # the value keeps its type (a broadcast of R or I, an all-to-all of V blocks with uneven splits):
        # the op's own backward where torch registers one, else the identity of the unchanged value
        out = raw_op(plain) if plan.call != "x" else _SameValue.apply(plain, raw_op)
    else:
        out = raw_op(plain)
    return _wrap(out, result)


class _SameValue(torch.autograd.Function):
    """Forward: a collective that leaves an R or I value unchanged. Backward: the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return op(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def _pass(raw: RawOp, x: Any, types: TypeMap | None) -> Any:
    """``wait_tensor`` keeps the type; ``_wrap_tensor_autograd`` (an async wrapper) is skipped: typed results are waited."""
    if raw.display.endswith("_wrap_tensor_autograd"):
        return x
    out = c10d_functional.wait_tensor(unwrap(x))
    return out if types is None else _wrap(out, types)


def _seen(site: _Site, x: torch.Tensor) -> list[tuple[str, str]]:
    return [("op", site.raw.display), ("input", format_tensor_type(x, site.types))]


def _error(raw: RawOp, rule: str, seen: list, fixes: Any) -> SpmdTypeError:
    return SpmdTypeError(Rejection(rule, seen, list(fixes)), user_source_line())


# ---------------------------------------------------------------------------
# binding arguments, and registration


_SIGNATURES: dict[Any, Any] = {}


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    sig = _SIGNATURES[func]
    if isinstance(sig, inspect.Signature):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    out = dict(zip(sig, args))
    out.update(kwargs)
    return out


_BY_FUNC: dict[Any, RawOp] = {}


def _register() -> None:
    if not dist.is_available():  # pragma: no cover - torch built without distributed
        return
    functional_collectives()  # defines _wrap_tensor_autograd

    for name, raw in RAW_OPS.items():
        if name.startswith("op:"):
            packet = getattr(c10d_functional, name[3:], None)
            if packet is None:
                continue
            arg_names = [arg.name for arg in op_schema(packet.default).arguments]
            funcs = [(packet, arg_names), (packet.default, arg_names)]
        else:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            funcs = [(fn, inspect.signature(fn))]
        for fn, sig in funcs:
            if fn not in _BY_FUNC:
                _BY_FUNC[fn] = raw
                _SIGNATURES[fn] = sig
                HANDLERS[fn] = _handle
    _register_other_ops()


def _register_other_ops() -> None:
    """Every other op of the collective namespaces (c10d's in-place ops, coalesced forms): rejected."""
    for qualified in dispatch_get_all_op_names():
        ns, _, name = qualified.partition("::")
        if ns not in ("_c10d_functional", "c10d") or "." in name:
            continue
        packet = getattr(getattr(torch.ops, ns), name, None)
        if packet is None or packet in _BY_FUNC:
            continue
        raw = RawOp("rejected", Form.REJECTED, f"torch.ops.{ns}.{name}")
        for fn in [packet] + [getattr(packet, o) for o in packet.overloads()]:
            _BY_FUNC[fn] = raw
            HANDLERS[fn] = _handle


_register()
