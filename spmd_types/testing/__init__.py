"""Test helpers: count communication, build per-rank values, compute denotations, check against one device.

For single-process simulations with torch's ``LocalTensorMode`` (every rank
in one process, real values) on a fake process group::

    from spmd_types.testing import CommCounter, denote, per_rank
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        x = per_rank(lambda r: torch.full((2,), float(r)))
        with CommCounter() as comms:
            y = spmd.all_reduce(x, "tp", src=spmd.P, dst=spmd.R)
        assert comms.counts == {"all_reduce": 1}
        torch.testing.assert_close(denote(y, mesh, {"tp": spmd.R}), denote(x, mesh, {"tp": spmd.P}))
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .._core.types import I, P, R, SpmdType, V, backward_type
from .._torch.private import TorchDispatchMode, local_tensors_of, simulator
from ._simulate import _coords, _outside_simulation, per_rank, rank_values, simulate
from .equivalence import DivergenceError, EquivalenceReport, NondeterministicStepError, check_equivalence

__all__ = [
    "CommCounter", "per_rank", "rank_values", "denote", "pair", "same_on_ranks", "random_value", "simulate",
    "verify_registration", "VerifyReport", "check_equivalence", "EquivalenceReport", "DivergenceError",
    "NondeterministicStepError",
]

# ``_c10d_functional`` op name -> the short name the counter reports.
_SHORT = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
    # the in-place ``c10d`` ops that raw ``torch.distributed`` collectives run
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "recv_": "recv", "recv_any_source_": "recv",
}
_COMM_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
_SKIP = ("wait_tensor", "_wrap_tensor_autograd", "check_for_nan")


class CommCounter(TorchDispatchMode):
    """Count collectives by kind: ``{"all_reduce": 1, "reduce_scatter": 2}``.

    Functional collectives (what the typed ops run) and the in-place ``c10d``
    ops that raw ``torch.distributed`` collectives run are both counted.

    Counts what runs inside the ``with`` block, forward and backward. Under
    ``LocalTensorMode`` enter it *inside* that mode (outside it sees nothing).
    It cannot be active while a ``torch.compile``'d function runs.

    Example::

        with LocalTensorMode(4), CommCounter() as comms:
            spmd.all_gather(x, "tp", src=spmd.V, dst=spmd.R).sum().backward()
        assert comms.counts == {"all_gather": 1, "reduce_scatter": 1}
    """

    def __init__(self) -> None:
        super().__init__()
        self._counts: Counter[str] = Counter()

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def reset(self) -> None:
        self._counts.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COMM_NAMESPACES:
            name = func.overloadpacket.__name__
            if name not in _SKIP:
                self._counts[_SHORT.get(name, name)] += 1
        return func(*args, **(kwargs or {}))


def same_on_ranks(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One value ``fn()`` held by every rank (an R or I value)."""
    value = fn()
    return per_rank(lambda r: value.clone())


def _combine(values: list[torch.Tensor], t: SpmdType, axis: str) -> torch.Tensor:
    if t is R or t is I:
        for v in values[1:]:
            if v.shape != values[0].shape or not torch.equal(v, values[0]):
                raise AssertionError(f"a {t} value differs across ranks of axis '{axis}'")
        return values[0]
    if t is P:
        return torch.stack(values).sum(0)
    if t is V:
        return torch.stack(values)
    return torch.cat(values, t.dim)  # type: ignore[attr-defined]


def denote(t: torch.Tensor, mesh: Any, types: Mapping[str, SpmdType], *, first: str | None = None) -> torch.Tensor:
    """What per-rank ``t`` of ``types`` means on one device (CONTRACT section 1).

    R/I: the one value (checked equal on every rank); V: the values stacked on a
    new dim 0; S(d): concatenated on dim d; P: summed. Axes are folded
    innermost first (``first`` folds that axis before all others), so an op on
    one axis compares per slice of the others.
    """
    with _outside_simulation():
        return _denote(rank_values(t), mesh, types, first)


def _denote(values: dict[int, torch.Tensor], mesh: Any, types: Mapping[str, SpmdType], first: str | None) -> torch.Tensor:
    names = list(mesh.mesh_dim_names)
    layout = mesh.mesh
    table: dict[tuple[int, ...], torch.Tensor] = {}
    for coord in _coords(layout.shape):
        table[coord] = values[int(layout[coord])]
    order = list(reversed(range(len(names))))
    if first is not None:
        order.remove(names.index(first))
        order.insert(0, names.index(first))
    alive = list(range(len(names)))
    for k in order:
        pos = alive.index(k)
        groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for coord in sorted(table):
            groups.setdefault(coord[:pos] + coord[pos + 1:], []).append(table[coord])
        table = {key: _combine(vals, types[names[k]], names[k]) for key, vals in groups.items()}
        alive.pop(pos)
    return table[()]


def pair(primal: torch.Tensor, cotangent: torch.Tensor, mesh: Any, types: Mapping[str, SpmdType]) -> torch.Tensor:
    """The inner product of a value of ``types`` with a gradient of the backward types, on denotations.

    For a P or V value (and an R value, whose gradient is P) this is the sum
    over ranks of the local inner products; for I it is one copy's.
    """
    back = {a: backward_type(t) for a, t in types.items()}
    a, b = denote(primal, mesh, types), denote(cotangent, mesh, back)
    with _outside_simulation():
        return (a.double() * b.double()).sum()


def random_value(mesh: Any, types: Mapping[str, SpmdType], shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A random per-rank value of ``types``: equal across an axis where the type is R or I.

    Rank ``r``'s value depends only on its coordinates along the axes where it
    may differ (V, S(d), P), so an R/I value really is the same on every rank.
    """
    names = list(mesh.mesh_dim_names)
    layout = mesh.mesh
    keep = [i for i, a in enumerate(names) if types[a] not in (R, I)]
    by_rank: dict[int, torch.Tensor] = {}
    with _outside_simulation():  # one plain draw per rank (under the simulator randn would draw per rank again)
        for coord in _coords(layout.shape):
            key = tuple(coord[i] for i in keep)
            g = torch.Generator().manual_seed(seed * 1000003 + hash(key) % 1000003)
            by_rank[int(layout[coord])] = torch.randn(shape, generator=g)
    return per_rank(lambda r: by_rank[r].clone())


# ---------------------------------------------------------------------------
# verify_registration: check a registered autograd Function's claim on simulated ranks
#
# A registration (``spmd.register_autograd_function``) tells the checker what a
# hand-written autograd Function does. ``verify_registration`` runs the Function
# on every rank of a simulated mesh with random inputs of the declared types:
# ``op=`` claims: the output and the input gradients mean what the spmd op's do
# (denotations equal), the adjoint identity holds, and the communication counts
# are the op's, forward and backward; ``local=True``: no communication, R/I
# outputs and I gradients the same on every rank; ``rule=``: outputs and input
# gradients are values of their types.


@dataclass
class VerifyReport:
    """What :func:`verify_registration` ran and counted."""

    function: str
    kind: str
    forward_comms: dict[str, int] = field(default_factory=dict)
    backward_comms: dict[str, int] = field(default_factory=dict)
    out_types: dict[str, SpmdType] | None = None


def verify_registration(
    cls: type,
    example_args: Sequence[Any],
    *,
    mesh: Any,
    in_types: Sequence[Mapping[str, SpmdType]],
    kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> VerifyReport:
    """Run registered ``cls`` on simulated ranks and check what its registration claims.

    ``example_args`` are the Function's positional arguments; each tensor in
    them gives the local shape and dtype (its values are replaced by random
    per-rank values of the matching entry of ``in_types``, in order).
    ``mesh`` is a ``DeviceMesh`` with named dims on a fake process group of the
    same size (``LocalTensorMode`` simulates its ranks). Raises
    ``AssertionError`` saying what disagrees; returns a :class:`VerifyReport`.

    A Function that reads its rank from the process group (``group.rank()``,
    ``dist.get_rank()``) sees rank 0 on every simulated rank, so its slicing
    cannot be verified this way: check it on real processes (gloo) instead.

    Example::

        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))  # on a fake process group
        spmd.testing.verify_registration(
            _ReduceFromModelParallelRegion, (torch.empty(4, 8), mesh.get_group()),
            mesh=mesh, in_types=[{"tp": spmd.P}],
        )
    """
    LocalTensorMode = simulator().LocalTensorMode

    from .._boundaries.autograd_functions import registration_of

    reg = registration_of(cls)
    if reg is None:
        raise ValueError(f"{cls.__qualname__} is not registered: call spmd.register_autograd_function first")
    if reg.kind == "transparent":
        raise ValueError(f"{cls.__qualname__} is registered transparent=True: its forward is checked op by op, "
                         "and its backward must be the true derivative of its forward; there is no claim to verify")
    kwargs = dict(kwargs or {})
    with LocalTensorMode(mesh.size()):
        return _verify(cls, reg, list(example_args), kwargs, mesh, list(in_types), seed, rtol, atol)


def _verify(cls, reg, example_args, kwargs, mesh, in_types, seed, rtol, atol) -> VerifyReport:
    import spmd_types as spmd

    names = list(mesh.mesh_dim_names)
    slots = [i for i, a in enumerate(example_args) if isinstance(a, torch.Tensor)]
    if len(slots) != len(in_types):
        raise ValueError(f"verify_registration: {len(slots)} tensor arguments but {len(in_types)} in_types")
    full_types = [{a: t.get(a, spmd.V) for a in names} for t in in_types]
    values = {}
    for k, (i, types) in enumerate(zip(slots, full_types)):
        like = example_args[i]
        v = _random(mesh, types, tuple(like.shape), seed + k, like.dtype)
        if v.is_floating_point():
            v.requires_grad_(True)
        values[i] = v
    report = VerifyReport(f"{cls.__module__}.{cls.__qualname__}", reg.kind)
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        typed = {i: spmd.assert_type(v, full_types[k]) for k, (i, v) in enumerate(values.items())}
        args = [typed.get(i, a) for i, a in enumerate(example_args)]
        with CommCounter() as comms:
            out = cls.apply(*args, **kwargs)
        report.forward_comms = comms.counts
        out_t = out[0] if isinstance(out, (tuple, list)) else out
        out_types = spmd.get_type(out_t)
        if out_types is None:
            raise AssertionError(f"{cls.__qualname__}: the registered Function returned an untyped output")
        report.out_types = dict(out_types)
    _denote_or_fail(cls, "output", out_t, mesh, report.out_types)
    grad_types = {a: backward_type(t) for a, t in report.out_types.items()}
    g = _random(mesh, grad_types, tuple(out_t.shape), seed + 101, out_t.dtype)
    leaves = [values[i] for i in slots if values[i].requires_grad]
    with CommCounter() as comms:
        # a clone: a backward may all-reduce its incoming gradient in place (Megatron's copy-to does)
        grads = torch.autograd.grad(out_t, leaves, g.clone(), allow_unused=True) if leaves else ()
    report.backward_comms = comms.counts
    leaf_types = [full_types[k] for k, i in enumerate(slots) if values[i].requires_grad]
    for gx, types in zip(grads, leaf_types):
        if gx is not None:
            _denote_or_fail(cls, "input gradient", gx, mesh, {a: backward_type(t) for a, t in types.items()})
    if reg.kind == "local" and (report.forward_comms or report.backward_comms):
        raise AssertionError(
            f"{cls.__qualname__} is registered local=True (no communication), but it communicated: forward "
            f"{report.forward_comms}, backward {report.backward_comms}"
        )
    if reg.kind == "op":
        _compare_with_op(cls, reg, example_args, kwargs, slots, values, full_types, out_t, g, grads, report,
                         mesh, rtol, atol)
    return report


def _random(mesh, types, shape, seed, dtype) -> torch.Tensor:
    v = random_value(mesh, types, shape, seed)
    if dtype.is_floating_point:
        return v.to(dtype)
    return (v * 4).abs().to(dtype)


def _denote_or_fail(cls, what, t, mesh, types) -> torch.Tensor:
    try:
        return denote(t, mesh, types)
    except AssertionError as err:
        raise AssertionError(f"{cls.__qualname__}: its {what} is not a value of type {types}: {err}") from None


def _compare_with_op(cls, reg, example_args, kwargs, slots, values, full_types, out_t, g, grads, report,
                     mesh, rtol, atol) -> None:
    import spmd_types as spmd

    i = slots[0]
    x = values[i].detach().requires_grad_(values[i].requires_grad)
    op = getattr(spmd, reg.op)
    extra = {"op": reg.reduce} if reg.op in ("all_reduce", "reduce_scatter") else {}
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        # evaluated with the mesh current, as when the Function runs under typecheck()
        axis = reg.axis(example_args, kwargs) if callable(reg.axis) and not isinstance(reg.axis, str) else reg.axis
        if hasattr(axis, "group_name") and axis in _mesh_groups(mesh):
            axis = _mesh_groups(mesh)[axis]
        xt = spmd.assert_type(x, full_types[0])
        with CommCounter() as comms:
            ref = op(xt, axis, src=reg.src, dst=reg.dst, **extra)
        ref_fwd = comms.counts
        ref_types = dict(spmd.get_type(ref))
    if ref_types != report.out_types:
        raise AssertionError(f"{cls.__qualname__}: output typed {report.out_types}, spmd.{reg.op} gives {ref_types}")
    _close(denote(out_t, mesh, report.out_types), denote(ref, mesh, ref_types), rtol, atol,
           f"{cls.__qualname__}: forward differs from spmd.{reg.op}")
    if not x.requires_grad:
        return
    with CommCounter() as comms:
        (ref_grad,) = torch.autograd.grad(ref, x, g.clone())
    ref_bwd = comms.counts
    grad_types = {a: backward_type(t) for a, t in full_types[0].items()}
    got = grads[0]
    if got is None:
        raise AssertionError(f"{cls.__qualname__}: no gradient reached its input, spmd.{reg.op} passes one")
    _close(denote(got, mesh, grad_types), denote(ref_grad, mesh, grad_types), rtol, atol,
           f"{cls.__qualname__}: input gradient differs from the backward of spmd.{reg.op}")
    lhs, rhs = pair(out_t, g, mesh, report.out_types), pair(values[i], got, mesh, full_types[0])
    _close(lhs, rhs, 1e-4, 1e-4, f"{cls.__qualname__}: the adjoint identity fails")
    if (report.forward_comms, report.backward_comms) != (ref_fwd, ref_bwd):
        raise AssertionError(
            f"{cls.__qualname__} communicates differently from spmd.{reg.op}: forward {report.forward_comms} vs "
            f"{ref_fwd}, backward {report.backward_comms} vs {ref_bwd}"
        )


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    maybe_disable_local_tensor_mode = simulator().maybe_disable_local_tensor_mode

    got, want = _one_copy(got), _one_copy(want)
    with maybe_disable_local_tensor_mode():
        if got.shape != want.shape or not torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shapes"
            raise AssertionError(f"{what}: got shape {list(got.shape)}, want {list(want.shape)}, largest difference "
                                 f"{diff}")


def _one_copy(t: torch.Tensor) -> torch.Tensor:
    """A denotation computed under the simulation is the same on every rank: take one copy."""
    if local_tensors_of(t) is not None:
        values = rank_values(t)
        return values[min(values)]
    return t


def _mesh_groups(mesh) -> dict:
    return {mesh.get_group(n): n for n in mesh.mesh_dim_names}
