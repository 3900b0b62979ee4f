"""What every typed communication op shares: the call record, axis lookup, checks, and the runner.

A :class:`Call` is one resolved op: name, src/dst types, the axis, and the
layout options. Its :func:`dual` is the op its backward runs, read from
``_transitions`` (the single source of truth): same axis, types swapped
through :func:`backward_type`, split/concat dims swapped. :func:`run` runs a
call, through its ``torch.autograd.Function`` when a gradient is needed, so
the backward of a backward is again a call.

The kernels (plain-tensor forwards) live below, in ``_kernels``; the op
sections (``_local.py``, ``_collectives.py``) build calls and never register
anything, so nothing here imports them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from .._checker.tensor import _DisableTF, _run, _wrap, format_tensor_type
from .._checker.trace import log_op
from .._core.axes import MeshAxis, region_of_group
from .._core.errors import RedistributeError, Rejection, SpmdTypeError, user_source_line
from .._core.mesh import current_mesh, resolve_axis
from .._core.spaces import move_types
from .._core.state import STATE
from .._core.types import P, S, SpmdType, TypeMap, V, backward_type, check_type_value, compatible, shard_in_range
from .._guards.strict import untyped_input
from .._local.transitions import allowed, backward_of, find, route_call
from .._torch.private import (
    AutoDispatchBelowAutograd,
    are_functorch_transforms_active,
    functorch_unwrap_if_dead,
    len_torch_dispatch_stack,
)
from .dtypes import backward_plan, casting
from .impl import AxisComm
from .kernels import KERNELS

__all__ = ["Call", "dual", "run", "begin", "finish", "type_result", "resolve_comm", "norm_dim", "Begun"]

_REDUCE_OPS = ("sum", "avg")


class Call(NamedTuple):
    """One typed communication op, resolved: everything its forward and backward need."""

    op: str
    src: SpmdType
    dst: SpmdType
    comm: AxisComm
    dim: int | None = None  # the varying side's layout: None = stacked on a new dim 0, d = S(d)
    split_dim: int | None = None  # all_to_all only
    concat_dim: int | None = None
    sizes: tuple[int, ...] | None = None  # uneven shard sizes on `dim`, one per rank
    reduce: str = "sum"  # "avg" scales the whole op by 1 / axis size
    dtypes: Any = None  # a dtypes.DtypePlan: casts around the op (low-precision communication); None: none
    in_splits: tuple[int, ...] | None = None  # all_to_all with uneven pieces: sent to each rank (dim split_dim)
    out_splits: tuple[int, ...] | None = None  # ... and received from each rank (dim concat_dim)


def dual(call: Call, g: torch.Tensor | None = None) -> Call:
    """The call the backward of ``call`` runs, as ``_transitions.backward_of`` names it.

    With dtype options, the dual runs with the forward's ``backward_options``, resolved against gradient ``g``.
    """
    op = backward_of(call.op, call.src, call.dst)[0]
    back = call._replace(
        op=op, src=backward_type(call.dst), dst=backward_type(call.src),
        split_dim=call.concat_dim, concat_dim=call.split_dim, dtypes=None,
        in_splits=call.out_splits, out_splits=call.in_splits,
    )
    if call.dtypes is not None and g is not None:
        back = back._replace(dtypes=backward_plan(call.dtypes, back.comm, op, back.src, back.dst, g))
    return back


_PRE_REDUCE = ("all_reduce", "reduce_scatter")


def _make_function(op: str) -> type[torch.autograd.Function]:
    """``op``'s autograd Function: forward is its kernel, backward is the op's dual from the table.

    ``fast`` (an ``Erased``, from the erased path's cache in ``erased.py``) carries the dual already resolved, so the
    backward of an erased call on an ordinary gradient runs the dual's kernel with nothing left to work out.
    """
    kernel = KERNELS[op]

    class _Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, call: Call, fast: Any) -> torch.Tensor:
            ctx.call = call
            ctx.fast = fast
            # An output no gradient reaches stays without one (as in plain torch), not a tensor of zeros:
            # an optimizer treats a zero gradient differently from none (weight decay).
            ctx.set_materialize_grads(False)
            if fast is not None and fast.alias:
                return x  # autograd hands back a view of x, as the kernel's x.view_as(x) would be
            return _below_autograd(_with_casts(kernel, call), x, call)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
            if g is None:
                return None, None, None
            fast = ctx.fast
            if (fast is not None and fast.back is not None and type(g) is _TENSOR and not g.requires_grad
                    and (fast.back_dtype is None or g.dtype is fast.back_dtype)):
                if fast.back_alias:
                    return g, None, None
                if not (_compiling() or _dispatch_modes()):  # else _below_autograd's way, by the full path
                    with _BELOW_AUTOGRAD():
                        return fast.back_kernel(g, fast.back), None, None
            # A gradient made by a hand-written backward from saved typed tensors comes typed by the forward
            # rules, which say nothing about gradients (an R value's gradient is P): run the dual on it plain.
            g = unwrap(g)
            return run(dual(ctx.call, g), g), None, None

    _Op.__name__ = _Op.__qualname__ = "".join(part.title() for part in op.split("_"))
    return _Op


_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {op: _make_function(op) for op in KERNELS}
# Function.apply is a Python wrapper that, with no functorch transform active, unwraps dead functorch
# wrappers and calls the C++ apply: the erased path does the same two steps itself (see ``erased``).
_APPLY = {op: super(torch.autograd.Function, f).apply for op, f in _FUNCTIONS.items()}
_functorch_active = are_functorch_transforms_active
_unwrap_if_dead = functorch_unwrap_if_dead
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_grad_enabled = torch.is_grad_enabled


def run(call: Call, x: torch.Tensor) -> torch.Tensor:
    """Run ``call`` on plain ``x``: through its autograd Function if ``x`` needs a gradient."""
    if call.src.is_varying and call.op in _PRE_REDUCE:
        # src=V on a reduction means reinterpret V -> P first (seed 003); both halves keep their own backward.
        x = run(call._replace(op="reinterpret", dst=P, reduce="sum", dtypes=None), x)
        call = call._replace(src=P)
    if x.requires_grad and torch.is_grad_enabled():
        return _FUNCTIONS[call.op].apply(x, call, None)
    return _below_autograd(_with_casts(KERNELS[call.op], call), x, call)


def _with_casts(kernel: Any, call: Call) -> Any:
    """``kernel``, wrapped in the casts of the call's dtype options when it has any (``dtypes.casting``)."""
    d = call.dtypes
    return kernel if d is None or (d.op is None and d.out is None) else casting(kernel)


_BELOW_AUTOGRAD = AutoDispatchBelowAutograd
_compiling = torch.compiler.is_compiling
_dispatch_modes = len_torch_dispatch_stack


def _below_autograd(kernel: Any, x: torch.Tensor, call: Call) -> torch.Tensor:
    """Run a kernel where no gradient is recorded, skipping the autograd layer of the collective ops.

    The ``_c10d_functional`` ops carry a Python autograd kernel that runs even
    with grad mode off (tens of microseconds a call); the typed ops make their
    own autograd Function, so the kernels run below autograd. Not while
    ``torch.compile`` traces, which handles the ops itself, nor under a
    dispatch mode (the rank simulator's ``contiguous`` is itself an autograd
    Function, which recurses below autograd).
    """
    if _compiling() or _dispatch_modes():
        return kernel(x, call)
    with _BELOW_AUTOGRAD():
        return kernel(x, call)


# ---------------------------------------------------------------------------
# axis lookup


_COMMS: list[Any] = [None, {}]  # [mesh token, {axis: AxisComm}] for the last mesh seen (Mesh.token)


def resolve_comm(opname: str, axis: Any) -> AxisComm:
    """The :class:`AxisComm` for ``axis``: a name, a ProcessGroup, a 1-D DeviceMesh, or a tuple of names."""
    mesh = current_mesh()
    token = None if mesh is None else mesh.token
    if _COMMS[0] is not token:
        _COMMS[0], _COMMS[1] = token, {}
    cache = _COMMS[1]
    try:
        found = cache.get(axis)
    except TypeError:  # unhashable axis: a list
        found = None
    if found is None:
        found = _resolve(opname, axis, mesh)
        if not isinstance(axis, list):
            cache[axis] = found
    return found


def _resolve(opname: str, axis: Any, mesh: Any) -> AxisComm:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(axis, (tuple, list)):
        return _resolve_many(opname, tuple(axis), mesh)
    if isinstance(axis, MeshAxis):
        return _resolve_region(opname, axis, None, mesh)
    if isinstance(axis, dist.ProcessGroup) and (mesh is None or all(g is not axis for g in mesh.groups.values())):
        return _resolve_region(opname, region_of_group(axis), axis, mesh)
    if isinstance(axis, DeviceMesh) and mesh is None and axis.ndim == 1 and axis.mesh_dim_names:
        group = axis.get_group()
        return AxisComm((axis.mesh_dim_names[0],), group, group.group_name, group.size())
    try:
        name = resolve_axis(axis)
    except (ValueError, RuntimeError) as err:
        raise type(err)(f"{opname}: {err}") from None
    group = mesh.groups[name]
    if group is None:
        raise ValueError(f"{opname}: the current mesh knows axis '{name}' only as a MeshAxis (no process group); "
                         "pass the ProcessGroup to communicate over")
    if mesh.size(name) == 1:
        return AxisComm((), group, group.group_name, 1, (name,))
    return AxisComm((name,), group, group.group_name, group.size())


def _resolve_region(opname: str, region: MeshAxis, group: Any, mesh: Any) -> AxisComm:
    """A group (or MeshAxis) given by object: the current mesh's axes over its region, by ranks."""
    label = f"group {group.group_name}" if group is not None else repr(region)
    found = mesh.axes_for_region(region) if mesh is not None else None
    if found is not None and group is None:
        group = mesh.group_for(found) if found else None
        if group is None:
            raise ValueError(f"{opname}: the current mesh has no process group over {label}; pass the ProcessGroup")
    if group is None:
        raise ValueError(f"{opname}: {label} is not an axis of the current mesh; pass a ProcessGroup")
    if found is None:  # outside the mesh: untyped inputs only (check_input refuses typed ones)
        return AxisComm((label,), group, group.group_name, group.size())
    return AxisComm(found, group, group.group_name, group.size(), None if found else (label,))


def _resolve_many(opname: str, names: tuple, mesh: Any) -> AxisComm:
    if not names:
        raise ValueError(f"{opname}: axis () names no mesh axis")
    if len(names) == 1:
        return _resolve(opname, names[0], mesh)
    resolved = tuple((_resolve(opname, n, mesh).names or _resolve(opname, n, mesh).shown)[0] for n in names)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"{opname}: axis {names!r} names a mesh axis twice")
    device_mesh = getattr(mesh, "device_mesh", None)
    if device_mesh is None:
        raise NotImplementedError(
            f"{opname} over several axes {names!r} flattens them into one group, which needs the current "
            "mesh to be a DeviceMesh (not a {name: ProcessGroup} dict)"
        )
    order = [a for a in mesh.axis_names if a in resolved]
    if list(resolved) != order:
        raise ValueError(
            f"{opname}: list the axes of a flattened collective in mesh order, {tuple(order)!r}, not {resolved!r}"
        )
    group = device_mesh[resolved]._flatten().get_group()
    typed = tuple(n for n in resolved if mesh.size(n) > 1)
    return AxisComm(typed, group, group.group_name, group.size(), None if typed == resolved else resolved)


# ---------------------------------------------------------------------------
# checks before any communication


class Begun(NamedTuple):
    opname: str
    src: SpmdType
    dst: SpmdType
    comm: AxisComm
    types: TypeMap | None  # the input's types when it is typed and checking is on


def begin(op: str, x: Any, axis: Any, src: Any, dst: Any, reduce: str = "sum") -> Begun:
    """Validate the arguments every op shares; raise before any communication."""
    opname = f"spmd.{op}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{opname} takes a tensor, got {type(x).__name__}")
    src = check_type_value(src, f"{opname}: src")
    dst = check_type_value(dst, f"{opname}: dst")
    src, dst = shards_in_range(opname, x, src, dst)
    if reduce not in _REDUCE_OPS:
        raise ValueError(f"{opname}: op must be 'sum' or 'avg', got {reduce!r}")
    if reduce == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(
            f"{opname}: op='avg' divides by the axis size, which an integer tensor ({x.dtype}) cannot hold; "
            "cast it to a floating dtype first, or use op='sum'"
        )
    comm = resolve_comm(opname, axis)
    table_src = P if (op in _PRE_REDUCE and src.is_varying) else src
    if find(op, table_src, dst) is None:
        _reject_transition(op, opname, comm, src, dst)
    return Begun(opname, src, dst, comm, check_input(opname, x, comm, src, dst))


def check_input(opname: str, x: torch.Tensor, comm: AxisComm, src: SpmdType, dst: SpmdType) -> TypeMap | None:
    """``x``'s types (None when checking is off or ``x`` is plain), checked against ``src`` on the axes.

    In strict mode a plain ``x`` is an error: its ``src=`` could not be checked.
    """
    if not STATE.checking:
        return None
    types = getattr(x, "_spmd_types", None)
    if types is None:
        if STATE.strict:
            raise untyped_input(opname, _call_text(opname, comm, src, dst), comm.names, src)
        return None
    types = _on_current_mesh(opname, x, types)
    with _DisableTF():
        ndim = x.dim()
    for name in comm.names:
        have = types.get(name)
        if have is None and name not in types.axes():
            _reject_outside(opname, x, types, comm, src, dst)
        if not compatible(have, src, ndim):  # S(-1) is S(ndim - 1)
            _reject_src(opname, x, types, comm, name, have, src, dst)
    return types


def _on_current_mesh(opname: str, x: torch.Tensor, types: TypeMap) -> TypeMap:
    """``x``'s types moved onto the current mesh when it was typed on another presentation of the ranks."""
    mesh = current_mesh()
    if mesh is None or types.space is None or types.space is mesh.space:
        return types
    found = move_types(types, mesh.space)
    if isinstance(found, str):
        raise SpmdTypeError(
            Rejection(
                f"{opname}'s input is typed on another mesh and cannot be moved onto the current one: {found}.",
                [("input", format_tensor_type(x, types)),
                 ("current mesh", ", ".join(f"{n}={mesh.region(n).layout_str()}" for n in mesh.typed_axes))],
                ["spmd.reinterpret_mesh(x, mesh) onto a mesh over the same ranks"],
            ),
            user_source_line(),
        )
    return found[0]


def _reject_outside(opname: str, x: torch.Tensor, types: TypeMap, comm: AxisComm, src: SpmdType,
                    dst: SpmdType) -> None:
    """A typed input to a collective over a group that is no axis of the current mesh: its type says nothing there."""
    mesh = current_mesh()
    shown = ", ".join(f"{n}={mesh.region(n).layout_str()}" for n in mesh.typed_axes) if mesh is not None else "none"
    raise SpmdTypeError(
        Rejection(
            f"{opname} runs over a process group (ranks {region_of_group(comm.group).layout_str()}) that is not an axis "
            "of the current mesh, nor a flattening of its axes, so the input's type says nothing about it.",
            [("op", _call_text(opname, comm, src, dst)), ("input", format_tensor_type(x, types)),
             ("current mesh", shown)],
            ["run it over an axis of the current mesh (its name or its group), or over a group of several of them"],
        ),
        user_source_line(),
    )


def _call_text(opname: str, comm: AxisComm, src: SpmdType, dst: SpmdType) -> str:
    return f"{opname}(x, {comm.label}, src={src.code()}, dst={dst.code()})"


def _reject_transition(op: str, opname: str, comm: AxisComm, src: SpmdType, dst: SpmdType) -> None:
    pairs = allowed(op)
    if op in _PRE_REDUCE:
        pairs = pairs + [(V, d) for s, d in pairs if s is P]  # src=V: reinterpret V -> P first
    shown = ", ".join(f"{s} -> {d}" for s, d in pairs)
    fix = route_call("x", comm.first_name, src, dst)
    raise SpmdTypeError(
        Rejection(
            f"{opname} cannot take src={src} to dst={dst}: seed 003's forward/backward table has no such "
            f"{op}, so it has no backward.",
            [("op", _call_text(opname, comm, src, dst)), ("allowed", shown)],
            [fix] if fix and not fix.startswith(opname + "(") else [],
        ),
        user_source_line(),
    )


def _reject_src(
    opname: str, x: torch.Tensor, types: TypeMap, comm: AxisComm, name: str, have: SpmdType | None,
    src: SpmdType, dst: SpmdType,
) -> None:
    fix = route_call("x", name, have, dst) if have is not None else None
    raise SpmdTypeError(
        Rejection(
            f"{opname}'s src= must be the input's type on the axis: src={src}, but the tensor is "
            f"{have if have is not None else 'untyped'} on axis '{name}'.",
            [("op", _call_text(opname, comm, src, dst)), ("input", format_tensor_type(x, types)),
             ("axis", f"'{name}': {have} is not {src}")],
            [fix] if fix else [],
        ),
        user_source_line(),
    )


def norm_dim(opname: str, what: str, d: int, ndim: int) -> int:
    """``d`` as a non-negative tensor dim of an ``ndim``-dim tensor, or a clear error."""
    if isinstance(d, bool) or not isinstance(d, int):
        name = what.split("=", 1)[0]
        raise TypeError(f"{opname}: {name}= takes an int tensor dim, got {d!r} of type {type(d).__name__}")
    if not -ndim <= d < ndim:
        raise ValueError(f"{opname}: {what} names tensor dim {d}, but the tensor has {ndim} dims")
    return d % ndim


def shards_in_range(opname: str, x: torch.Tensor, src: SpmdType, dst: SpmdType) -> tuple[SpmdType, SpmdType]:
    """``src`` and ``dst`` with their S(d) checked against ``x``'s dims and counted from the front."""
    if getattr(src, "dim", None) is None and getattr(dst, "dim", None) is None:
        return src, dst
    with _DisableTF():
        ndim = x.dim()
    return shard_in_range(src, ndim, f"{opname}: src"), shard_in_range(dst, ndim, f"{opname}: dst")


def check_sizes(opname: str, sizes: Sequence[int] | None, comm: AxisComm) -> tuple[int, ...] | None:
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or any(
        isinstance(s, bool) or not isinstance(s, int) for s in sizes
    ):
        raise TypeError(f"{opname}: sizes= takes one int per rank, got {sizes!r}")
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != comm.size or any(s < 0 for s in sizes):
        raise ValueError(
            f"{opname}: sizes= gives one shard size per rank of axis {comm.label} ({comm.size} ranks), "
            f"got {list(sizes)}"
        )
    return sizes


def check_local_size(opname: str, x: torch.Tensor, dim: int, sizes: tuple[int, ...], comm: AxisComm) -> None:
    """This rank's shard must have the size ``sizes`` gives it (checked for real ranks; simulated ones vary)."""
    from .impl import group_rank

    rank = group_rank(comm)
    with _DisableTF():
        have = x.shape[dim]
    if isinstance(rank, int) and isinstance(have, int) and have != sizes[rank]:
        raise ValueError(
            f"{opname}: sizes={list(sizes)} gives this rank (index {rank} on axis {comm.label}) a shard of "
            f"{sizes[rank]} on dim {dim}, but its shard has {have}"
        )


# ---------------------------------------------------------------------------
# running: unwrap, run, give the output its type


def unwrap(x: torch.Tensor) -> torch.Tensor:
    """A plain alias of typed ``x`` (autograd still reaches ``x``); plain ``x`` as is."""
    if hasattr(x, "_spmd_types"):
        if _dispatch_modes():
            return _run(_VIEW_AS, (x, x), {})
        with _DisableTF():  # _run's way with no dispatch mode
            return x.view_as(x)
    return x


_VIEW_AS = torch.Tensor.view_as


def finish(begun: Begun, call: Call, x: torch.Tensor) -> torch.Tensor:
    """Run ``call`` on ``x`` and type the result when the input was typed under checking."""
    if STATE.global_mode and begun.types is not None:
        with _DisableTF():
            in_ndim = x.dim()
        _global_spec(begun, x, _out_ndim(call, in_ndim))  # its rejections, before any communication
    return type_result(begun, x, run(call, unwrap(x)))


def _out_ndim(call: Call, in_ndim: int) -> int:
    """The result's number of dims: a V (stacked) side adds or removes dim 0."""
    if call.dim is not None or call.op not in ("all_gather", "reduce_scatter", "convert"):
        return in_ndim
    if call.op == "all_gather" or (call.op == "convert" and call.src.is_varying):
        return in_ndim + 1
    if call.op == "reduce_scatter" or call.dst.is_varying:
        return in_ndim - 1
    return in_ndim


def type_result(begun: Begun, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Give plain ``out`` (the op's result on ``x``) its type, when ``x`` was typed under checking."""
    types = begun.types
    if types is None:
        return out
    for name in begun.comm.names:
        types = types.replace(name, begun.dst)
    with _DisableTF():
        rank_changed = x.dim() != out.dim()
    if rank_changed:
        # A stack or unbind moves every dim: an S(d) on another axis now names the wrong dim.
        types = TypeMap.of(((a, V if (t.is_varying and a not in begun.comm.names) else t) for a, t in types.items),
                           types.space)
    with _DisableTF():
        out_ndim = out.dim()
    spec = _global_spec(begun, x, out_ndim) if STATE.global_mode else None
    out = _wrap(out, types)
    if spec is not None:
        out._spmd_spec = spec
    if STATE.tracing:
        log_op(begun.opname, [x], out)
    return out


def _global_spec(begun: Begun, x: torch.Tensor, out_ndim: int) -> tuple | None:
    """The result's partition spec in global SPMD: the axes leave ``src``'s dim and join ``dst``'s.

    Only the Shard forms have a global meaning (seed 003); V (stack) forms are
    for local SPMD, e.g. inside ``spmd.local_map``. On a dim sharded by several
    axes, only the minor-most ones can be gathered.
    """
    mesh = current_mesh()
    global_axes = mesh.global_axes(STATE.local_axes) if mesh is not None else frozenset()
    names = [n for n in begun.comm.names if n in global_axes]
    with _DisableTF():
        in_ndim = x.dim()
    spec = getattr(x, "_spmd_spec", None) or tuple(() for _ in range(in_ndim))
    if not names:
        return _restack(begun, spec, in_ndim, out_ndim, global_axes)
    for t, what in ((begun.src, "src"), (begun.dst, "dst")):
        if t is V:
            raise SpmdTypeError(
                Rejection(
                    f"{begun.opname} with {what}=V has no global meaning: say which dim with S(d), or run it "
                    "in local SPMD (spmd.local_map).",
                    [("op", _call_text(begun.opname, begun.comm, begun.src, begun.dst)),
                     ("global axes", ", ".join(names))],
                    [_call_text(begun.opname, begun.comm, S(0) if what == "src" else begun.src,
                                S(0) if what == "dst" else begun.dst)],
                ),
                user_source_line(),
            )
    entries = [list(e) for e in spec]
    src_dim = getattr(begun.src, "dim", None)
    if src_dim is not None:
        d = src_dim % in_ndim
        if entries[d][-len(names):] != names:
            raise RedistributeError(
                Rejection(
                    f"{begun.opname} can only gather the minor-most mesh axes of a dim: dim {d} is sharded on "
                    f"{tuple(entries[d])}, and this gathers {tuple(names)}.",
                    [("op", _call_text(begun.opname, begun.comm, begun.src, begun.dst))],
                    ["spmd.redistribute(x, src_spec, dst_spec) plans the gathers in a valid order"],
                ),
                user_source_line(),
            )
        entries[d] = entries[d][: len(entries[d]) - len(names)]
    else:
        entries = [[a for a in e if a not in names] for e in entries]
    if out_ndim != in_ndim:
        return None
    dst_dim = getattr(begun.dst, "dim", None)
    if dst_dim is not None:
        entries[dst_dim % out_ndim].extend(names)
    return tuple(tuple(e) for e in entries)


def _restack(begun: Begun, spec: tuple, in_ndim: int, out_ndim: int, global_axes: frozenset) -> tuple:
    """The spec after a V (stack) collective on a local axis: a new dim 0, or dim 0 unbound."""
    if out_ndim == in_ndim:
        return spec
    if out_ndim == in_ndim + 1:
        return ((),) + tuple(spec)
    if spec and any(a in global_axes for a in spec[0]):
        raise SpmdTypeError(
            Rejection(
                f"{begun.opname} unbinds dim 0, which is sharded on a globally checked axis.",
                [("op", _call_text(begun.opname, begun.comm, begun.src, begun.dst)), ("spec", str(spec))],
                [f"gather dim 0 on {', '.join(spec[0])} first"],
            ),
            user_source_line(),
        )
    return tuple(spec[1:])
