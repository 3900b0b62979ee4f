"""``rulecheck``: a Function's ``spmd_typecheck`` hook checked against its kernel on simulated ranks.

A hook is trusted: whatever types it derives, the checker believes. For each
placement of the inputs (per mesh axis: R, I, S(d) or P), ``rulecheck`` makes
global inputs, gives each simulated rank its piece (a shard, the value, or a
random contribution to a sum), runs the Function on every rank under
``typecheck(local=False)``, reassembles the outputs *by the types the hook
derived* (shards joined, P summed, R/I checked equal on every rank) and
compares them with the Function run once on the global inputs, where every
process group is a world of one rank. A placement the hook refuses is
reported as rejected with the reason.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from .._boundaries.hook_apply import bind_forward_args, hook_kwargs, hook_shape
from .._core.errors import SpmdTypeError
from .._core.phantom import COVERAGE
from .._core.types import AxisType, I, P, R, Shard, V
from ._simulate import _outside_simulation, per_rank, rank_values, simulate

__all__ = ["rulecheck", "RuleCheckError", "RuleCheckReport", "RuleCheckRejection", "RuleCheckPlacement"]

RuleCheckPlacement = dict  # {argument name: {axis name: R | I | P | S(d)}}


class RuleCheckError(AssertionError):
    """The types a hook derives do not describe what its kernel computes (or it refused every placement)."""


class RuleCheckRejection(NamedTuple):
    """A placement the hook refused, and its reason."""

    placement: RuleCheckPlacement
    reason: str


@dataclass
class RuleCheckReport:
    """The placements that ran and matched (``checked``) and those the hook refused (``rejected``)."""

    checked: list = field(default_factory=list)
    rejected: list = field(default_factory=list)


def _axis_types(placement: Any, ndim: int) -> dict[str, AxisType]:
    """``{axis: type}`` from a dict (S(d) as written) or a whole ``spmd.SpmdType`` (its spec as S(d))."""
    if hasattr(placement, "local_type"):
        out = dict(placement.local_type)
        for d, entry in enumerate(placement.partition_spec or ()):
            for a in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
                out[a] = Shard(d)
        return out
    return {a: (Shard(t.dim % ndim) if isinstance(t, Shard) else t) for a, t in dict(placement).items()}


def _piece(value: torch.Tensor, types: dict, sizes: dict, coords: dict, salt: str) -> torch.Tensor:
    """One rank's input: its shard on each S(d) axis (mesh order), a random share of the sum on each P axis."""
    out = value
    for axis, t in types.items():
        if isinstance(t, Shard):
            out = out.chunk(sizes[axis], t.dim)[coords[axis]]
    for axis, t in types.items():
        if t is P:
            n, me = sizes[axis], coords[axis]
            g = torch.Generator().manual_seed(abs(hash((salt, axis))) % (2 ** 31))
            shares = [torch.randn(out.shape, generator=g, dtype=out.dtype) for _ in range(n - 1)]
            shares.append(out - sum(shares))
            out = shares[me]
    return out.clone()


def _reassemble(out: torch.Tensor, sizes: dict, coords_of: dict, names: list[str], what: str) -> torch.Tensor:
    """The global value the per-rank outputs stand for, read by their types (shards joined, P summed, R/I equal)."""
    import spmd_types as spmd

    values = rank_values(out)
    types = {n: spmd.get_type(out)[n] for n in names if n in (spmd.get_type(out) or {})}
    spec = getattr(out, "_spmd_spec", None) or ()
    for axis, t in types.items():
        if t is V and not any(axis in e for e in spec):
            raise RuleCheckError(f"{what} is V on '{axis}' with no dim sharded on it: it has no global value")
    remaining = dict(values)
    for axis in reversed(names):  # innermost axis first: its shards are the finest
        t = types.get(axis, R)
        groups: dict[tuple, list] = {}
        for r, v in remaining.items():
            key = tuple((a, c) for a, c in coords_of[r].items() if a != axis)
            groups.setdefault(key, []).append((coords_of[r][axis], r, v))
        merged = {}
        for members in groups.values():
            members.sort(key=lambda m: m[0])
            vs = [v for _, _, v in members]
            dim = next((d for d, e in enumerate(spec) if axis in e), None)
            if dim is not None:
                joined = torch.cat(vs, dim)
            elif t is P:
                joined = sum(vs[1:], vs[0])
            else:
                if any(not torch.equal(vs[0], v) for v in vs[1:]):
                    raise RuleCheckError(f"{what} is {t} on '{axis}', but its ranks hold different values")
                joined = vs[0]
            merged[members[0][1]] = joined
        remaining = merged
    return next(iter(remaining.values()))


def _mesh_sizes(args: Sequence[Any], mesh: Mapping[str, int] | None) -> dict[str, int]:
    if mesh is not None:
        return {str(n): int(s) for n, s in mesh.items()}
    names = [a for a in args if isinstance(a, str)]
    if len(names) > 1:
        raise TypeError("rulecheck: several string arguments name axes; give mesh={name: size, ...}")
    return {names[0] if names else "shard": 2}


def _enumerate(tensors: dict[str, torch.Tensor], sizes: dict[str, int]) -> list[dict]:
    """Per axis: all R; one dim of each size sharded on each set of arguments having it; each floating argument P
    alone, all of them P; all I. The product over axes."""
    per_axis = []
    for axis, n in sizes.items():
        options = [{name: R for name in tensors}]
        dim_sizes = sorted({s for t in tensors.values() for s in t.shape if s % n == 0 and s >= n})
        for size in dim_sizes:
            having = [name for name, t in tensors.items() if size in t.shape]
            for k in range(1, len(having) + 1):
                for chosen in itertools.combinations(having, k):
                    options.append({name: (Shard(list(tensors[name].shape).index(size)) if name in chosen else R)
                                    for name in tensors})
        floating = [name for name, t in tensors.items() if t.is_floating_point()]
        options += [{name: (P if name == f else R) for name in tensors} for f in floating]
        if len(floating) > 1:
            options.append({name: (P if name in floating else R) for name in tensors})
        options.append({name: I for name in tensors})
        per_axis.append([(axis, o) for o in options])
    return [{name: {axis: o[name] for axis, o in combo} for name in tensors} for combo in itertools.product(*per_axis)]


def _reference(cls: type, args: Sequence[Any], sizes: dict[str, int]) -> Any:
    """The Function on the global inputs, every axis (group) a world of one rank."""
    with simulate((1,), ("ref",)) as one:
        group = one.get_group("ref")
        return cls.apply(*[group if isinstance(a, str) and a in sizes else a for a in args])


def _run_one(cls: type, args: Sequence[Any], placement: dict, sizes: dict[str, int], reference: Any,
             rtol: float, atol: float) -> str | None:
    """Check one placement; the hook's refusal (its reason) or None when the outputs matched the reference."""
    import spmd_types as spmd

    names = list(sizes)
    with simulate(tuple(sizes.values()), tuple(names), ranks="local", device="cpu") as mesh, spmd.typecheck(local=False):
        coords_of = {int(mesh.mesh[c]): dict(zip(names, c)) for c in itertools.product(*(range(s) for s in sizes.values()))}
        forward = bind_forward_args(cls, tuple(args))
        local_args = []
        for value, (name, _) in zip(args, list(forward.items())[:len(args)]):
            if isinstance(value, torch.Tensor):
                types = _axis_types(placement[name], value.dim())
                with _outside_simulation():
                    pieces = {r: _piece(value, types, sizes, coords_of[r], name) for r in coords_of}
                local = per_rank(lambda r, p=pieces: p[r])
                local_args.append(spmd.assert_type(local, {a: (V if isinstance(t, Shard) else t) for a, t in types.items()},
                                                   partition_spec=_spec(types, value.dim())))
            else:
                local_args.append(mesh.get_group(value) if isinstance(value, str) and value in sizes else value)
        refused = _pre_check(cls, tuple(local_args))
        if refused is not None:
            return refused
        try:
            outputs = cls.apply(*local_args)
        except SpmdTypeError as err:
            return str(err)
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        refs = reference if isinstance(reference, (tuple, list)) else (reference,)
        for i, (o, want) in enumerate(zip(outs, refs)):
            if isinstance(o, torch.Tensor):
                got = _reassemble(o, sizes, coords_of, names, f"{cls.__name__} output {i} under {placement}")
                if not torch.allclose(got, want.detach(), rtol=rtol, atol=atol):
                    raise RuleCheckError(f"{cls.__name__} output {i} under {placement}: the hook's types reassemble "
                                         f"to values that differ from the kernel on the global inputs (max abs diff "
                                         f"{(got - want.detach()).abs().max().item():.3g})")
    return None


def _spec(types: dict, ndim: int) -> Any:
    import spmd_types as spmd

    dims: list[tuple] = [() for _ in range(ndim)]
    for axis, t in types.items():
        if isinstance(t, Shard):
            dims[t.dim] += (axis,)
    if not any(dims):
        return None
    return spmd.PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in dims))


def _pre_check(cls: type, local_args: tuple) -> str | None:
    """A hook of the returning shape is asked first, with no kernel run: its refusal, or None."""
    returns, names = hook_shape(cls)
    if not returns:
        return None
    COVERAGE.stack.append(set())
    try:
        cls.spmd_typecheck(**hook_kwargs(cls, bind_forward_args(cls, local_args), names))
    except SpmdTypeError as err:
        return str(err)
    finally:
        COVERAGE.stack.pop()
    return None


def rulecheck(cls: type, args: Sequence[Any], placements: Mapping[str, Any] | None = None, *,
              mesh: Mapping[str, int] | None = None, rtol: float = 1e-4, atol: float = 1e-5,
              local_tensor_mode: bool = False) -> RuleCheckReport | None:
    """Check that ``cls.spmd_typecheck`` describes what ``cls.forward`` computes, on simulated ranks.

    ``args`` are ``cls.apply``'s arguments with *global* tensors; a string that
    names a mesh axis stands for that axis's process group. ``placements``
    (per tensor argument, by ``forward``'s parameter name: ``{axis: R | I | P |
    S(d)}`` or an ``spmd.SpmdType``) checks one configuration and returns None;
    without it every placement of the enumeration is tried and a
    :class:`RuleCheckReport` lists those that matched and those the hook refused.
    ``mesh`` is ``{name: size}`` (default: the one string argument's axis, of
    size 2). The ranks are always simulated under ``LocalTensorMode``
    (``local_tensor_mode=`` is accepted for the published call shape).
    Raises :class:`RuleCheckError` when the reassembled outputs differ from the
    kernel on the global inputs, or when the hook refuses every placement.

    Example::

        report = spmd.rulecheck(LinearAllReduce, (x, weight, "tp"))
        assert report.checked and all(r.reason for r in report.rejected)
    """
    del local_tensor_mode  # ranks are simulated either way
    args = tuple(args)
    sizes = _mesh_sizes(args, mesh)
    if math.prod(sizes.values()) < 2:
        raise ValueError(f"rulecheck: the mesh {sizes} has one rank; nothing would be checked")
    forward = bind_forward_args(cls, args)
    tensors = {name: v for name, v in forward.items() if isinstance(v, torch.Tensor)}
    reference = _reference(cls, args, sizes)
    if placements is not None:
        refused = _run_one(cls, args, dict(placements), sizes, reference, rtol, atol)
        if refused is not None:
            raise SpmdTypeError(f"rulecheck: the hook refused the placements given: {refused}")
        return None
    report = RuleCheckReport()
    for placement in _enumerate(tensors, sizes):
        refused = _run_one(cls, args, placement, sizes, reference, rtol, atol)
        (report.rejected.append(RuleCheckRejection(placement, refused)) if refused is not None
         else report.checked.append(placement))
    if not report.checked:
        raise RuleCheckError(f"rulecheck: {cls.__name__}'s hook refused every placement tried ({len(report.rejected)})")
    return report
