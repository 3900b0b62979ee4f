"""The typing rules of Megatron-core's communicating autograd Functions, axis by axis (``rule=`` registrations).

Each rule reads the Function's arguments (types, groups, flags) and gives the
output's type on every axis of the current mesh: on the axes of the Function's
process group (found by ranks: one axis, several for a flattened group such as
``tp_ep``, none for a group of one rank) it does what the Function's forward
and backward code does; elsewhere the standard rule of a local op. The table
that attaches them to the classes is ``adapter._table()``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch.distributed as dist

from ..._boundaries import autograd_functions as _af
from ..._core.errors import Rejection
from ..._core.mesh import current_mesh
from ..._core.state import STATE
from ..._core.types import I, P, R, SpmdType, TypeMap, V


def axes_of_group(group: Any) -> tuple[str, ...]:
    """The current mesh's typed axes a Megatron group runs over: one, several (a flattened group such as
    ``tp_ep``), or none (a group of one rank: a collective over it changes no type).

    Example::

        with spmd.set_current_mesh(spmd_megatron.mesh(expert=True)):
            spmd_megatron.axes_of_group(parallel_state.get_expert_tensor_and_model_parallel_group())  # ('ep', 'etp')
    """
    if current_mesh() is None:
        raise ValueError("spmd_megatron: no mesh is current: wrap the code in spmd.set_current_mesh(spmd_megatron.mesh())")
    from ..._core.mesh import resolve_axes

    return resolve_axes(group)


# ---------------------------------------------------------------------------
# per-axis typing helpers for the rule-registered Functions


def _on(types: TypeMap | None, axis: str) -> SpmdType | None:
    return None if types is None else types.get(axis)


def _reject(rule: str, seen: list[tuple[str, str]], fixes: list[str], notes: Iterable[str] = ()) -> Rejection:
    return Rejection(rule, seen, fixes, tuple(notes))


def _linear(x: SpmdType, w: SpmdType, b: SpmdType | None, axis: str, what: str) -> SpmdType | Rejection:
    """Standard typing of ``x @ w.T + b`` on one axis (x linear, w and b not mixed with P)."""
    if w is P or b is P:
        return _reject(f"{what}: a weight or bias that is P on {axis!r} makes the product non-linear in a pending sum",
                       [("axis", axis), ("weight", str(w)), ("bias", str(b))],
                       [f"spmd.all_reduce(weight, {axis!r}, src=spmd.P, dst=spmd.R)"])
    ws = [t for t in (w, b) if t is not None]
    if x is P:
        if b is not None or any(t is not R for t in ws):
            return _reject(f"{what}: its input is P on {axis!r}, so the weight must be R and there must be no bias",
                           [("axis", axis), ("input", "P"), ("weight", str(w)), ("bias", str(b))],
                           [f"spmd.all_reduce(input, {axis!r}, src=spmd.P, dst=spmd.R)"])
        return P
    every = [x, *ws]
    if any(t is I for t in every):
        if all(t is I for t in every):
            return I
        return _reject(f"{what}: I never mixes with R or V on {axis!r}: the input's gradient would need an "
                       "all-reduce that nothing does",
                       [("axis", axis), ("input", str(x)), ("weight", str(w)), ("bias", str(b))],
                       [f"spmd.reinterpret(input, {axis!r}, src=spmd.I, dst=spmd.R)  # Megatron: "
                        "copy_to_tensor_model_parallel_region(input)"])
    return V if any(t.is_varying for t in every) else R


def _tp_linear(x: SpmdType, w: SpmdType, b: SpmdType | None, sp: bool, ar_dgrad: bool, axis: str,
               what: str) -> SpmdType | Rejection:
    """The tp axis of Megatron's linear Functions: SP all-gathers x, allreduce_dgrad reduces x's gradient."""
    if sp:
        if not x.is_varying:
            return _reject(
                f"{what}: with sequence_parallel=True its forward all-gathers the input along dim 0 and its "
                f"backward reduce-scatters the input gradient, so the input must be S(0) on {axis!r}",
                [("axis", axis), ("input", str(x))],
                [f"spmd.convert(input, {axis!r}, src=spmd.{x}, dst=spmd.S(0))  # Megatron: "
                 "scatter_to_sequence_parallel_region(input)"])
        x = R  # all_gather(x, src=S(0), dst=R): reduce-scatter backward
    elif ar_dgrad:
        if x is not I:
            return _reject(
                f"{what}: with allreduce_dgrad=True its backward all-reduces the input gradient, so the input "
                f"must be I on {axis!r} (the same on every rank, its gradient summed)",
                [("axis", axis), ("input", str(x))],
                [f"spmd.all_reduce(input, {axis!r}, src=spmd.P, dst=spmd.I)  # Megatron: "
                 "reduce_from_tensor_model_parallel_region(input)" if x is P else
                 f"pass allreduce_dgrad=False: the input is {x} on {axis!r}, its gradient must not be all-reduced"])
        x = R  # reinterpret(x, I -> R): all-reduce backward
    if w is not None and w.is_varying and w is not V and getattr(w, "dim", None) == 1:
        # row-parallel: w sharded on its input dim, the product contracts a sharded dim: a pending sum
        if b is not None:
            return _reject(f"{what}: a row-parallel product (weight S(1) on {axis!r}) is a pending sum, and a bias "
                           "inside it would be added once on every rank",
                           [("axis", axis), ("weight", str(w)), ("bias", str(b))],
                           ["pass bias=None and add the bias after the all-reduce (RowParallelLinear does)"])
        if not x.is_varying:
            return _reject(f"{what}: a row-parallel weight (S(1) on {axis!r}) needs an input sharded on its last "
                           "dim (V)",
                           [("axis", axis), ("input", str(x)), ("weight", str(w))],
                           [f"spmd.convert(input, {axis!r}, src=spmd.{x}, dst=spmd.S(-1))  # Megatron: "
                            "scatter_to_tensor_model_parallel_region(input)"])
        return P
    return _linear(x, w, b, axis, what)


def _per_axis(args_types: list[TypeMap | None], axes: tuple[str, ...], on_axis: Callable[..., Any],
              other: Callable[..., Any]) -> dict[str, SpmdType] | Rejection:
    """The rule axis by axis: ``on_axis(axis, *types)`` on the Function's group's axes (several for a
    flattened group, none for a group of one rank), ``other(axis, *types)`` on the rest of the mesh."""
    m = current_mesh()
    out: dict[str, SpmdType] = {}
    for axis in m.axis_names:
        per = [_on(t, axis) for t in args_types]
        if m.size(axis) == 1 and all(t is None for t in per):
            continue  # an axis of one rank whose inputs carry no type there: nothing to check or to give
        got = on_axis(axis, *per) if axis in axes else other(axis, *per)
        if isinstance(got, Rejection):
            return got
        out[axis] = got
    return out


def _fill(t: SpmdType | None, default: SpmdType) -> SpmdType:
    return default if t is None else t


def _linear_rule(cls_name: str, sp_index: int | None, ar_index: int, group_index: int) -> Callable[..., Any]:
    """Rule for LinearWithGradAccumulationAndAsyncCommunication / LinearWithFrozenWeight."""

    def rule(*args: Any) -> Any:
        x, w, b = args[0], args[1], args[2]
        sp = bool(args[sp_index]) if sp_index is not None else False
        ar = bool(args[ar_index])
        group = args[group_index]
        tp = axes_of_group(group) if group is not None else _tp_axes()

        def on_tp(axis, xt, wt, bt):
            return _tp_linear(_fill(xt, R), _fill(wt, R), bt, sp, ar, axis, cls_name)

        def other(axis, xt, wt, bt):
            return _linear(_fill(xt, R), _fill(wt, R), bt, axis, cls_name)

        return _per_axis([x, w, b if isinstance(b, TypeMap) else None], tp, on_tp, other)

    return _af.pure_rule(rule)


def _tp_axes() -> tuple[str, ...]:
    from megatron.core import parallel_state as ps

    STATE.uncacheable = True  # read from Megatron's global state, not from the rule's arguments
    return axes_of_group(ps.get_tensor_model_parallel_group())


def _cross_entropy_rule(group_index: int | None) -> Callable[..., Any]:
    """Vocab-parallel cross entropy: logits S(-1) on tp -> loss I on tp (each rank's backward is local)."""

    def rule(*args: Any) -> Any:
        logits = args[0]
        tp = axes_of_group(args[group_index]) if group_index is not None else _tp_axes()
        smoothing = args[2] if group_index is None and len(args) > 2 else 0.0
        if smoothing:
            return _reject(
                "vocab_parallel_cross_entropy with label_smoothing > 0 has no sound type: its forward takes the "
                "mean log-probability over this rank's vocab shard only, so the loss differs per tp rank "
                "(neither I nor a pending sum)",
                [("axis", ", ".join(tp)), ("label_smoothing", str(smoothing))],
                ["vocab_parallel_cross_entropy(logits, labels)  # label_smoothing=0.0",
                 "all-reduce the smoothing term over tp yourself (Megatron-LM issue #737)"])

        def on_tp(axis, lt, _target):
            if lt is None or not lt.is_varying:
                return _reject(
                    f"vocab-parallel cross entropy: its logits must be sharded on the vocab dim (S(-1)) on {axis!r}; "
                    f"its forward all-reduces MAX and SUM over {axis!r} and its backward is local, so the loss is I",
                    [("axis", axis), ("logits", str(lt))],
                    ["keep the logits vocab-sharded: GPTModel(parallel_output=True), or the output layer's "
                     "ColumnParallelLinear(..., gather_output=False)"]
                    + ([f"spmd.convert(logits, {axis!r}, src=spmd.{lt}, dst=spmd.S(-1))"] if lt in (I, R) else []))
            return I

        def other(axis, lt, _target):
            lt = _fill(lt, R)
            if lt is P:
                return _reject(f"vocab-parallel cross entropy is not linear: its logits must not be P on {axis!r}",
                               [("axis", axis), ("logits", "P")],
                               [f"spmd.all_reduce(logits, {axis!r}, src=spmd.P, dst=spmd.R)"])
            return lt

        return _per_axis([logits, args[1] if isinstance(args[1], TypeMap) else None], tp, on_tp, other)

    return _af.pure_rule(rule)


@_af.pure_rule
def _gather_sp_rule(*args: Any) -> Any:
    """_GatherFromSequenceParallelRegion: S(0) -> R (tensor_parallel_output_grad=True) or I (False).

    With ``output_split_sizes`` (the alltoall token dispatcher's gather over
    etp) the pieces differ in length: V -> R or I, the backward an uneven
    reduce-scatter or split with the same sizes.
    """
    x, group, tp_grad = args[0], args[1], (args[2] if len(args) > 2 else True)
    tp = axes_of_group(group)
    sizes = args[3] if len(args) > 3 else None
    if sizes is not None and tp and len(sizes) != _group_size(group):
        return _reject("gather_from_sequence_parallel_region: output_split_sizes needs one size per rank of the group",
                       [("axis", ", ".join(tp)), ("output_split_sizes", str(list(sizes))),
                        ("group size", str(_group_size(group)))],
                       ["pass one length per rank of the group, in rank order"])

    def on_tp(axis, xt):
        if xt is None or not xt.is_varying:
            return _reject(f"gather_from_sequence_parallel_region all-gathers along dim 0: its input must be "
                           f"{'V' if sizes is not None else 'S(0)'} on {axis!r}", [("axis", axis), ("input", str(xt))],
                           [f"spmd.convert(input, {axis!r}, src=spmd.{xt}, dst=spmd.S(0))"])
        return R if tp_grad else I

    return _per_axis([x], tp, on_tp, lambda axis, xt: _fill(xt, R))


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def _reduce_rule(dst: SpmdType, name: str) -> Callable[..., Any]:
    """Megatron's all-reduce / reduce-scatter mappings: P (or V, read as P) -> ``dst`` on the group's axis.

    Registered as a rule, not ``op=``, because a vocab-parallel embedding's
    masked lookup is V locally and means P: like ``spmd.all_reduce(src=V)``,
    V is accepted and read as a pending sum. R or I is refused: summing a
    value every rank already holds multiplies it by the group size.
    """

    def rule(*args: Any) -> Any:
        tp = axes_of_group(args[1])
        uneven = len(args) > 2 and args[2] is not None  # input_split_sizes: pieces of different lengths, V

        def on_tp(axis, xt):
            if xt is P or (xt is not None and xt.is_varying):
                return V if uneven else dst
            return _reject(f"{name} sums over {axis!r}, but its input is {xt} there: the same value on every rank, "
                           "so the sum multiplies it by the group size",
                           [("axis", axis), ("input", str(xt))],
                           [f"drop the {name}: the value is already complete on every rank",
                            f"spmd.convert(input, {axis!r}, src=spmd.{xt}, dst=spmd.P)  # if one rank's copy is meant"])

        return _per_axis([args[0]], tp, on_tp, lambda axis, xt: _fill(xt, R))

    return _af.pure_rule(rule)


def _all_to_all_reads(own: tuple, args: tuple) -> tuple:
    """What :func:`_all_to_all_rule` reads: the group and the input's types (``own``), and of each list of split
    sizes (a list or a numpy array, new every step) its count and total, not its values."""
    return own[:2], tuple(None if sizes is None else (len(sizes), sum(int(s) for s in sizes)) for sizes in args[2:4])


@_af.pure_rule
@_af.rule_reads(_all_to_all_reads)
def _all_to_all_rule(*args: Any, shapes: tuple = ()) -> Any:
    """_AllToAll(group, x, output_split_sizes, input_split_sizes): V -> V on the group's axis.

    A rule, not ``op="all_to_all"``: a registration cannot pass
    ``split_dim=0, concat_dim=0``, and uneven splits (all-to-all-v) are V -> V too.
    The split sizes are checked against the input's rows and the group's size
    before anything is sent (on the way back they are the dispatch's swapped).
    """
    group, out_sizes, in_sizes = args[0], args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None
    tp = axes_of_group(group)
    rows = shapes[1][0] if len(shapes) > 1 and shapes[1] else None
    n = _group_size(group)
    for what, sizes in (("input_split_sizes", in_sizes), ("output_split_sizes", out_sizes)):
        if sizes is not None and len(sizes) != n:
            return _reject(f"Megatron's all_to_all: {what} has {len(sizes)} entries for a group of {n} ranks",
                           [("axis", ", ".join(tp)), (what, str([int(s) for s in sizes]))],
                           [f"pass one size per rank of the group as {what}"])
    if in_sizes is not None and rows is not None and int(sum(int(s) for s in in_sizes)) != rows:
        return _reject(
            f"Megatron's all_to_all: input_split_sizes add up to {int(sum(int(s) for s in in_sizes))} rows, but the "
            f"input has {rows}: the rows sent would not be this rank's rows",
            [("axis", ", ".join(tp)), ("input_split_sizes", str([int(s) for s in in_sizes])),
             ("output_split_sizes", str(None if out_sizes is None else [int(s) for s in out_sizes])),
             ("input rows", str(rows))],
            ["on the way back (the combine), send with the dispatch's output_split_sizes and receive with its "
             "input_split_sizes: all_to_all(group, x, input_splits, output_splits)"])

    def on_tp(axis, xt):
        if xt is None or not xt.is_varying:
            return _reject(f"Megatron's all_to_all exchanges different rows with every rank: its input must be V on "
                           f"{axis!r}", [("axis", axis), ("input", str(xt))],
                           [f"spmd.convert(input, {axis!r}, src=spmd.{xt}, dst=spmd.V)"])
        return V

    return _per_axis([args[1]], tp, on_tp, lambda axis, xt: _fill(xt, R))
