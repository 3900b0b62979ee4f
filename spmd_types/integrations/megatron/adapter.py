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
from ..._core.mesh import current_mesh, set_current_mesh
from ..._core.types import I, R, S, SpmdType
from ..._torch.private import module_parameters
from .rules import (  # noqa: F401  (re-exported: the rules are read by tests and docs through the adapter)
    _all_to_all_rule,
    _cross_entropy_rule,
    _gather_sp_rule,
    _linear_rule,
    _reduce_rule,
    axes_of_group,
)

__all__ = ["register", "mesh", "type_parameters", "parameter_types", "axis_of_group", "axes_of_group", "track_grad_sync",
           "FUNCTIONS"]

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


def mesh(expert: bool = False) -> dict[str, Any]:
    """``{axis: ProcessGroup}`` for this rank from ``megatron.core.parallel_state``, for ``spmd.set_current_mesh``.

    The dense mesh: always ``dp`` and ``tp``; ``cp`` and ``pp`` where
    initialized with more than one rank. ``expert=True``: the expert mesh over
    the same ranks, ``edp``, ``ep``, ``etp`` (Megatron's parallel folding; see
    ``integrations/megatron/moe.py``). The groups are Megatron's own objects.

    Example::

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
            ...
    """
    from megatron.core import parallel_state as ps

    if expert:
        from .moe import expert_mesh

        return expert_mesh()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("spmd_megatron.mesh(): call megatron.core.parallel_state.initialize_model_parallel first")
    axes: dict[str, Any] = {"dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group()}
    optional = (
        ("cp", ps.get_context_parallel_group, ps.get_context_parallel_world_size),
        ("pp", ps.get_pipeline_model_parallel_group, ps.get_pipeline_model_parallel_world_size),
    )
    for name, group_of, size_of in optional:
        try:
            size = size_of()
        except (AssertionError, AttributeError, RuntimeError):
            continue
        if size and size > 1:
            axes[name] = group_of()
    if "cp" in axes:  # Megatron's gradients sync over dp x cp; dp alone excludes cp
        axes["dp"] = ps.get_data_parallel_group(with_context_parallel=False)
    return axes


# ---------------------------------------------------------------------------
# the table


def _group_arg(i: int) -> Callable[[tuple, dict], Any]:
    """The Function's group argument ``args[i]``: the checker finds its axes by ranks (several for a flattened
    group, none for a group of one rank)."""
    return lambda args, kwargs: args[i]


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
    from .moe import check_load_balancing, moe_table

    table = _table() + moe_table()
    _report_callers_of_megatron_tensor_parallel()
    check_load_balancing()
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
        elif axis == "pp":
            from .pipeline import parameter_type_on_pp

            out[axis] = parameter_type_on_pp(param)
        else:
            raise ValueError(
                f"spmd_megatron.parameter_types: {axis!r} is not an axis of the dense mesh (dp, cp, tp, pp): an "
                "expert axis (edp, ep, etp) is spmd_megatron.expert_parameter_types's; type any other with "
                "spmd.assert_type"
            )
    if not getattr(param, "allreduce", True) and any(a in ("dp", "cp", "tp") for a in out):
        raise ValueError("spmd_megatron.parameter_types: an expert parameter (allreduce=False) lives on the expert "
                         "mesh: spmd_megatron.expert_parameter_types(param, axes) inside "
                         "spmd.set_current_mesh(spmd_megatron.mesh(expert=True)); type_parameters does both")
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
    from .moe import expert_parameter_types, install_expert_mesh_hooks, layer_mesh, moe_layers

    m = current_mesh()
    if m is None:
        raise ValueError("spmd_megatron.type_parameters: no mesh is current: wrap it in "
                         "spmd.set_current_mesh(spmd_megatron.mesh())")
    modules, params = _modules_and_parameters(model)
    layers = moe_layers(model, modules)
    experts = {id(p) for _, layer in layers if layer.experts is not None for p in layer.experts.parameters()}
    typed: dict[str, dict[str, SpmdType]] = {}
    if layers:
        emesh = mesh(expert=True)
        install_expert_mesh_hooks(model, layer_mesh(mesh(), emesh), layers)
        with set_current_mesh(emesh) as em:
            own = tuple(a for a in em.axis_names if a in ("edp", "ep", "etp"))
            shared = tuple(a for a in em.axis_names if a not in own)  # pp: the same axis on both meshes
            for name, p in params:
                if id(p) in experts:
                    typed[name] = {**expert_parameter_types(p, own), **parameter_types(p, shared)}
                    assert_type(p, typed[name])
                    p.__dict__.setdefault("_spmd_name", name)
    for name, p in params:
        if id(p) in experts:
            continue
        types = parameter_types(p, m.axis_names)
        assert_type(p, types)
        p.__dict__.setdefault("_spmd_name", name)
        typed[name] = types
    return typed


def _modules_and_parameters(model: torch.nn.Module) -> tuple[list, list]:
    """``model.named_modules()`` and ``model.named_parameters()`` (the same names, order and deduplication) from
    one walk of the module tree: type_parameters runs every step in some loops, and a walk is most of its cost."""
    modules = list(model.named_modules())
    if type(model).named_parameters is not torch.nn.Module.named_parameters:
        return modules, list(model.named_parameters())  # a model with its own idea of its parameters
    params, seen = [], set()
    for prefix, module in modules:
        for name, p in module_parameters(module).items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            params.append((prefix + ("." if prefix else "") + name, p))
    return modules, params


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
