"""Every private torch name the package uses, each once, with what it is for.

Eager names are cheap attributes of ``torch._C`` and modules ``import torch``
loads anyway; the simulator (``torch.distributed._local_tensor``), the
functional collectives and dynamo's internals are loaded on first use by the
functions below, so ``import spmd_types`` never imports them.
``tests/test_torch_private.py`` loads every name in :data:`NAMES` on each
supported torch release.

Example::

    from spmd_types._torch.private import DisableTorchFunctionSubclass
    with DisableTorchFunctionSubclass():
        plain = typed.view_as(typed)   # the op itself, no subclass dispatch
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._python_dispatch as _python_dispatch
import torch.utils._pytree as _pytree
from torch._subclasses import fake_tensor as _fake_tensor

_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# --- torch._C: dispatch and autograd state, read on every typed op -------------------------------------------
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass  # run an op with subclass dispatch off
# call_without_subclass_dispatch(func, types, args[, kwargs]): func(*args, **kwargs) with subclass dispatch off, in
# one C call (what ``with DisableTorchFunctionSubclass(): func(*args, **kwargs)`` does, without the context
# manager's two method calls). Pass kwargs only when there are some: an empty dict, or None, reaches func as
# keywords, which a slot wrapper (a getter's __get__) refuses
call_without_subclass_dispatch = torch._C._disabled_torch_function_impl
EnableTorchFunction = torch._C._EnableTorchFunction  # subclass dispatch back on (a compiled graph's checker)
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack  # how many dispatch modes are active
is_torch_function_enabled = torch._C._is_torch_function_enabled  # inside an op already being run
is_fwd_grad_enabled = torch._C._is_fwd_grad_enabled  # a custom Function's forward runs with it off
AutoDispatchBelowAutograd = torch._C._AutoDispatchBelowAutograd  # a kernel run below autograd (our Functions)
storage_use_count = torch._C._storage_Use_Count  # a storage shared with another tensor (zero buffers)
dispatch_get_all_op_names = torch._C._dispatch_get_all_op_names  # the c10d ops to type (raw collectives)
are_functorch_transforms_active = torch._C._are_functorch_transforms_active  # vmap / grad around a call
functorch_unwrap_if_dead = torch._C._functorch.unwrap_if_dead  # as Function.apply unwraps its arguments
is_functorch_wrapped_tensor = torch._C._functorch.is_functorch_wrapped_tensor  # a vmap/grad-wrapped tensor
SymNode = torch._C._SymNode  # a SymInt's C node (the simulator's per-rank ints get a method added)

# --- ops and autograd's engine -------------------------------------------------------------------------------
c10d_functional = torch.ops._c10d_functional  # the functional collectives' ops (wait_tensor, all_reduce...)
execution_engine = torch.autograd.Variable._execution_engine  # queue_callback: run at the end of backward


def storage_holders(storage: Any) -> int:
    """How many hold ``storage`` (``_storage_Use_Count`` of its C handle, ``UntypedStorage._cdata``)."""
    return storage_use_count(storage._cdata)


def op_schema(op: Any) -> Any:
    """An ``OpOverload``'s ``FunctionSchema`` (``OpOverload._schema``: its arguments' names)."""
    return op._schema


def module_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """A module's own parameters by name, ``None`` entries included (``nn.Module._parameters``)."""
    return module._parameters


# --- torch.compiler's flag: is_compiling() answers it ----------------------------------------------------------
def compiling_flag() -> bool:
    """``torch.compiler._is_compiling_flag`` (what ``torch.compiler.is_compiling()`` reads outside dynamo)."""
    return torch.compiler._is_compiling_flag


def set_compiling_flag(value: bool) -> None:
    """Set ``torch.compiler._is_compiling_flag`` (checking a compiled graph runs eager code paths)."""
    torch.compiler._is_compiling_flag = value


# --- autograd.Function: its own apply, unbound (a Python classmethod on 2.13, a C one on 2.14) --------------
FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


def apply_function(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.autograd.Function.apply`` for ``cls``, bypassing an ``apply`` the class (or a registration) set."""
    return FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)


# --- torch.distributed internals ---------------------------------------------------------------------------
class _NoWorld:
    """torch built without distributed: no process-group world, and no default group."""

    _default_pg = None


# the process-group world; its ``_default_pg`` is the current default group, None before init_process_group
# (read as an attribute on the erased assert_type's path: tests/test_torch_private.py lists those reads)
c10d_world = dist.distributed_c10d._world if dist.is_available() else _NoWorld()


def default_group() -> Any:
    """The default process group (``distributed_c10d._get_default_group``)."""
    return dist.distributed_c10d._get_default_group()


def resolve_process_group(group: Any) -> Any:
    """A process group from its name (``distributed_c10d._resolve_process_group``)."""
    return dist.distributed_c10d._resolve_process_group(group)


def functional_collectives() -> ModuleType:
    """``torch.distributed._functional_collectives`` (loaded on first use)."""
    return importlib.import_module("torch.distributed._functional_collectives")


def loaded_functional_collectives() -> ModuleType | None:
    """The functional collectives module if something imported it already, else None (never imports it)."""
    return sys.modules.get("torch.distributed._functional_collectives")


def flat_layout_class() -> type:
    """``torch.distributed._mesh_layout._FlatLayout``: a device mesh's layout of a region (loaded on first use)."""
    return importlib.import_module("torch.distributed._mesh_layout")._FlatLayout


# --- torch.utils private modules (both loaded by ``import torch``) ------------------------------------------
TorchDispatchMode = _python_dispatch.TorchDispatchMode  # counting and swapping modes subclass it
tree_flatten = _pytree.tree_flatten  # flatten / unflatten of arguments
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves
tree_map_only = _pytree.tree_map_only
TreeSpec = _pytree.TreeSpec  # a flattened structure (a nonstrict-traced call's arguments)

# --- fake tensors (``torch._subclasses``, loaded by ``import torch``) ---------------------------------------
FakeTensor = _fake_tensor.FakeTensor  # a tensor with no data (shape propagation, compile's example values)
FakeTensorMode = _fake_tensor.FakeTensorMode  # the mode that makes them (a compiled graph's checker)


# --- the simulator: torch.distributed._local_tensor (LocalTensorMode runs every rank in one process) --------
def simulator() -> ModuleType:
    """``torch.distributed._local_tensor`` (loaded on first use)."""
    return importlib.import_module("torch.distributed._local_tensor")


def simulator_or_none() -> ModuleType | None:
    """:func:`simulator`, or None on a torch without it."""
    try:
        return simulator()
    except ImportError:  # pragma: no cover - torch without the simulator
        return None


def prepare_collective_groups(group: Any) -> tuple[list[int], list[int], int]:
    """The simulator's layout of ``group``: (ranks from the first, group offsets, stride)."""
    return importlib.import_module("torch.distributed._local_tensor._c10d")._prepare_collective_groups(group)


def int_on_rank(node: Any, rank: int) -> int:
    """A per-rank int node's value on ``rank`` (``_local_tensor._int_on_rank``)."""
    return simulator()._int_on_rank(node, rank)


def local_dist_class() -> type | None:
    """``_local_tensor._LocalDist`` (torch 2.14: LocalTensorMode patches ``dist.get_rank`` with its), or None."""
    return getattr(simulator(), "_LocalDist", None)


def local_tensors_of(t: Any) -> dict[int, torch.Tensor] | None:
    """A LocalTensor's tensors by simulated rank (``LocalTensor._local_tensors``), or None for any other value."""
    return getattr(t, "_local_tensors", None)


# --- DTensor internals (attribute names) -------------------------------------------------------------------
def dtensor_local(dt: Any) -> torch.Tensor:
    """A DTensor's local tensor, with no autograd edge (``DTensor._local_tensor``)."""
    return dt._local_tensor


def dtensor_local_or_none(t: Any) -> torch.Tensor | None:
    """:func:`dtensor_local` of a DTensor, None for a value without one."""
    return getattr(t, "_local_tensor", None)


def dtensor_spec(dt: Any) -> Any:
    """A DTensor's ``DTensorSpec`` (``DTensor._spec``)."""
    return dt._spec


def set_dtensor_spec(dt: Any, spec: Any) -> None:
    """Give a DTensor another ``DTensorSpec`` in place (``DTensor._spec``)."""
    dt._spec = spec


def dtensor_spec_class() -> type:
    """``torch.distributed.tensor._dtensor_spec.DTensorSpec`` (a DTensor built with other placements)."""
    return importlib.import_module("torch.distributed.tensor._dtensor_spec").DTensorSpec


def from_torch_tensor_function() -> type:
    """``torch.distributed.tensor._api._FromTorchTensor``: ``DTensor.from_local``'s autograd Function."""
    return importlib.import_module("torch.distributed.tensor._api")._FromTorchTensor


def fake_store() -> type:
    """``torch.testing._internal.distributed.fake_pg.FakeStore`` (a fake process group's store)."""
    return importlib.import_module("torch.testing._internal.distributed.fake_pg").FakeStore


# --- FSDP2 internals (``torch.distributed.fsdp._fully_shard``): run rank by rank on simulated ranks -----------
def fsdp_slots() -> list[tuple[Any, str]]:
    """FSDP2's functions that a simulation runs rank by rank, as (owner, attribute); loaded on first use.

    ``alloc_storage`` / ``free_storage`` (``_fsdp_param``, and the name ``_fsdp_param_group`` imported)
    resize a tensor's storage; ``_chunk_with_empty`` makes the chunks a parameter's shard is picked from by
    rank; ``FSDPMeshInfo`` / ``DDPMeshInfo.__post_init__`` read this rank's index in the shard and
    replicate groups; ``_fsdp_collectives._get_gradient_divide_factors`` picks the reduce-scatter's op
    (a ``PREMUL_SUM`` for a divide factor other than the group's size). A slot this torch lacks is left out.
    """
    base = "torch.distributed.fsdp._fully_shard."
    param = importlib.import_module(base + "_fsdp_param")
    group = importlib.import_module(base + "_fsdp_param_group")
    common = importlib.import_module(base + "_fsdp_common")
    collectives = importlib.import_module(base + "_fsdp_collectives")
    slots = [(collectives, "_get_gradient_divide_factors"), (param, "alloc_storage"), (param, "free_storage"),
             (group, "alloc_storage"), (param, "_chunk_with_empty"), (common.FSDPMeshInfo, "__post_init__"),
             (common.DDPMeshInfo, "__post_init__")]
    return [(owner, name) for owner, name in slots if name in vars(owner)]


def clear_sharding_cache() -> None:
    """Empty DTensor's sharding-propagation caches (``torch.distributed.tensor.debug._clear_sharding_prop_cache``).

    Their keys compare meshes by value, so a spec cached on one simulation's mesh is handed out on the
    next one's equal mesh (FSDP2 then refuses a parameter whose mesh is not the one it was given).
    """
    importlib.import_module("torch.distributed.tensor.debug")._clear_sharding_prop_cache()


def strided_shard_class() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard``: FSDP2's shard of a dim tp shards too."""
    return importlib.import_module("torch.distributed.tensor.placement_types")._StridedShard


# --- dynamo internals (torch.compile meeting typed tensors) --------------------------------------------------
def dynamo() -> ModuleType:
    """``torch._dynamo`` (loaded on first use: allow_in_graph, nonstrict_trace, disable)."""
    return importlib.import_module("torch._dynamo")


def loaded_dynamo() -> ModuleType | None:
    """``torch._dynamo`` if something imported it already (maybe half made), else None (never imports it)."""
    return sys.modules.get("torch._dynamo")


def graph_break() -> None:
    """``torch._dynamo.graph_break()``: called while dynamo traces, the graph breaks here (dynamo is loaded)."""
    torch._dynamo.graph_break()


def dynamo_eval_frame() -> ModuleType:
    """``torch._C._dynamo.eval_frame`` (frame actions and per-code strategies)."""
    return importlib.import_module("torch._C._dynamo.eval_frame")


def dynamo_exc() -> ModuleType:
    """``torch._dynamo.exc`` (UserError, UserErrorType, ShortenTraceback)."""
    return importlib.import_module("torch._dynamo.exc")


def dynamo_tls() -> Any:
    """``torch._dynamo.symbolic_convert.tls`` (the frame dynamo is converting)."""
    return importlib.import_module("torch._dynamo.symbolic_convert").tls


def inductor_backend() -> Callable[..., Any]:
    """``torch._dynamo.backends.inductor.inductor``: torch.compile's default backend."""
    return importlib.import_module("torch._dynamo.backends.inductor").inductor


def lookup_backend(name: str) -> Callable[..., Any]:
    """A torch.compile backend by its name (``torch._dynamo.backends.registry.lookup_backend``)."""
    return importlib.import_module("torch._dynamo.backends.registry").lookup_backend(name)


TracingContext = torch._guards.TracingContext  # the graph dynamo is compiling (its fake mode)


def _on_2_14(load: Callable[[], Any]) -> Callable[[], Any]:
    """A loader for a name torch 2.14 has and 2.13 does not (the package checks for it before use)."""
    return load if _RELEASE >= (2, 14) else (lambda: "not on torch 2.13")


# name -> a loader that returns it: every private name above, loaded by tests/test_torch_private.py
NAMES: dict[str, Callable[[], Any]] = {
    "torch._C.DisableTorchFunctionSubclass": lambda: DisableTorchFunctionSubclass,
    "torch._C._disabled_torch_function_impl": lambda: call_without_subclass_dispatch,
    "torch._C._EnableTorchFunction": lambda: EnableTorchFunction,
    "torch._C._len_torch_dispatch_stack": lambda: len_torch_dispatch_stack,
    "torch._C._is_torch_function_enabled": lambda: is_torch_function_enabled,
    "torch._C._is_fwd_grad_enabled": lambda: is_fwd_grad_enabled,
    "torch._C._AutoDispatchBelowAutograd": lambda: AutoDispatchBelowAutograd,
    "torch._C._storage_Use_Count": lambda: storage_use_count,
    "torch._C._dispatch_get_all_op_names": lambda: dispatch_get_all_op_names,
    "torch._C._are_functorch_transforms_active": lambda: are_functorch_transforms_active,
    "torch._C._functorch.unwrap_if_dead": lambda: functorch_unwrap_if_dead,
    "torch._C._functorch.is_functorch_wrapped_tensor": lambda: is_functorch_wrapped_tensor,
    "torch._C._SymNode": lambda: SymNode,
    "torch.ops._c10d_functional.wait_tensor": lambda: c10d_functional.wait_tensor,
    "torch.autograd.Variable._execution_engine.queue_callback": lambda: execution_engine.queue_callback,
    "torch.UntypedStorage._cdata": lambda: storage_holders(torch.empty(1).untyped_storage()),
    "torch._ops.OpOverload._schema": lambda: op_schema(torch.ops.aten.add.Tensor).arguments,
    "torch.nn.Module._parameters": lambda: module_parameters(torch.nn.Linear(1, 1)),
    "torch.Tensor._base": lambda: torch.ones(2)[:1]._base,  # read in place by _checker/run_ops.py (a hot path)
    "torch.compiler._is_compiling_flag": compiling_flag,
    "torch.autograd.Function.__dict__['apply']": lambda: FUNCTION_APPLY,
    "torch.distributed.distributed_c10d._world._default_pg": lambda: hasattr(c10d_world, "_default_pg") or None,
    "torch.distributed.distributed_c10d._get_default_group": lambda: dist.distributed_c10d._get_default_group,
    "torch.distributed.distributed_c10d._resolve_process_group": lambda: dist.distributed_c10d._resolve_process_group,
    "torch.distributed._functional_collectives": functional_collectives,
    "torch.distributed._functional_collectives.AsyncCollectiveTensor":
        lambda: functional_collectives().AsyncCollectiveTensor,
    "torch.distributed._mesh_layout._FlatLayout": flat_layout_class,
    "torch.utils._python_dispatch.TorchDispatchMode": lambda: TorchDispatchMode,
    "torch.utils._pytree.tree_flatten": lambda: tree_flatten,
    "torch.utils._pytree.tree_unflatten": lambda: tree_unflatten,
    "torch.utils._pytree.tree_map": lambda: tree_map,
    "torch.utils._pytree.tree_leaves": lambda: tree_leaves,
    "torch.utils._pytree.tree_map_only": lambda: tree_map_only,
    "torch.utils._pytree.TreeSpec": lambda: TreeSpec,
    "torch._subclasses.fake_tensor.FakeTensor": lambda: FakeTensor,
    "torch._subclasses.fake_tensor.FakeTensorMode": lambda: FakeTensorMode,
    "torch.distributed._local_tensor": simulator,
    "torch.distributed._local_tensor.LocalTensorMode": lambda: simulator().LocalTensorMode,
    "torch.distributed._local_tensor.LocalTensor": lambda: simulator().LocalTensor,
    "torch.distributed._local_tensor.LocalTensor._local_tensors":
        lambda: local_tensors_of(simulator().LocalTensor({0: torch.zeros(1), 1: torch.ones(1)})),
    "torch.distributed._local_tensor.LocalIntNode": lambda: simulator().LocalIntNode,
    "torch.distributed._local_tensor.ConstantIntNode": lambda: simulator().ConstantIntNode,
    "torch.distributed._local_tensor.rank_map": lambda: simulator().rank_map,
    "torch.distributed._local_tensor.local_tensor_mode": lambda: simulator().local_tensor_mode,
    "torch.distributed._local_tensor.enabled_local_tensor_mode": lambda: simulator().enabled_local_tensor_mode,
    "torch.distributed._local_tensor.maybe_disable_local_tensor_mode":
        lambda: simulator().maybe_disable_local_tensor_mode,
    "torch.distributed._local_tensor.maybe_run_for_local_tensor": lambda: simulator().maybe_run_for_local_tensor,
    "torch.distributed._local_tensor._int_on_rank": lambda: int_on_rank(simulator().LocalIntNode({0: 3, 1: 4}), 1),
    "torch.distributed._local_tensor._c10d._prepare_collective_groups":
        lambda: importlib.import_module("torch.distributed._local_tensor._c10d")._prepare_collective_groups,
    "torch.distributed._local_tensor._LocalContiguous": lambda: simulator()._LocalContiguous,
    "torch.distributed._local_tensor._LocalDist.get_rank (2.14)":
        _on_2_14(lambda: vars(local_dist_class())["get_rank"]),
    "torch.distributed.tensor.DTensor._local_tensor": lambda: _read_a_dtensor(dtensor_local),
    "torch.distributed.tensor.DTensor._spec": lambda: _read_a_dtensor(lambda dt: dtensor_spec(dt).placements),
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": dtensor_spec_class,
    "torch.distributed.tensor._api._FromTorchTensor": from_torch_tensor_function,
    "torch.testing._internal.distributed.fake_pg.FakeStore": fake_store,
    "torch.distributed.fsdp._fully_shard (alloc_storage, free_storage, _chunk_with_empty, mesh infos, "
    "_get_gradient_divide_factors)": lambda: len(fsdp_slots()) == 7 or None,
    "torch.distributed.tensor.placement_types._StridedShard": strided_shard_class,
    "torch.distributed.tensor.debug._clear_sharding_prop_cache":
        lambda: importlib.import_module("torch.distributed.tensor.debug")._clear_sharding_prop_cache,
    "torch._dynamo": dynamo,
    "torch._dynamo.allow_in_graph": lambda: dynamo().allow_in_graph,
    "torch._dynamo.nonstrict_trace": lambda: dynamo().nonstrict_trace,
    "torch._dynamo.disable": lambda: dynamo().disable,
    "torch._dynamo.graph_break": lambda: dynamo().graph_break,
    "torch._C._dynamo.eval_frame._FrameAction": lambda: dynamo_eval_frame()._FrameAction,
    "torch._C._dynamo.eval_frame._FrameExecStrategy": lambda: dynamo_eval_frame()._FrameExecStrategy,
    "torch._C._dynamo.eval_frame.set_code_exec_strategy": lambda: dynamo_eval_frame().set_code_exec_strategy,
    "torch._dynamo.exc.UserError": lambda: dynamo_exc().UserError,
    "torch._dynamo.exc.UserErrorType": lambda: dynamo_exc().UserErrorType,
    "torch._dynamo.exc.ShortenTraceback": lambda: dynamo_exc().ShortenTraceback,
    "torch._dynamo.symbolic_convert.tls": dynamo_tls,
    "torch._dynamo.backends.inductor.inductor": inductor_backend,
    "torch._dynamo.backends.registry.lookup_backend": lambda: importlib.import_module(
        "torch._dynamo.backends.registry").lookup_backend,
    "torch._guards.TracingContext": lambda: TracingContext,
}


def _read_a_dtensor(read: Callable[[Any], Any]) -> Any:
    """``read`` of a one-rank DTensor on a fake process group (the NAMES checks of DTensor's fields)."""
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("fake", store=fake_store()(), rank=0, world_size=1)
    try:
        return read(DTensor.from_local(torch.zeros(2), init_device_mesh("cpu", (1,)), [Replicate()]))
    finally:
        if made:
            dist.destroy_process_group()
