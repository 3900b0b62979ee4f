"""Mixture of experts in Megatron-core: the expert mesh, the MoE autograd Functions, expert parameters.

Megatron folds expert parallelism into the same ranks as the dense model
(parallel folding): attention runs on the dense mesh ``(dp, cp, tp)``, the
experts on the expert mesh ``(edp, ep, etp)``, two presentations of the same
ranks. ``mesh(expert=True)`` gives the expert one. Inside every ``MoELayer``
the expert mesh is current (a pair of module hooks, installed by
``type_parameters``): the dispatcher's collectives over ``ep``, ``etp`` and the
flattened ``tp_ep`` group are typed there, axis by axis, and the layer's output
moves back onto the dense mesh (``spmd.reinterpret_mesh``) when it returns.
Values typed on the dense mesh move onto the expert mesh where an op meets
them (``dp: V`` becomes ``(edp: V, ep: V)``; ``tp`` and ``etp`` over the same
ranks keep their type).

Expert parameters (every parameter of an MoE layer's ``experts``) are typed on
the expert mesh: R on ``edp`` (their gradient is summed there, over the expert
data-parallel group, never over the dense ``dp``), V on ``ep`` (each rank holds
its own experts), and on ``etp`` as Megatron's attributes say (a shard S(d),
else I). Megatron marks them ``allreduce=False`` only when ``ep > 1``; the type
here comes from where the parameter lives, so ``ep == 1`` with ``etp != tp``
(Megatron-LM #1628) is typed the same way.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from ..._core.errors import Rejection
from ..._core.mesh import current_mesh, set_current_mesh
from ..._core.state import STATE
from ..._core.types import I, P, R, S, SpmdType, TypeMap, V

__all__ = ["expert_mesh", "layer_mesh", "moe_table", "expert_parameter_types", "moe_layers", "install_expert_mesh_hooks"]


def expert_mesh() -> dict[str, Any]:
    """``{axis: ProcessGroup}`` of the expert mesh from ``megatron.core.parallel_state``: ``edp``, ``ep``, ``etp``.

    The same ranks as :func:`mesh` presented as Megatron's expert groups (and
    ``pp`` where the pipeline has more than one stage). Axes of one rank are
    kept: they carry no type, and a collective over one rank changes none.

    Example::

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
        spmd_megatron.mesh(expert=True)  # {'edp': ..., 'ep': ..., 'etp': ...}
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("spmd_megatron.mesh(): call megatron.core.parallel_state.initialize_model_parallel first")
    axes: dict[str, Any] = {
        "edp": ps.get_expert_data_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
    }
    if ps.get_pipeline_model_parallel_world_size() > 1:
        axes["pp"] = ps.get_pipeline_model_parallel_group()
    return axes


def layer_mesh(dense: dict[str, Any], expert: dict[str, Any]) -> dict[str, Any]:
    """The mesh current inside an MoE layer: the expert mesh, or, where a dense group is no flattening of expert
    axes, the coarsest mesh whose axes flatten into every dense and every expert axis (their common refinement).

    The router reduces over the dense ``tp`` (and ``cp``) groups and the
    dispatcher over the expert groups, in one layer. With ``etp == tp`` (the
    default) the expert mesh has both; with ``tp=2, etp=1, ep=4`` on 8 ranks,
    ``ep`` spans ``tp`` and half of ``dp``, and the layer runs on
    ``(edp, ep.dp, tp)``: an axis that is part of one mesh's axis and part of
    the other's is named ``<expert axis>.<dense axis>``.

    Example::

        spmd_megatron.layer_mesh(spmd_megatron.mesh(), spmd_megatron.mesh(expert=True))
    """
    from ..._core.axes import MeshAxis, region_of_group

    regions = {**{("e", n): region_of_group(g) for n, g in expert.items()},
               **{("d", n): region_of_group(g) for n, g in dense.items()}}
    if any(r.atoms is None for r in regions.values()):
        return expert
    bounds = {1}
    for r in regions.values():
        for size, stride in r.atoms:  # type: ignore[union-attr]
            bounds.update((stride, size * stride))
    cuts = sorted(bounds)
    atoms = [(cuts[k + 1] // cuts[k], cuts[k]) for k in range(len(cuts) - 1)
             if cuts[k + 1] % cuts[k] == 0 and any(_covers(r, cuts[k], cuts[k + 1]) for r in regions.values())]
    expert_atoms = sorted(a for (side, _), r in regions.items() if side == "e" for a in r.atoms)  # type: ignore
    if sorted(atoms) == expert_atoms:
        return expert
    out: dict[str, Any] = {}
    for size, stride in sorted(atoms, key=lambda a: -a[1]):
        region = MeshAxis.of(size, stride)
        owner = {side: n for (side, n), r in regions.items() if _covers(r, stride, size * stride)}
        same = [n for (side, n), r in regions.items() if r == region]
        out[same[0] if same else f"{owner.get('e', '?')}.{owner.get('d', '?')}"] = region
    return out


def _covers(region: Any, lo: int, hi: int) -> bool:
    """Whether a region's atoms include the stride range [lo, hi)."""
    return any(stride <= lo and hi <= size * stride for size, stride in region.atoms)


# ---------------------------------------------------------------------------
# the MoE autograd Functions


def _reject(rule: str, seen: list[tuple[str, str]], fixes: list[str]) -> Rejection:
    return Rejection(rule, seen, fixes)


def _aux_loss_rule(activation: TypeMap | None, aux_loss: TypeMap | None) -> Any:
    """MoEAuxLossAutoScaler(activation, aux_loss): the activation unchanged; aux_loss gets a gradient of ones.

    Its backward hands every rank's ``aux_loss`` the gradient 1: the objective
    gains the sum over ranks of each rank's value. That is the load-balancing
    loss when each rank holds its own tokens' share (V); on an axis where the
    aux loss is the same on every rank (R or I) each rank would add it once
    more (counted group-size times). A pending sum P is accepted: the ones
    reach each rank's piece, the gradient of the sum (R, as P's gradient is).
    """
    if activation is None:
        return None
    if aux_loss is not None:
        for axis, t in aux_loss.items:
            if t is R or t is I:
                return _reject(
                    f"MoEAuxLossAutoScaler adds each rank's aux loss to the objective, but the aux loss is {t} on "
                    f"{axis!r}: the same value on every rank, so it would be counted once per rank",
                    [("axis", axis), ("aux_loss", aux_loss.format())],
                    [f"keep the aux loss each rank's own share (V on {axis!r}): compute it from this rank's tokens "
                     "and the all-reduced tokens-per-expert counts, as switch_load_balancing_loss_func does",
                     f"divide it by the size of {axis!r} if every rank must hold the whole value"])
    return activation.as_dict()


def _random_ste_rule(logits: TypeMap | None) -> Any:
    """RandomSTE(logits): random logits drawn with a per-rank seed (V everywhere), gradient passed straight back."""
    if logits is None:
        return None
    for axis, t in logits.items:
        if t is I or t is P:
            return _reject(
                f"RandomSTE draws different logits on every rank and passes the gradient straight back, so the "
                f"gradient reaching its {t} input on {axis!r} would differ per rank",
                [("axis", axis), ("logits", logits.format())],
                [f"spmd.reinterpret(logits, {axis!r}, src=spmd.I, dst=spmd.R)" if t is I else
                 f"spmd.all_reduce(logits, {axis!r}, src=spmd.P, dst=spmd.R)"])
    return {a: V for a, _ in logits.items}


def _fused_dispatch_rule(name: str) -> Any:
    def rule(*_args: Any) -> Any:
        raise NotImplementedError(
            f"spmd_megatron: typing {name} (the DeepEP / HybridEP fused all-to-all, CUDA only) is not built; "
            "use moe_token_dispatcher_type='alltoall' or 'allgather' to typecheck an MoE model")

    return rule


def moe_table() -> list[tuple[type, dict[str, Any], str]]:
    """(Function, registration keywords, what its code does) for every Function in megatron.core.transformer.moe."""
    from megatron.core.transformer.moe import fused_a2a, moe_utils

    from ..._boundaries.autograd_functions import pure_rule  # its rules read their arguments' types only

    table: list[tuple[type, dict[str, Any], str]] = [
        (moe_utils.RouterGatingLinearFunction, dict(transparent=True),
         "forward: the router's logits, input @ weight.T (+ bias) in router_dtype; backward: its true derivative"),
        (moe_utils.MoEAuxLossAutoScaler, dict(rule=pure_rule(_aux_loss_rule)),
         "forward: identity on the activation, saves aux_loss; backward: the activation's gradient, and ones "
         "(times the main loss's scale) for aux_loss"),
        (moe_utils.RandomSTE, dict(rule=pure_rule(_random_ste_rule)),
         "forward: random logits with a per-rank seed; backward: identity (straight-through)"),
    ]
    for cls in (fused_a2a.FusedDispatch, fused_a2a.FusedCombine, fused_a2a.HybridEPDispatch,
                fused_a2a.HybridEPCombine):
        table.append((cls, dict(rule=_fused_dispatch_rule(cls.__name__)),
                      "DeepEP / HybridEP fused all-to-all (CUDA only): refused with NotImplementedError"))
    return table


def _counts_rule(tokens_per_expert: torch.Tensor) -> None:
    """The load-balancing loss's contract: the token counts are the whole micro-batch's on the router's group.

    Megatron's formula (``switch_load_balancing_loss_func``) pairs each rank's
    own probabilities with one count per expert for all the tokens of the
    sequence-sharded group (tp x cp): the counts must be the same on every rank
    there (I or R), all-reduced before the loss.
    """
    from megatron.core import parallel_state as ps

    from ..._checker.reading import present
    from ..._core.errors import SpmdTypeError, user_source_line
    from .rules import axes_of_group

    if getattr(tokens_per_expert, "_spmd_types", None) is None or current_mesh() is None:
        return
    types = present(tokens_per_expert, "switch_load_balancing_loss_func")[0]
    for axis in axes_of_group(ps.get_tensor_and_context_parallel_group()):
        t = types.get(axis)
        if t is not None and t is not I and t is not R:
            raise SpmdTypeError(
                Rejection(
                    f"switch_load_balancing_loss_func: tokens_per_expert is {t} on {axis!r}, the counts of this "
                    f"rank's tokens only; the load-balancing loss pairs each rank's probabilities with the counts of "
                    f"all the tokens of its group (tp x cp), the same on every rank there",
                    [("axis", axis), ("tokens_per_expert", types.format())],
                    ["reduce_from_tensor_model_parallel_region(local_tokens_per_expert, tp_cp_group) before the loss "
                     "(as get_tokens_per_expert_and_token_count does)"],
                ),
                user_source_line(),
            )


def _with_counts_rule(fn: Any) -> Any:
    if getattr(fn, "__spmd_wrapped__", None) is not None:
        return fn

    @functools.wraps(fn)
    def switch_load_balancing_loss_func(probs: Any, tokens_per_expert: Any, *args: Any, **kwargs: Any) -> Any:
        if STATE.checking:
            _counts_rule(tokens_per_expert)
        return fn(probs, tokens_per_expert, *args, **kwargs)

    switch_load_balancing_loss_func.__spmd_wrapped__ = fn  # type: ignore[attr-defined]
    return switch_load_balancing_loss_func


def check_load_balancing() -> None:
    """Check the token counts given to Megatron's load-balancing loss (the router's calls, idempotent).

    The router calls ``switch_load_balancing_loss_func`` through its module's
    name for it; that name is wrapped with :func:`_counts_rule` (the function
    itself is untouched and runs as before; with checking off the wrapper only
    calls it).
    """
    from megatron.core.transformer.moe import router

    router.switch_load_balancing_loss_func = _with_counts_rule(router.switch_load_balancing_loss_func)


# ---------------------------------------------------------------------------
# expert parameters and the expert mesh inside MoE layers


def moe_layers(model: torch.nn.Module, modules: list | None = None) -> list[tuple[str, torch.nn.Module]]:
    """Every Megatron ``MoELayer`` in ``model``, with its qualified name (``modules``: ``model.named_modules()``
    already walked)."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    return [(n, m) for n, m in (model.named_modules() if modules is None else modules) if isinstance(m, BaseMoELayer)]


def expert_parameter_types(param: torch.nn.Parameter, axes: tuple[str, ...]) -> dict[str, SpmdType]:
    """The type of an expert parameter on each of the expert mesh's ``axes`` (``edp``, ``ep``, ``etp``).

    ``edp``: R (its gradient is P until the expert data-parallel sync);
    ``ep``: V (each rank holds its own experts); ``etp``: ``S(partition_dim)``
    for a shard, else I. ``type_parameters`` adds the axes both meshes share
    (``pp``) from :func:`parameter_types`.

    Example::

        spmd_megatron.expert_parameter_types(fc1.weight, ("edp", "ep", "etp"))  # {'edp': R, 'ep': V, 'etp': S(0)}
    """
    out: dict[str, SpmdType] = {}
    for axis in axes:
        if axis == "edp":
            out[axis] = R
        elif axis == "ep":
            out[axis] = V
        elif axis == "etp":
            out[axis] = (S(int(getattr(param, "partition_dim", 0))) if getattr(param, "tensor_model_parallel", False)
                         else I)
        else:
            raise ValueError(f"spmd_megatron.expert_parameter_types: {axis!r} is not an axis of the expert mesh "
                             "(edp, ep, etp)")
    return out


class _ExpertMeshHooks:
    """The expert mesh current while an MoE layer runs; its output moved back onto the caller's mesh."""

    def __init__(self, mesh: dict[str, Any]) -> None:
        self.mesh = mesh
        self.stack: list[tuple[contextlib.ExitStack, Any]] = []

    def before(self, module: torch.nn.Module, args: Any) -> None:
        outer = current_mesh()
        stack = contextlib.ExitStack()
        if outer is not None:
            stack.enter_context(set_current_mesh(self.mesh))
        self.stack.append((stack, outer))

    def after(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        stack, outer = self.stack.pop()
        stack.close()
        if outer is None:
            return output
        from ..._comm.reinterpret_mesh import reinterpret_mesh

        def back(o: Any) -> Any:
            if isinstance(o, torch.Tensor) and getattr(o, "_spmd_types", None) is not None:
                return reinterpret_mesh(o, outer)
            return o

        if isinstance(output, tuple):
            return tuple(back(o) for o in output)
        return back(output)


def install_expert_mesh_hooks(model: torch.nn.Module, mesh: dict[str, Any], layers: list | None = None) -> int:
    """Make ``mesh`` (the expert mesh) current inside every MoE layer of ``model`` (idempotent); returns the count.
    ``layers``: ``moe_layers(model)`` already found."""
    count = 0
    for _, layer in moe_layers(model) if layers is None else layers:
        hooks = layer.__dict__.get("_spmd_expert_hooks")
        if hooks is not None:
            hooks.mesh = mesh
        else:
            hooks = _ExpertMeshHooks(mesh)
            layer.register_forward_pre_hook(hooks.before)
            layer.register_forward_hook(hooks.after, always_call=True)
            layer.__dict__["_spmd_expert_hooks"] = hooks
        count += 1
    return count
