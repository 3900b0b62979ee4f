"""DTensor <-> typed local tensors: ``from_dtensor``, ``to_dtensor``, and typed ops on DTensor inputs.

A DTensor's placements are its types (``placements.py``): ``Shard(d)`` is
S(d), ``Replicate()`` I, ``Reduced()`` R, ``Partial()`` P. Crossing the
boundary is differentiable and the gradient's placement is the type's
gradient: the gradient of :func:`from_dtensor` of a ``Replicate()`` DTensor is
``Replicate()`` (I's gradient is I), of a ``Reduced()`` one ``Partial()``.

A typed op on a DTensor (``spmd.all_gather(dt, "dp", src=S(0), dst=R)``)
runs as ``to_dtensor(op(from_dtensor(dt)), ...)`` with the placement on the
op's mesh dim replaced by ``type_to_placement(dst)``, so its backward is the
op's own (one reduce-scatter for an all-gather to ``Reduced``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..._checker.tensor import _run, make_typed
from ..._comm.impl import AxisComm, keep_on_first
from ..._core.async_tensor import settled
from ..._core.errors import Rejection, SpmdTypeError, op_error, user_source_line
from ..._core.mesh import current_mesh, set_current_mesh
from ..._core.state import STATE, checking_turned_on
from ..._core.types import SpmdType, TypeMap, V, compatible, shard_in_range
from ..._guards.function_guard import ALLOWED
from ..._local.transitions import route_call
from ..._torch.private import dtensor_local, dtensor_spec, dtensor_spec_class
from .placements import Reduced, placement_to_cotangent, placement_to_type, strip_reduced, type_to_placement
from .propagation import ReducedDTensor, plain_dtensor

DTensorSpec = dtensor_spec_class()  # torch.distributed.tensor._dtensor_spec.DTensorSpec

__all__ = ["from_dtensor", "to_dtensor", "dtensor_types", "typed_op", "assert_dtensor", "mesh_names"]


def mesh_names(mesh: Any, what: str) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"{what} needs a DeviceMesh with mesh_dim_names (the axis names of the types)")
    return tuple(names)


def dtensor_types(dt: DTensor) -> dict[str, SpmdType]:
    """``{mesh dim name: type}`` of a DTensor's placements.

    Example::

        spmd.integrations.dtensor.dtensor_types(dt)   # {'dp': S(0), 'tp': I}
    """
    names = mesh_names(dt.device_mesh, "a typed DTensor")
    return {n: placement_to_type(p) for n, p in zip(names, dt.placements)}


def _make(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    cls = ReducedDTensor if any(isinstance(p, Reduced) for p in spec.placements) else DTensor
    return cls(local.detach(), spec, requires_grad=False)  # type: ignore[call-arg]


def _plain_local(x: torch.Tensor) -> torch.Tensor:
    """A plain alias of a typed tensor (autograd still reaches ``x``), so no typed op runs inside a Function."""
    return _run(torch.Tensor.view_as, (x, x), {}) if hasattr(x, "_spmd_types") else x


# ---------------------------------------------------------------------------
# the two autograd Functions: their backwards hand the gradient the cotangent placement


class _FromDTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor) -> torch.Tensor:
        ctx.spec = dtensor_spec(dt)
        local = settled(dtensor_local(dt))  # an async redistribute's result (RowwiseParallel's output), waited on
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> DTensor:
        spec = ctx.spec
        cot = tuple(placement_to_cotangent(p) for p in spec.placements)
        return _make(_plain_local(g), DTensorSpec(spec.mesh, cot, tensor_meta=spec.tensor_meta))


class _ToDTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Any, placements: tuple, shape: Any, stride: Any) -> DTensor:
        ctx.placements = placements
        base = DTensor.from_local(x.view_as(x), mesh, strip_reduced(placements), run_check=False, shape=shape,
                                  stride=stride)
        return _make(dtensor_local(base), DTensorSpec(mesh, placements, tensor_meta=dtensor_spec(base).tensor_meta))

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple[torch.Tensor, None, None, None, None]:
        if not isinstance(g, DTensor):
            raise TypeError(
                f"spmd.to_dtensor: the gradient of its DTensor output is a {type(g).__name__}, not a DTensor"
            )
        want = tuple(placement_to_cotangent(p) for p in ctx.placements)
        return _redistribute(g, want), None, None, None, None


ALLOWED[_FromDTensor] = "spmd_types.integrations.dtensor"
ALLOWED[_ToDTensor] = "spmd_types.integrations.dtensor"


def _redistribute(g: DTensor, want: tuple) -> torch.Tensor:
    """The local tensor of ``g`` redistributed to placements ``want`` (``Reduced`` has ``Replicate``'s data).

    DTensor does not redistribute to ``Partial``; a mesh dim that must become
    ``Partial`` goes to ``Replicate`` first (an all-gather from ``Shard``), then
    keeps the value on the dim's first rank and zeros elsewhere (exact, no
    communication), as ``spmd.convert(x, axis, src=I, dst=P)`` does.
    """
    g = plain_dtensor(g)
    target = strip_reduced(want)
    have = dtensor_spec(g).placements
    if have == target:
        return dtensor_local(g)
    to_partial = [i for i, (h, w) in enumerate(zip(have, target)) if type(w) is Partial and type(h) is not Partial]
    mid = tuple(Replicate() if i in to_partial else w for i, w in enumerate(target))
    with torch.no_grad():
        local = dtensor_local(g.redistribute(g.device_mesh, mid) if mid != have else g)
        for i in to_partial:
            group = g.device_mesh.get_group(i)
            comm = AxisComm((mesh_names(g.device_mesh, "a gradient")[i],), group, group.group_name, group.size())
            local = keep_on_first(local, comm)
    return local


# ---------------------------------------------------------------------------
# the public conversions


def from_dtensor(dt: DTensor) -> torch.Tensor:
    """The local tensor of DTensor ``dt``, typed by its placements (inside :func:`spmd_types.typecheck`).

    Differentiable: the gradient comes back as a DTensor with the cotangent
    placements (``Reduced() -> Partial()``, ``Replicate() -> Replicate()``).
    Outside ``typecheck()`` the local tensor is plain.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            w = spmd.from_dtensor(w_dt)   # Shard(0) on tp -> f32[4,16] {tp: S(0)}
    """
    if not isinstance(dt, DTensor):
        raise TypeError(f"spmd.from_dtensor takes a DTensor, got {type(dt).__name__}")
    types = dtensor_types(dt)
    local = _FromDTensor.apply(dt) if (dt.requires_grad and torch.is_grad_enabled()) else _FromDTensor.forward(
        _Ctx(), dt)
    if not STATE.checking:
        return local
    out = make_typed(local, TypeMap.of(types))
    spec = _partition_spec(dt)
    if spec is not None:
        out._spmd_spec = spec
    return out


class _Ctx:
    """A stand-in ``ctx`` for running a Function's forward when no gradient is needed."""


def _partition_spec(dt: DTensor) -> tuple | None:
    """The partition spec of ``dt``'s Shard placements, mesh dims in order (outer first)."""
    names = mesh_names(dt.device_mesh, "a typed DTensor")
    entries: list[list[str]] = [[] for _ in range(dt.dim())]
    for name, p in zip(names, dt.placements):
        if type(p) is Shard:
            entries[p.dim % dt.dim()].append(name)
    return tuple(tuple(e) for e in entries) if any(entries) else None


def to_dtensor(
    x: torch.Tensor, mesh: Any, placements: Sequence[Any], *, shape: Any = None, stride: Any = None
) -> DTensor:
    """A DTensor with local tensor ``x`` and ``placements`` on ``mesh`` (one per mesh dim).

    A typed ``x`` must have the types the placements mean (``Reduced()`` is R,
    ``Replicate()`` I, ...; a V type may take any ``Shard(d)``). Differentiable:
    the local gradient has ``x``'s gradient type (the DTensor gradient is
    redistributed to the cotangent placements first, e.g. ``Partial()`` for a
    ``Reduced()`` output). ``shape=``/``stride=`` give uneven global sizes.

    Example::

        out = spmd.to_dtensor(y_local, mesh, [Shard(0), spmd.Reduced()])
    """
    names = mesh_names(mesh, "spmd.to_dtensor")
    placements = tuple(placements)
    if len(placements) != len(names):
        raise ValueError(
            f"spmd.to_dtensor: {len(placements)} placements for a mesh of {len(names)} dims {names}"
        )
    placements = normalized_placements("spmd.to_dtensor", placements, x)
    wanted = {n: placement_to_type(p) for n, p in zip(names, placements)}
    have = getattr(x, "_spmd_types", None) if STATE.checking else None
    if have is not None:
        _check_types("spmd.to_dtensor", have, wanted, placements, names)
    plain = _plain_local(x)
    if plain.requires_grad and torch.is_grad_enabled():
        return _ToDTensor.apply(plain, mesh, placements, shape, stride)
    return _ToDTensor.forward(_Ctx(), plain, mesh, placements, shape, stride)


def normalized_placements(what: str, placements: tuple, x: torch.Tensor) -> tuple:
    """``placements`` with each ``Shard(d)`` counted from the front of ``x``'s dims (``Shard(-1)`` of 3 dims is
    ``Shard(2)``, as ``DTensor.from_local`` does), or a ValueError naming the placement."""
    if not any(type(p) is Shard for p in placements):
        return placements
    ndim = _plain_local(x).dim()
    out = []
    for p in placements:
        if type(p) is Shard:
            d = p.dim
            if not -ndim <= d < ndim:
                raise ValueError(f"{what}: the placement {p!r} names tensor dim {d}, but the tensor has {ndim} dims")
            p = Shard(d % ndim) if d < 0 else p
        out.append(p)
    return tuple(out)


def _check_types(what: str, have: TypeMap, wanted: Mapping[str, SpmdType], placements: tuple,
                 names: tuple) -> None:
    for name, p in zip(names, placements):
        h, w = have.get(name), wanted[name]
        if h is not None and compatible(h, w):  # a V type may take any Shard(d)
            continue
        fix = route_call("x", name, h, w) if h is not None else None
        seen = f"is {h}" if h is not None else "has no type"
        raise SpmdTypeError(
            Rejection(
                f"{what}: the tensor {seen} on axis '{name}', and the placement {p!r} means {w}.",
                [("tensor", have.format(names)), ("placements", ", ".join(repr(q) for q in placements))],
                [fix] if fix else [],
            ),
            user_source_line(),
        )


# ---------------------------------------------------------------------------
# assert_type on a DTensor


def assert_dtensor(dt: DTensor, types: Mapping[Any, SpmdType], partition_spec: Any = None) -> DTensor:
    """``spmd.assert_type`` on a DTensor: check each named axis's placement against the asserted type."""
    if partition_spec is not None:
        raise TypeError("assert_type on a DTensor takes no partition_spec: its Shard placements are its layout")
    if not isinstance(types, Mapping):
        raise TypeError(f"assert_type takes types as a dict {{axis: type}}, e.g. {{'tp': spmd.R}}; got {types!r}")
    have = dtensor_types(dt)
    names = tuple(have)
    for axis, want in types.items():
        name = _axis_name(dt.device_mesh, axis, "assert_type")
        want = shard_in_range(want, dt.dim(), f"assert_type: axis '{name}'")
        h = have[name]
        if compatible(h, want):
            continue
        p = dt.placements[names.index(name)]
        raise op_error(
            Rejection(
                f"Type assertion failed: the DTensor is {p!r} ({h}) on axis '{name}', and the assertion says {want}.",
                [("have", TypeMap.of(have).format(names)), ("placements", ", ".join(repr(q) for q in dt.placements)),
                 ("axis", f"'{name}': {h} is not {want}")],
                [f for f in [route_call("x", name, h, want)] if f],
            ),
            "assert_type",
            ("x", "types"),
        )
    return dt


def _axis_name(mesh: Any, axis: Any, what: str) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    names = mesh_names(mesh, what)
    if isinstance(axis, str) and axis in names:
        return axis
    if isinstance(axis, DeviceMesh) and axis.ndim == 1 and axis.mesh_dim_names and axis.mesh_dim_names[0] in names:
        return axis.mesh_dim_names[0]
    if isinstance(axis, dist.ProcessGroup):
        for n in names:
            if mesh.get_group(n) is axis:
                return n
    raise ValueError(f"{what}: axis {axis!r} is not a dim of the DTensor's mesh, whose dims are {names}")


# ---------------------------------------------------------------------------
# typed ops on DTensor inputs


@contextlib.contextmanager
def checked_local(mesh: Any) -> Iterator[None]:
    """Local SPMD checking on ``mesh`` (the DTensor's) for the duration of one op."""
    saved = (STATE.checking, STATE.global_mode, STATE.local_axes)
    checking_turned_on()
    STATE.checking, STATE.global_mode, STATE.local_axes = True, False, frozenset()
    try:
        if current_mesh() is not None and current_mesh().device_mesh is mesh:
            yield
        else:
            with set_current_mesh(mesh):
                yield
    finally:
        STATE.checking, STATE.global_mode, STATE.local_axes = saved


def typed_op(fn: Callable[..., torch.Tensor], x: DTensor, axis: Any, **kwargs: Any) -> DTensor:
    """Run typed op ``fn`` (``spmd.all_gather``, ...) on DTensor ``x``; the result's placements follow ``dst``."""
    opname = f"spmd.{fn.__name__}"
    src, dst = kwargs.get("src"), kwargs.get("dst")
    if src is None or dst is None:
        raise NotImplementedError(
            f"{opname} on a DTensor takes one mesh axis with src= and dst=; for a change of whole layout "
            "use DTensor.redistribute"
        )
    if isinstance(axis, (tuple, list)):
        raise NotImplementedError(f"{opname} on a DTensor runs on one mesh axis, not {axis!r}")
    mesh = x.device_mesh
    name = _axis_name(mesh, axis, opname)
    k = mesh_names(mesh, opname).index(name)
    for what, t in (("src", src), ("dst", dst)):
        if t is V:
            have = x.placements[k]
            shown = f"spmd.S({have.dim})" if (what == "src" and type(have) is Shard) else "spmd.S(d)"
            raise ValueError(
                f"{opname} on a DTensor: {what}=V does not say which tensor dim the shards live on, so the "
                f"DTensor result would not mean the same tensor; pass {what}={shown}"
            )
    _check_nested_shards(opname, x, k, src, dst)
    _check_even(opname, x)
    with checked_local(mesh):
        local = from_dtensor(x)
        out = fn(local, name, **kwargs)
    placements = list(x.placements)
    placements[k] = type_to_placement(dst)
    return to_dtensor(out, mesh, placements)


def _check_even(opname: str, x: DTensor) -> None:
    """Reject uneven shards: every rank's local shape must be the same for the collectives."""
    mesh = x.device_mesh
    for d in range(x.dim()):
        ways = 1
        for j, p in enumerate(x.placements):
            if type(p) is Shard and p.dim % x.dim() == d:
                ways *= mesh.size(j)
        if x.shape[d] % ways:
            raise NotImplementedError(
                f"{opname} on a DTensor: tensor dim {d} (size {x.shape[d]}) is split unevenly into {ways} shards; "
                "typed ops on DTensors need even shards (pad it, or use DTensor.redistribute)"
            )


def _check_nested_shards(opname: str, x: DTensor, k: int, src: Any, dst: Any) -> None:
    """Reject an op on mesh dim ``k`` of a tensor dim that a later mesh dim also shards (DTensor's order)."""
    for t in (src, dst):
        d = getattr(t, "dim", None)
        if d is None:
            continue
        d %= x.dim()
        later = [j for j, p in enumerate(x.placements) if j > k and type(p) is Shard and p.dim % x.dim() == d]
        if later:
            names = mesh_names(x.device_mesh, opname)
            raise NotImplementedError(
                f"{opname} on a DTensor: tensor dim {d} is also sharded by the later mesh dim "
                f"'{names[later[0]]}', so only that (inner) mesh dim can gather or scatter it here; "
                "use DTensor.redistribute for this change"
            )


# ---------------------------------------------------------------------------
# local_map with DTensor arguments


def local_map_dtensor(
    wrapper: Callable[..., Any], f: Callable[..., Any], args: tuple, kwargs: dict, in_types: Sequence[Any],
    out_types: Any,
) -> Any:
    """``spmd.local_map`` called with DTensors: local typed tensors in, DTensors with the declared types out.

    Each DTensor argument is checked against its ``in_types`` entry and
    becomes its typed local tensor (:func:`from_dtensor`); the body runs as
    ``local_map`` runs it; each output becomes a DTensor whose placements are
    its ``out_types`` entry (which must name every mesh dim).
    """
    name = getattr(f, "__qualname__", "fn")
    meshes = [a.device_mesh for a in args if isinstance(a, DTensor)]
    mesh = meshes[0]
    if any(m != mesh for m in meshes[1:]):
        raise ValueError(f"local_map({name}): its DTensor arguments live on different meshes")
    names = mesh_names(mesh, f"local_map({name})")
    outs = [out_types] if isinstance(out_types, Mapping) else list(out_types)
    placements = [None if t is None else _out_placements(name, i, t, mesh, names) for i, t in enumerate(outs)]
    offset = len(args) - len(in_types)
    with set_current_mesh(mesh) if _needs_mesh(mesh) else contextlib.nullcontext():
        local_args = []
        for i, a in enumerate(args):
            spec = in_types[i - offset] if i >= offset else None
            if isinstance(a, DTensor):
                if spec is not None:
                    assert_dtensor(a, spec)
                a = from_dtensor(a)
            local_args.append(a)
        out = wrapper(*local_args, **kwargs)
        if isinstance(out_types, Mapping):
            return to_dtensor(out, mesh, placements[0])
        return type(out)(o if p is None else to_dtensor(o, mesh, p) for o, p in zip(out, placements))


def _needs_mesh(mesh: Any) -> bool:
    current = current_mesh()
    return current is None or current.device_mesh is not mesh


def _out_placements(name: str, index: int, declared: Mapping[Any, SpmdType], mesh: Any, names: tuple) -> list:
    given = {_axis_name(mesh, a, f"local_map({name})"): t for a, t in declared.items()}
    missing = [n for n in names if n not in given]
    if missing:
        raise ValueError(
            f"local_map({name}): output {index} becomes a DTensor, so its out_types must give a type for every "
            f"mesh dim {names}; missing {tuple(missing)}"
        )
    return [type_to_placement(given[n]) for n in names]
