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
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist

# --- torch._C: dispatch and autograd state, read on every typed op -------------------------------------------
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass  # run an op with subclass dispatch off
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack  # how many dispatch modes are active
is_torch_function_enabled = torch._C._is_torch_function_enabled  # inside an op already being run
is_fwd_grad_enabled = torch._C._is_fwd_grad_enabled  # a custom Function's forward runs with it off
AutoDispatchBelowAutograd = torch._C._AutoDispatchBelowAutograd  # a kernel run below autograd (our Functions)
storage_use_count = torch._C._storage_Use_Count  # a storage shared with another tensor (zero buffers)
dispatch_get_all_op_names = torch._C._dispatch_get_all_op_names  # the c10d ops to type (raw collectives)
are_functorch_transforms_active = torch._C._are_functorch_transforms_active  # vmap / grad around a call
functorch_unwrap_if_dead = torch._C._functorch.unwrap_if_dead  # as Function.apply unwraps its arguments
is_functorch_wrapped_tensor = torch._C._functorch.is_functorch_wrapped_tensor  # a vmap/grad-wrapped tensor

# --- autograd.Function: its own apply, unbound (a Python classmethod on 2.13, a C one on 2.14) --------------
FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


def apply_function(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.autograd.Function.apply`` for ``cls``, bypassing an ``apply`` the class (or a registration) set."""
    return FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)


# --- torch.distributed internals ---------------------------------------------------------------------------
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
    import sys

    return sys.modules.get("torch.distributed._functional_collectives")


# --- torch.utils private modules ---------------------------------------------------------------------------
def dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode`` (counting and swapping modes subclass it)."""
    return importlib.import_module("torch.utils._python_dispatch").TorchDispatchMode


def pytree() -> ModuleType:
    """``torch.utils._pytree`` (flatten / unflatten of arguments)."""
    return importlib.import_module("torch.utils._pytree")


# --- the simulator: torch.distributed._local_tensor (LocalTensorMode runs every rank in one process) --------
def simulator() -> ModuleType:
    """``torch.distributed._local_tensor`` (loaded on first use)."""
    return importlib.import_module("torch.distributed._local_tensor")


def prepare_collective_groups(group: Any) -> tuple[list[int], list[int], int]:
    """The simulator's layout of ``group``: (ranks from the first, group offsets, stride)."""
    return importlib.import_module("torch.distributed._local_tensor._c10d")._prepare_collective_groups(group)


# --- DTensor internals (attribute names) -------------------------------------------------------------------
def dtensor_local(dt: Any) -> torch.Tensor:
    """A DTensor's local tensor, with no autograd edge (``DTensor._local_tensor``)."""
    return dt._local_tensor


def dtensor_spec(dt: Any) -> Any:
    """A DTensor's ``DTensorSpec`` (``DTensor._spec``)."""
    return dt._spec


def dtensor_spec_class() -> type:
    """``torch.distributed.tensor._dtensor_spec.DTensorSpec`` (a DTensor built with other placements)."""
    return importlib.import_module("torch.distributed.tensor._dtensor_spec").DTensorSpec


def from_torch_tensor_function() -> type:
    """``torch.distributed.tensor._api._FromTorchTensor``: ``DTensor.from_local``'s autograd Function."""
    return importlib.import_module("torch.distributed.tensor._api")._FromTorchTensor


def fake_store() -> type:
    """``torch.testing._internal.distributed.fake_pg.FakeStore`` (a fake process group's store)."""
    return importlib.import_module("torch.testing._internal.distributed.fake_pg").FakeStore


# --- dynamo internals (torch.compile meeting typed tensors) --------------------------------------------------
def dynamo_eval_frame() -> ModuleType:
    """``torch._C._dynamo.eval_frame`` (frame actions and per-code strategies)."""
    return importlib.import_module("torch._C._dynamo.eval_frame")


def dynamo_exc() -> ModuleType:
    """``torch._dynamo.exc`` (UserError, UserErrorType)."""
    return importlib.import_module("torch._dynamo.exc")


def dynamo_tls() -> Any:
    """``torch._dynamo.symbolic_convert.tls`` (the frame dynamo is converting)."""
    return importlib.import_module("torch._dynamo.symbolic_convert").tls


def tracing_context() -> type:
    """``torch._guards.TracingContext``."""
    return importlib.import_module("torch._guards").TracingContext


# name -> a loader that returns it: every private name above, loaded by tests/test_torch_private.py
NAMES: dict[str, Callable[[], Any]] = {
    "torch._C.DisableTorchFunctionSubclass": lambda: DisableTorchFunctionSubclass,
    "torch._C._len_torch_dispatch_stack": lambda: len_torch_dispatch_stack,
    "torch._C._is_torch_function_enabled": lambda: is_torch_function_enabled,
    "torch._C._is_fwd_grad_enabled": lambda: is_fwd_grad_enabled,
    "torch._C._AutoDispatchBelowAutograd": lambda: AutoDispatchBelowAutograd,
    "torch._C._storage_Use_Count": lambda: storage_use_count,
    "torch._C._dispatch_get_all_op_names": lambda: dispatch_get_all_op_names,
    "torch._C._are_functorch_transforms_active": lambda: are_functorch_transforms_active,
    "torch._C._functorch.unwrap_if_dead": lambda: functorch_unwrap_if_dead,
    "torch._C._functorch.is_functorch_wrapped_tensor": lambda: is_functorch_wrapped_tensor,
    "torch.autograd.Function.__dict__['apply']": lambda: FUNCTION_APPLY,
    "torch.distributed.distributed_c10d._get_default_group": lambda: dist.distributed_c10d._get_default_group,
    "torch.distributed.distributed_c10d._resolve_process_group": lambda: dist.distributed_c10d._resolve_process_group,
    "torch.distributed._functional_collectives": functional_collectives,
    "torch.utils._python_dispatch.TorchDispatchMode": dispatch_mode_base,
    "torch.utils._pytree": pytree,
    "torch.distributed._local_tensor": simulator,
    "torch.distributed._local_tensor.LocalTensorMode": lambda: simulator().LocalTensorMode,
    "torch.distributed._local_tensor.LocalTensor": lambda: simulator().LocalTensor,
    "torch.distributed._local_tensor.LocalIntNode": lambda: simulator().LocalIntNode,
    "torch.distributed._local_tensor.rank_map": lambda: simulator().rank_map,
    "torch.distributed._local_tensor.local_tensor_mode": lambda: simulator().local_tensor_mode,
    "torch.distributed._local_tensor.enabled_local_tensor_mode": lambda: simulator().enabled_local_tensor_mode,
    "torch.distributed._local_tensor.maybe_disable_local_tensor_mode":
        lambda: simulator().maybe_disable_local_tensor_mode,
    "torch.distributed._local_tensor.maybe_run_for_local_tensor": lambda: simulator().maybe_run_for_local_tensor,
    "torch.distributed._local_tensor._int_on_rank": lambda: simulator()._int_on_rank,
    "torch.distributed._local_tensor._c10d._prepare_collective_groups":
        lambda: importlib.import_module("torch.distributed._local_tensor._c10d")._prepare_collective_groups,
    "torch.distributed._local_tensor._LocalContiguous": lambda: simulator()._LocalContiguous,
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": dtensor_spec_class,
    "torch.distributed.tensor._api._FromTorchTensor": from_torch_tensor_function,
    "torch.testing._internal.distributed.fake_pg.FakeStore": fake_store,
    "torch._C._dynamo.eval_frame._FrameAction": lambda: dynamo_eval_frame()._FrameAction,
    "torch._C._dynamo.eval_frame._FrameExecStrategy": lambda: dynamo_eval_frame()._FrameExecStrategy,
    "torch._C._dynamo.eval_frame.set_code_exec_strategy": lambda: dynamo_eval_frame().set_code_exec_strategy,
    "torch._dynamo.exc.UserError": lambda: dynamo_exc().UserError,
    "torch._dynamo.exc.UserErrorType": lambda: dynamo_exc().UserErrorType,
    "torch._dynamo.symbolic_convert.tls": dynamo_tls,
    "torch._guards.TracingContext": tracing_context,
}
