"""Typecheck unmodified Megatron-core code: its autograd Functions, its process groups, its parameters.

Three calls, made once after ``parallel_state.initialize_model_parallel``::

    from spmd_types import megatron as spmd_megatron

    spmd_megatron.register()                  # Megatron-core's autograd Functions, with their types
    mesh = spmd_megatron.mesh()               # {"dp": group, "tp": group, ...} from parallel_state
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd_megatron.type_parameters(model)  # every parameter typed from Megatron's own attributes
        loss = model(tokens, position_ids, attention_mask, labels=labels)

``megatron.core`` is imported only when one of these is called; the core of
``spmd_types`` never imports this module. Each registration was read from the
Function's forward **and** backward code (megatron-core 0.16.1), not from its
docstring; the table is ``FUNCTIONS`` below and docs/megatron_core.md.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..._boundaries import autograd_functions as _af
from ..._core.errors import Rejection
from ..._core.mesh import current_mesh
from ..._core.state import STATE
from ..._core.types import I, P, R, S, SpmdType, TypeMap, V

__all__ = ["register", "mesh", "type_parameters", "parameter_types", "axis_of_group", "track_grad_sync", "FUNCTIONS"]

_REGISTERED: list[type] = []


# ---------------------------------------------------------------------------
# process groups -> mesh axes


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def axis_of_group(group: Any) -> str:
    """The current mesh's axis whose process group has the same ranks as ``group`` (a Megatron group).

    Megatron builds its own ``ProcessGroup`` objects; a mesh made elsewhere (a
    ``DeviceMesh``) holds different objects over the same ranks. Matching by
    ranks lets a collective on Megatron's tp group be typed on the mesh's ``tp``.

    Example::

        with spmd.set_current_mesh(spmd_megatron.mesh()):
            spmd_megatron.axis_of_group(parallel_state.get_tensor_model_parallel_group())  # 'tp'
    """
    m = current_mesh()
    if m is None:
        raise ValueError("spmd_megatron: no mesh is current: wrap the code in spmd.set_current_mesh(spmd_megatron.mesh())")
    for name, g in m.groups.items():
        if g is group:
            return name
    want = _ranks(group)
    for name, g in m.groups.items():
        if _ranks(g) == want:
            return name
    raise ValueError(
        f"spmd_megatron: the process group over ranks {list(want)} is not an axis of the current mesh "
        f"(axes: {', '.join(f'{n}={list(_ranks(g))}' for n, g in m.groups.items())})"
    )


def mesh() -> dict[str, Any]:
    """``{axis: ProcessGroup}`` for this rank from ``megatron.core.parallel_state``, for ``spmd.set_current_mesh``.

    Always ``dp`` and ``tp``; ``cp``, ``pp`` and ``ep`` where initialized with
    more than one rank, and ``etp`` with ``ep``. The groups are Megatron's own objects.

    Example::

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
            ...
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("spmd_megatron.mesh(): call megatron.core.parallel_state.initialize_model_parallel first")
    axes: dict[str, Any] = {"dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group()}
    optional = (
        ("cp", ps.get_context_parallel_group, ps.get_context_parallel_world_size),
        ("pp", ps.get_pipeline_model_parallel_group, ps.get_pipeline_model_parallel_world_size),
        ("ep", ps.get_expert_model_parallel_group, ps.get_expert_model_parallel_world_size),
        ("etp", ps.get_expert_tensor_parallel_group, ps.get_expert_tensor_parallel_world_size),
    )
    for name, group_of, size_of in optional:
        try:
            size = size_of()
        except (AssertionError, AttributeError, RuntimeError):
            continue
        if size and size > 1:
            axes[name] = group_of()
    if "ep" not in axes:  # without expert parallelism the expert-tp group is the tp group: no axis of its own
        axes.pop("etp", None)
    if "cp" in axes:  # Megatron's gradients sync over dp x cp; dp alone excludes cp
        axes["dp"] = ps.get_data_parallel_group(with_context_parallel=False)
    return axes


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


def _per_axis(args_types: list[TypeMap | None], tp: str, tp_rule: Callable[..., Any],
              other: Callable[..., Any]) -> dict[str, SpmdType] | Rejection:
    m = current_mesh()
    out: dict[str, SpmdType] = {}
    for axis in m.axis_names:
        per = [_on(t, axis) for t in args_types]
        if m.size(axis) == 1 and all(t is None for t in per):
            continue  # an axis of one rank whose inputs carry no type there: nothing to check or to give
        got = tp_rule(*per) if axis == tp else other(axis, *per)
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
        tp = axis_of_group(group) if group is not None else _tp_axis()

        def on_tp(xt, wt, bt):
            return _tp_linear(_fill(xt, R), _fill(wt, R), bt, sp, ar, tp, cls_name)

        def other(axis, xt, wt, bt):
            return _linear(_fill(xt, R), _fill(wt, R), bt, axis, cls_name)

        return _per_axis([x, w, b if isinstance(b, TypeMap) else None], tp, on_tp, other)

    return _af.pure_rule(rule)


def _tp_axis() -> str:
    from megatron.core import parallel_state as ps

    STATE.uncacheable = True  # read from Megatron's global state, not from the rule's arguments
    return axis_of_group(ps.get_tensor_model_parallel_group())


def _cross_entropy_rule(group_index: int | None) -> Callable[..., Any]:
    """Vocab-parallel cross entropy: logits S(-1) on tp -> loss I on tp (each rank's backward is local)."""

    def rule(*args: Any) -> Any:
        logits = args[0]
        tp = axis_of_group(args[group_index]) if group_index is not None else _tp_axis()
        smoothing = args[2] if group_index is None and len(args) > 2 else 0.0
        if smoothing:
            return _reject(
                "vocab_parallel_cross_entropy with label_smoothing > 0 has no sound type: its forward takes the "
                "mean log-probability over this rank's vocab shard only, so the loss differs per tp rank "
                "(neither I nor a pending sum)",
                [("axis", tp), ("label_smoothing", str(smoothing))],
                ["vocab_parallel_cross_entropy(logits, labels)  # label_smoothing=0.0",
                 "all-reduce the smoothing term over tp yourself (Megatron-LM issue #737)"])

        def on_tp(lt, _target):
            if lt is None or not lt.is_varying:
                return _reject(
                    f"vocab-parallel cross entropy: its logits must be sharded on the vocab dim (S(-1)) on {tp!r}; "
                    f"its forward all-reduces MAX and SUM over {tp!r} and its backward is local, so the loss is I",
                    [("axis", tp), ("logits", str(lt))],
                    ["keep the logits vocab-sharded: GPTModel(parallel_output=True), or the output layer's "
                     "ColumnParallelLinear(..., gather_output=False)"]
                    + ([f"spmd.convert(logits, {tp!r}, src=spmd.{lt}, dst=spmd.S(-1))"] if lt in (I, R) else []))
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
    """_GatherFromSequenceParallelRegion: S(0) -> R (tensor_parallel_output_grad=True) or I (False)."""
    x, group, tp_grad = args[0], args[1], (args[2] if len(args) > 2 else True)
    tp = axis_of_group(group)
    if len(args) > 3 and args[3] is not None:
        return _reject("gather_from_sequence_parallel_region with output_split_sizes (uneven all-gather) has no "
                       "typed equivalent: the shards' sizes differ per rank",
                       [("axis", tp), ("output_split_sizes", str(args[3]))],
                       ["pad the sequence to a multiple of the tp size and gather evenly"])

    def on_tp(xt):
        if xt is None or not xt.is_varying:
            return _reject(f"gather_from_sequence_parallel_region all-gathers along dim 0: its input must be S(0) on "
                           f"{tp!r}", [("axis", tp), ("input", str(xt))],
                           [f"spmd.convert(input, {tp!r}, src=spmd.{xt}, dst=spmd.S(0))"])
        return R if tp_grad else I

    return _per_axis([x], tp, on_tp, lambda axis, xt: _fill(xt, R))


def _reduce_rule(dst: SpmdType, name: str) -> Callable[..., Any]:
    """Megatron's all-reduce / reduce-scatter mappings: P (or V, read as P) -> ``dst`` on the group's axis.

    Registered as a rule, not ``op=``, because a vocab-parallel embedding's
    masked lookup is V locally and means P: like ``spmd.all_reduce(src=V)``,
    V is accepted and read as a pending sum. R or I is refused: summing a
    value every rank already holds multiplies it by the group size.
    """

    def rule(*args: Any) -> Any:
        tp = axis_of_group(args[1])

        def on_tp(xt):
            if xt is P or (xt is not None and xt.is_varying):
                return dst
            return _reject(f"{name} sums over {tp!r}, but its input is {xt} there: the same value on every rank, "
                           "so the sum multiplies it by the group size",
                           [("axis", tp), ("input", str(xt))],
                           [f"drop the {name}: the value is already complete on every rank",
                            f"spmd.convert(input, {tp!r}, src=spmd.{xt}, dst=spmd.P)  # if one rank's copy is meant"])

        return _per_axis([args[0]], tp, on_tp, lambda axis, xt: _fill(xt, R))

    return _af.pure_rule(rule)


@_af.pure_rule
def _all_to_all_rule(*args: Any) -> Any:
    """_AllToAll(group, x, output_split_sizes, input_split_sizes): V -> V on the group's axis.

    A rule, not ``op="all_to_all"``: a registration cannot pass
    ``split_dim=0, concat_dim=0``, and uneven splits (all-to-all-v) are V -> V too.
    """
    tp = axis_of_group(args[0])

    def on_tp(xt):
        if xt is None or not xt.is_varying:
            return _reject(f"Megatron's all_to_all exchanges different rows with every rank: its input must be V on "
                           f"{tp!r}", [("axis", tp), ("input", str(xt))],
                           [f"spmd.convert(input, {tp!r}, src=spmd.{xt}, dst=spmd.V)"])
        return V

    return _per_axis([args[1]], tp, on_tp, lambda axis, xt: _fill(xt, R))


# ---------------------------------------------------------------------------
# the table


def _group_arg(i: int) -> Callable[[tuple, dict], Any]:
    """The axis of the Function's group argument ``args[i]`` (the group itself when no mesh is current)."""
    return lambda args, kwargs: axis_of_group(args[i]) if current_mesh() is not None else args[i]


def _table() -> list[tuple[type, dict[str, Any], str]]:
    """(Function, registration keywords, what its forward/backward code does): read from megatron-core 0.16.1."""
    from megatron.core import utils as mutils
    from megatron.core.fusions import (
        fused_bias_geglu,
        fused_bias_gelu,
        fused_bias_swiglu,
        fused_cross_entropy,
        fused_indices_converter,
        fused_mla_yarn_rope_apply,
        fused_softmax,
        fused_weighted_squared_relu,
    )
    from megatron.core.tensor_parallel import cross_entropy, layers, mappings
    from megatron.core.tensor_parallel import random as mrandom

    m = mappings
    g1 = _group_arg(1)
    table: list[tuple[type, dict[str, Any], str]] = [
        (m._CopyToModelParallelRegion, dict(op="reinterpret", axis=g1, src=I, dst=R),
         "forward identity; backward _reduce: all-reduce"),
        (m._ReduceFromModelParallelRegion, dict(rule=_reduce_rule(I, "reduce_from_tensor_model_parallel_region")),
         "forward _reduce: all-reduce; backward identity"),
        (m._ScatterToModelParallelRegion, dict(op="convert", axis=g1, src=I, dst=S(-1)),
         "forward _split_along_last_dim (local slice); backward _gather_along_last_dim: all-gather"),
        (m._GatherFromModelParallelRegion, dict(op="all_gather", axis=g1, src=S(-1), dst=I),
         "forward _gather_along_last_dim: all-gather; backward _split_along_last_dim (local)"),
        (m._ScatterToSequenceParallelRegion, dict(op="convert", axis=g1, src=I, dst=S(0)),
         "forward _split_along_first_dim (local); backward _gather_along_first_dim: all-gather"),
        (m._GatherFromSequenceParallelRegion, dict(rule=_gather_sp_rule),
         "forward all-gather dim 0; backward reduce-scatter (tensor_parallel_output_grad) or local split"),
        (m._ReduceScatterToSequenceParallelRegion,
         dict(rule=_reduce_rule(S(0), "reduce_scatter_to_sequence_parallel_region")),
         "forward reduce-scatter dim 0; backward all-gather dim 0"),
        (m._AllGatherFromTensorParallelRegion, dict(op="all_gather", axis=g1, src=S(-1), dst=R),
         "forward all-gather last dim; backward reduce-scatter last dim"),
        (m._ReduceScatterToTensorParallelRegion,
         dict(rule=_reduce_rule(S(-1), "reduce_scatter_last_dim_to_tensor_parallel_region")),
         "forward reduce-scatter last dim; backward all-gather last dim"),
        (m._AllToAll, dict(rule=_all_to_all_rule),
         "forward all_to_all_single on dim 0 (even or uneven splits); backward _AllToAll back"),
        (layers.LinearWithGradAccumulationAndAsyncCommunication,
         dict(rule=_linear_rule("LinearWithGradAccumulationAndAsyncCommunication", 5, 4, 8)),
         "forward: all-gather dim 0 if sequence_parallel, matmul; backward: reduce-scatter (sequence_parallel) "
         "or all-reduce (allreduce_dgrad) of the input gradient, local weight gradient"),
        (layers.LinearWithFrozenWeight, dict(rule=_linear_rule("LinearWithFrozenWeight", None, 3, 4)),
         "forward matmul; backward all-reduce of the input gradient if allreduce_dgrad, no weight gradient"),
        (cross_entropy._VocabParallelCrossEntropy, dict(rule=_cross_entropy_rule(None)),
         "forward all-reduces MAX then SUM over tp; backward local (softmax minus one-hot, times grad)"),
        (fused_cross_entropy._VocabParallelCrossEntropy, dict(rule=_cross_entropy_rule(2)),
         "forward all-reduces MAX then one SUM over tp_group; backward local"),
        (mrandom.CheckpointFunction, dict(transparent=True),
         "recomputes the forward in backward: the backward is the forward's true derivative"),
        (mrandom.CheckpointWithoutOutputFunction, dict(transparent=True),
         "recomputes the forward in backward: the backward is the forward's true derivative"),
        (mutils.MakeViewlessTensor, dict(local=True), "forward returns a non-view alias; backward identity"),
    ]
    local_kernels = [
        fused_bias_gelu.GeLUFunction, fused_bias_swiglu.BiasSwiGLUFunction, fused_bias_swiglu.SwiGLUFunction,
        fused_bias_swiglu.WeightedSwiGLUFunction, fused_bias_geglu.BiasGeGLUFunction, fused_bias_geglu.GeGLUFunction,
        fused_bias_geglu.WeightedQuickGeGLUFunction, fused_bias_geglu.WeightedBiasQuickGeGLUFunction,
        fused_weighted_squared_relu.WeightedSquaredReLUFunction, fused_softmax.ScaledUpperTriangMaskedSoftmax,
        fused_softmax.ScaledMaskedSoftmax, fused_softmax.ScaledSoftmax,
        fused_indices_converter.IndicesToMultihot, fused_mla_yarn_rope_apply.ApplyMLARotaryEmbQ,
        fused_mla_yarn_rope_apply.ApplyMLARotaryEmbKV,
    ]
    for cls in local_kernels:
        table.append((cls, dict(local=True), "elementwise / row-wise kernel, no communication either way"))
    return table


FUNCTIONS: list[tuple[type, dict[str, Any], str]] = []  # filled by register()


def _report_callers_of_megatron_tensor_parallel() -> None:
    """Errors name the line that called Megatron's tensor_parallel layer, not the layer's own wrapper line.

    ``megatron/core/tensor_parallel`` is library code like torch: an error raised
    inside one of its wrappers (``return _ReduceFromModelParallelRegion.apply(...)``)
    is reported at the model code that called the wrapper.
    """
    import os

    from megatron.core import tensor_parallel

    from ..._core import errors as _errors

    _errors.user_source()  # sets up the package's own skip list first
    here = os.path.dirname(os.path.abspath(tensor_parallel.__file__)) + os.sep
    if here not in _errors._SKIP_DIRS:
        _errors._SKIP_DIRS = (*_errors._SKIP_DIRS, here)


def register() -> list[type]:
    """Register Megatron-core's autograd Functions with their SPMD types (idempotent); returns the classes.

    Example::

        spmd_megatron.register()
        spmd_megatron.register()  # no-op the second time
    """
    if _REGISTERED:
        return list(_REGISTERED)
    table = _table()
    _report_callers_of_megatron_tensor_parallel()
    for cls, how, _ in table:
        _af.register_autograd_function(cls, **how)
        _REGISTERED.append(cls)
    FUNCTIONS[:] = table
    return list(_REGISTERED)


# ---------------------------------------------------------------------------
# parameters


def parameter_types(param: torch.nn.Parameter, axes: Iterable[str]) -> dict[str, SpmdType]:
    """The type Megatron's attributes give one parameter on each of ``axes``.

    ``tensor_model_parallel`` + ``partition_dim`` d: ``S(d)`` on tp.
    ``sequence_parallel=True`` (norm weights and row-parallel biases under
    sequence parallel): R on tp, so their gradient is P until
    ``finalize_model_grads`` all-reduces it. Otherwise I on tp (every rank
    computes the same gradient). R on dp and cp: gradients are P until the
    data-parallel sync.

    Example::

        spmd_megatron.parameter_types(model.output_layer.weight, ("dp", "tp"))  # {'dp': R, 'tp': S(0)}
    """
    out: dict[str, SpmdType] = {}
    for axis in axes:
        if axis in ("dp", "cp"):
            out[axis] = R
        elif axis == "tp":
            if getattr(param, "tensor_model_parallel", False):
                out[axis] = S(int(getattr(param, "partition_dim", 0)))
            elif getattr(param, "sequence_parallel", False):
                out[axis] = R
            else:
                out[axis] = I
        else:
            raise NotImplementedError(
                f"spmd_megatron.type_parameters: parameters on the {axis!r} axis (pipeline / expert parallel) are "
                "not typed yet: type them with spmd.assert_type yourself"
            )
    if not getattr(param, "allreduce", True):
        raise NotImplementedError("spmd_megatron.type_parameters: expert parameters (allreduce=False) are not typed yet")
    return out


def type_parameters(model: torch.nn.Module) -> dict[str, dict[str, SpmdType]]:
    """Type every parameter of ``model`` in place from Megatron's attributes; returns ``{name: types}``.

    Call inside ``spmd.set_current_mesh(mesh())`` and ``spmd.typecheck()``.
    Works on a bare model or a Megatron ``DistributedDataParallel`` wrapper.

    Example::

        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
            spmd_megatron.type_parameters(model)
    """
    from ..._checker.asserts import assert_type

    m = current_mesh()
    if m is None:
        raise ValueError("spmd_megatron.type_parameters: no mesh is current: wrap it in "
                         "spmd.set_current_mesh(spmd_megatron.mesh())")
    typed: dict[str, dict[str, SpmdType]] = {}
    for name, p in model.named_parameters():
        types = parameter_types(p, m.axis_names)
        assert_type(p, types)
        p.__dict__.setdefault("_spmd_name", name)
        typed[name] = types
    return typed


def track_grad_sync(model: torch.nn.Module, mesh_: dict[str, Any] | None = None) -> Any:
    """Type the gradient buffers of a Megatron ``DistributedDataParallel`` model and follow their syncs.

    Call after :func:`type_parameters` and before the backward. Returns a ``GradSyncTracker``: use it as
    a context manager around ``finalize_model_grads`` (or ``finish_grad_sync``);
    each ``param.main_grad`` is then typed P on an axis until a collective sums
    it there. An optimizer step inside ``spmd.typecheck()`` on a gradient still P
    is rejected naming the parameter; summing a gradient twice is rejected at
    the collective.

    Example::

        with spmd.set_current_mesh(mesh):
            with spmd.typecheck():
                spmd_megatron.type_parameters(ddp_model)
            tracker = spmd_megatron.track_grad_sync(ddp_model)
            with spmd.typecheck():
                ddp_model(tokens, positions, mask, labels=labels).sum().backward()
            with tracker:
                finalize_model_grads([ddp_model])
            for p in ddp_model.parameters():
                p.grad = p.main_grad
            with spmd.typecheck():
                optimizer.step()
    """
    from .grads import GradSyncTracker

    return GradSyncTracker(model, mesh_ if mesh_ is not None else mesh())
