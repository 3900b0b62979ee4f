"""LTensor: a torch.Tensor subclass that carries its SPMD types and asks the rules.

The typed path of ``__torch_function__`` is kept short: build a cache key from
the operands' interned type maps, look the result type up (inferring it on a
miss), run the op with subclass dispatch disabled, and set the result's class
and types in place. LTensor never knows about collectives.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

from .._core.async_tensor import settled
from .._core.errors import Rejection, SpmdTypeError, op_error, user_source_line
from .._core.mesh import current_mesh
from .._core.spec import format_shape, short_dtype
from .._core.state import STATE
from .._core.types import I, R, TypeMap, V
from .._guards.function_guard import WATCHED, check_apply_outputs, check_no_unregistered_function, watch_apply_output
from .._guards.optim_checks import mark_grad, unsynced_grad, unsynced_grad_rejection
from .._guards.strict import check_typed_root, typed_root
from .._guards.transforms import (
    dynamo_tracing,
    is_transform_tensor,
    transform_error,
    typed_tensor_traced,
    vmap_setup_caller,
)
from .._guards.unchecked_code import UNCHECKED_CODES, in_unchecked_code
from .._local.op_registry import OpEntry, entry_for
from .._local.rules import infer
from .._torch.private import (
    DisableTorchFunctionSubclass,
    is_fwd_grad_enabled,
    is_torch_function_enabled,
    len_torch_dispatch_stack,
)
from .global_ops import explain, global_types, onto_current_mesh, set_spec
from .loaded_types import check_loaded_type
from .metadata_reads import install_metadata_reads
from .result_keys import Keyed, keyed_by, more_key
from .run_ops import (  # noqa: F401 - _run_swapped, _PASSTHROUGH: used by other modules and tests
    _AUTOGRAD_RUNS,
    _BACKWARD,
    _NO_TYPES,
    _OFF_CALL,
    _PASSTHROUGH,
    _SWAP_BACK,
    _TYPED_CLASSES,
    _UNCHECKED,
    _run,
    _run_swapped,
    _swap_to_base,
)
from .trace import log_op
from .typed_classes import register_bases
from .typed_classes import typed_class_for as _typed_class_for
from .zero_buffers import into_zeros, known_into_zeros, remember, storage_shared

__all__ = ["LTensor", "TypedParameter", "make_typed", "type_in_place", "format_tensor_type"]

_DisableTF = DisableTorchFunctionSubclass
_dispatch_depth = len_torch_dispatch_stack
_tf_enabled = is_torch_function_enabled
_grad_enabled = torch.is_grad_enabled
_fwd_grad_enabled = is_fwd_grad_enabled

# Ops typed elsewhere: func -> handler(func, args, kwargs). _foreach.py registers the
# multi-tensor (torch._foreach_*) and fused optimizer (torch._fused_*) kernels.
HANDLERS: dict[Any, Any] = {}
_PLAIN = object()
_ZERO = object()
_NUMBER = object()
_NONE = object()
_CACHES: tuple[dict, dict] = ({}, {})  # non-strict, strict
_MISSING = object()
_TRANSFORMED = object()  # a torch.func transform's wrapped tensor (see _vmap.py)
_DIM = torch.Tensor.dim
_VIEW_AS = torch.Tensor.view_as
_REGISTER_HOOK = torch.Tensor.register_hook
_PyFunction = types.FunctionType
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_COMPILER = torch.compiler
_ALIAS = torch.ops.aten.alias.default
_INT_ONLY = {int}
_NONZERO = bool  # a sequence of ints is marked by which entries are zero (False) and which not (True)

def format_tensor_type(t: torch.Tensor, types: TypeMap | None) -> str:
    """``f32[4,16] {dp: V, tp: R}``; in global SPMD ``f32[8,16@tp] {dp: V, tp: V}`` (global sizes)."""
    mesh = current_mesh()
    spec = getattr(t, "_spmd_spec", None)
    with _DisableTF():
        local = tuple(t.shape)
    sizes = mesh.sizes() if (mesh is not None and spec is not None) else {}
    if spec is not None and any(a not in sizes for e in spec for a in e):
        spec = None
    order = mesh.axis_names if mesh is not None else ()
    shape = format_shape(local, spec, sizes)
    return f"{short_dtype(t.dtype)}[{shape}] " + (types.format(order) if types is not None else "untyped")


class LTensor(torch.Tensor):
    """A tensor with a local SPMD type per mesh axis.

    Made by :func:`spmd_types.assert_type` inside :func:`spmd_types.typecheck`;
    ordinary torch ops on it return LTensors typed by the rules table.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            x = spmd.assert_type(torch.randn(4, 16), {"dp": spmd.V, "tp": spmd.R})
            print(x)   # f32[4,16] {dp: V, tp: R}
    """

    _spmd_types: TypeMap

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        # torch.compile traces the erased program; the graph is checked whole (spmd_types/_compile). The flag is read
        # only outside dynamo's trace (which would guard on it): what dynamo or a backend reads of a typed tensor.
        if _dynamo_tracing() or _COMPILER._is_compiling_flag:
            return _traced_op(func, args, kwargs)
        if not STATE.checking or (UNCHECKED_CODES and in_unchecked_code()):  # register_no_typecheck's functions
            if func in _KEEP_UNCHECKED:
                return _KEEP_UNCHECKED[func](func, args, kwargs)
            return _run(func, args, kwargs)
        if WATCHED.outputs:  # an input a Function returned as it is, aliased by apply: its class now known
            check_apply_outputs()
        if not _grad_enabled() and not _fwd_grad_enabled():  # how a custom Function's forward runs
            if not check_no_unregistered_function() and func is _VIEW_AS:
                return watch_apply_output(_typed_call(func, args, kwargs))
        if func in _UNCHECKED:
            if func is _DIM and vmap_setup_caller():  # torch.vmap is batching a typed tensor
                raise transform_error(format_tensor_type(args[0], args[0]._spmd_types))
            if func is _REGISTER_HOOK:
                return _register_typed_hook(func, args, kwargs)
            if func in _AUTOGRAD_RUNS or _dispatch_depth():
                return _run(func, args, kwargs)
            # _run's common case, without the call
            return _OFF_CALL(func, _NO_TYPES, args, kwargs) if kwargs else _OFF_CALL(func, _NO_TYPES, args)
        handler = HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        return _typed_call(func, args, kwargs)

    __hash__ = torch.Tensor.__hash__

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return format_tensor_type(self, getattr(self, "_spmd_types", None))

    def __deepcopy__(self, memo: dict) -> LTensor:
        if id(self) in memo:
            return memo[id(self)]
        with _DisableTF():
            data = self.detach().clone(memory_format=torch.preserve_format)
        state = {k: v for k, v in self.__dict__.items() if k != "_spmd_grad_hooked"}
        if isinstance(self, torch.nn.Parameter):
            data = type_in_place(torch.nn.Parameter(data, self.requires_grad), self._spmd_types)
        else:
            if self.requires_grad and self.is_leaf:
                data.requires_grad_(True)
            data.__class__ = _typed_class_for(data)
        data.__dict__.update(copy.deepcopy(state, memo))
        memo[id(self)] = data
        return data


def _typed_call(func, args, kwargs):
    """Check ``func(*args, **kwargs)`` against the rules, run it, and type its result."""
    if STATE.global_mode:
        onto_current_mesh(func, args, kwargs)
    key = [func]
    for a in args:
        tp = type(a)
        if tp in _TYPED_CLASSES:
            key.append(a._spmd_types)
        elif tp is int:  # _marker's answer, without the call (sizes and dims)
            key.append(_ZERO if a == 0 else _NUMBER)
        else:
            key.append(_marker(a))
    if kwargs:
        for k, v in kwargs.items():
            key.append(k)
            key.append(_marker(v))
    key = tuple(key)
    cache = _CACHES[STATE.strict]
    out_types = cache.get(key, _MISSING)
    if type(out_types) is Keyed:  # this signature's answer also depends on gradient bits or the current mesh
        out_types = cache.get(more_key(out_types, key, args, kwargs), _MISSING)
    if out_types is _MISSING:
        STATE.uncacheable = False
        out_types = _infer_or_raise(func, args, kwargs, key)
        if not STATE.uncacheable:
            cache[key] = out_types
        elif STATE.uncacheable is not True:  # cached with what else it read (gradient bits, the mesh)
            keyed = keyed_by(STATE.uncacheable)
            cache[key] = keyed
            cache[more_key(keyed, key, args, kwargs)] = out_types
    if STATE.tracing:
        log_op(entry_for(func).display, list(args) + list(kwargs.values()), out_types)
    if STATE.global_mode and out_types is not None:
        try:
            out = _run(func, args, kwargs)
        except Exception:
            explain(func, args, kwargs, out_types)
            raise
        return _global_result(func, args, kwargs, out, out_types)
    if func in _AUTOGRAD_RUNS or _dispatch_depth():
        out = _run(func, args, kwargs)
    else:  # _run's common case, without the call
        out = _OFF_CALL(func, _NO_TYPES, args, kwargs) if kwargs else _OFF_CALL(func, _NO_TYPES, args)
    if out_types is None:
        return out
    tp = type(out)
    if tp is torch.Tensor:  # _wrap's common cases, without the call
        out.__class__ = LTensor
        out._spmd_types = out_types
        return out
    if tp in _TYPED_CLASSES:  # an in-place op's destination, or an op that returned its operand
        return out
    return _wrap(out, out_types)


def _register_typed_hook(func, args, kwargs):
    """``t.register_hook(hook)``: the hook gets the gradient typed (t's backward type), so its ops are checked."""
    t, hook = args[0], (args[1] if len(args) > 1 else kwargs["hook"])
    back = t._spmd_types.backward()

    def typed_hook(grad):
        if STATE.checking and type(grad) not in _TYPED_CLASSES:
            grad = make_typed(grad, back)
        return hook(grad)

    return _run(func, (t, typed_hook), {})


def _traced_op(func, args, kwargs):
    """An op on a typed tensor while torch.compile traces or compiles: the plain op, unchecked here.

    Code dynamo traces records the plain op in the graph, which is checked whole before it is compiled.
    Called for real (dynamo or a backend reading a typed tensor's metadata), it tells the compile room
    that this graph holds typed tensors.
    """
    if not dynamo_tracing() or not isinstance(func, _PyFunction):
        if not dynamo_tracing():
            typed_tensor_traced()
        with _DisableTF():
            return func(*args, **kwargs)
    # dynamo traces a Python function (a torch.nn.functional one): on plain views of the typed operands, as dynamo
    # would route the function's own __torch_function__ check back here with subclass dispatch off
    return func(*_plain_views(args), **dict(zip(kwargs, _plain_views(tuple(kwargs.values())))))


def _plain_views(args: tuple) -> list:
    """Plain aliases of the typed operands (``aten.alias``: the compiled-graph checker reads it as the value itself)."""
    out = []
    for a in args:
        if type(a) in _TYPED_CLASSES:
            with _DisableTF():
                a = _ALIAS(a)
        elif type(a) is list or type(a) is tuple:
            a = type(a)(_plain_views(a))
        out.append(a)
    return out


def _global_result(func, args, kwargs, out, out_types: TypeMap):
    """Propagate partition specs (global SPMD) and type the result."""
    out_types, spec = global_types(func, args, kwargs, out, out_types)
    wrapped = _wrap(out, out_types)
    if spec is not None:
        set_spec(wrapped, spec)
    return wrapped


# torch turns a TypeError raised inside a binary operator (``a + b``) into
# NotImplemented, which would hide an SpmdTypeError behind Python's generic
# "unsupported operand" message. LTensor's operators therefore check first,
# in Python, and only then call torch's operator.
_BINARY_DUNDERS = (
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__",
    "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__matmul__", "__rmatmul__",
    "__pow__", "__rpow__", "__ipow__", "__floordiv__", "__rfloordiv__", "__ifloordiv__", "__mod__",
    "__rmod__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__and__", "__rand__",
    "__iand__", "__or__", "__ror__", "__ior__", "__xor__", "__rxor__", "__ixor__",
)


def _make_operator(name: str):
    base = getattr(torch.Tensor, name)

    def operator(self, other):
        # Inside an op being run (subclass dispatch off), behave as torch's own operator.
        if not _tf_enabled():
            with _DisableTF():
                return base(self, other)
        if not STATE.checking or (UNCHECKED_CODES and in_unchecked_code()):  # erased (simulated ranks included)
            return _run(base, (self, other), {})
        if WATCHED.outputs:
            check_apply_outputs()
        if not _grad_enabled() and not _fwd_grad_enabled():
            check_no_unregistered_function()
        return _typed_call(base, (self, other), {})

    operator.__name__ = operator.__qualname__ = name
    return operator


for _name in _BINARY_DUNDERS:
    setattr(LTensor, _name, _make_operator(_name))


class TypedParameter(LTensor, torch.nn.Parameter):
    """An ``nn.Parameter`` typed in place by ``assert_type``: still the module's parameter."""

    def __reduce_ex__(self, proto: int):
        with _DisableTF():
            data = self.detach()
        return (_rebuild_typed_parameter, (data, self.requires_grad, self._spmd_types))


def _rebuild_typed_parameter(data: torch.Tensor, requires_grad: bool, types: TypeMap) -> TypedParameter:
    p = torch.nn.Parameter(data, requires_grad)
    type_in_place(p, types)
    return p  # type: ignore[return-value]


install_metadata_reads(LTensor)
_SWAP_BACK[TypedParameter] = torch.nn.Parameter
_SWAP_BACK[LTensor] = torch.Tensor  # a plain tensor typed in place under the rank simulator (made outside it)
_TYPED_CLASSES.update({LTensor, TypedParameter})
register_bases(LTensor, TypedParameter)


def _marker(a: Any) -> Any:
    tp = type(a)
    if tp in _TYPED_CLASSES:
        return a._spmd_types
    if tp is int or tp is float:
        return _ZERO if a == 0 else _NUMBER
    if a is None:
        return _NONE
    if isinstance(a, torch.Tensor):
        found = getattr(a, "_spmd_types", None)
        if found is not None:
            return found
        return _TRANSFORMED if is_transform_tensor(a) else _PLAIN
    if tp is list or tp is tuple:  # sizes mostly (split, view, permute)
        if a and set(map(type, a)) == _INT_ONLY:  # all ints: which are zero, without a Python step per number
            return tuple(map(_NONZERO, a))
        return tuple((_ZERO if x == 0 else _NUMBER) if type(x) is int else _marker(x) for x in a)
    if tp is str:  # a mode argument can decide linearity (scatter_reduce's reduce="sum" vs "amax")
        return a
    return None


_NUMBERS = frozenset({int, float, bool})


def _wrap(out: Any, types: TypeMap) -> Any:
    tp = type(out)
    if tp is torch.Tensor:
        out.__class__ = LTensor
        out._spmd_types = types
        return out
    if tp is list or tp is tuple:
        for o in out:  # split, chunk, unbind: plain tensors typed in place (the container stays the same)
            if type(o) is not torch.Tensor:
                if type(o) in _NUMBERS and all(type(x) in _NUMBERS for x in out):
                    return out  # tolist(): numbers, nothing to type
                return tp(_wrap(o, types) for o in out)
            o.__class__ = LTensor
            o._spmd_types = types
        return out
    if isinstance(out, torch.Tensor):
        if tp in _TYPED_CLASSES:
            return out
        out.__class__ = _typed_class_for(out)
        out._spmd_types = types
        return out
    if isinstance(out, tuple):  # torch.return_types structseqs
        return tp([_wrap(o, types) for o in out])
    return out


# ---------------------------------------------------------------------------
# outside typecheck: a checkpoint keeps its types, and loading one checks them


def _keeping_type(func, args, kwargs):
    """``detach()`` and ``to()`` outside typecheck keep the type: ``state_dict()`` is made of detached
    tensors, and ``optimizer.load_state_dict`` moves its state with ``to()``."""
    out = _run(func, args, kwargs)
    types = getattr(args[0], "_spmd_types", None) if args else None
    if types is None or not isinstance(out, torch.Tensor) or type(out) in _TYPED_CLASSES:
        return out
    spec = getattr(args[0], "_spmd_spec", None)
    out = _wrap(out, types)
    if spec is not None:
        out._spmd_spec = spec
    return out


def _copy_checking_type(func, args, kwargs):
    """``dest.copy_(src)`` outside typecheck (``load_state_dict``) refuses a typed ``src`` of another type."""
    if len(args) >= 2:
        check_loaded_type("the value copied in (Tensor.copy_)", getattr(args[1], "_spmd_types", None),
                          getattr(args[0], "_spmd_types", None))
    return _run(func, args, kwargs)


_KEEP_UNCHECKED = {torch.Tensor.detach: _keeping_type, torch.Tensor.to: _keeping_type,
                   torch.Tensor.copy_: _copy_checking_type}


# the slow path: inference on a cache miss
def _infer_or_raise(func, args, kwargs, key=None) -> TypeMap | None:
    for a in (*args, *kwargs.values()):  # a transform's wrapped tensor meets a typed one (never cached)
        if _marker(a) is _TRANSFORMED:
            typed = next((x for x in (*args, *kwargs.values()) if type(x) in _TYPED_CLASSES), None)
            raise transform_error(format_tensor_type(typed, typed._spmd_types) if typed is not None else "typed")
    if func is _BACKWARD:
        _check_backward_root(args, kwargs)
        return None
    entry = entry_for(func)
    dest = kwargs.get("out") if "out" in kwargs else (args[0] if entry.inplace and args else None)
    if entry.row.zero_buffer is not None:  # writing into a buffer of zeros: the values' type (choice 30)
        known = known_into_zeros(entry, args, kwargs, dest, key)
        if known is not None:
            _type_plain_destination(dest, known)
            return known
    result = infer(entry, args, kwargs, STATE.strict)
    zeros, read = False, True
    if entry.row.zero_buffer is not None and (isinstance(result, Rejection) or (
            result is not None and isinstance(dest, torch.Tensor) and getattr(dest, "_spmd_types", None) is None)):
        result, zeros, read = into_zeros(entry, args, kwargs, dest, result)
    if isinstance(result, Rejection):
        found = unsynced_grad(args, kwargs)  # a forgotten gradient sync: name the parameter
        if found is not None:
            raise SpmdTypeError(unsynced_grad_rejection(entry.display, *found), user_source_line())
        raise op_error(result, getattr(func, "__name__", ""), entry.row.params)
    if dest is not None and result is not None:
        if zeros and args and dest is args[0]:
            _type_plain_destination(dest, result)
        _check_destination(entry, dest, result)
    if zeros and read is not True and key is not None:
        remember(key, result, read, args, kwargs)
    return result


def _type_plain_destination(dest: Any, types: TypeMap) -> None:
    """A plain buffer of zeros written in place is typed before the write: the op runs on a typed destination."""
    if isinstance(dest, torch.Tensor) and getattr(dest, "_spmd_types", None) is None:
        dest.__class__ = _typed_class_for(dest)
        dest._spmd_types = types


def _check_destination(entry: OpEntry, dest: Any, result: TypeMap) -> None:
    if not isinstance(dest, torch.Tensor):
        return  # a list destination (foreach kernels) or a scalar
    dest_types = getattr(dest, "_spmd_types", None)
    what = "its first operand" if entry.inplace else "its out= tensor"
    if dest_types is None:
        raise SpmdTypeError(
            Rejection(
                f"{entry.display} writes a typed result into a plain (untyped) tensor, which would "
                "lose the type.",
                [("op", entry.display), ("destination", f"{what}: plain tensor"), ("result", result.format())],
                [f"spmd.assert_type(destination, {result.code()})"],
            ),
            user_source_line(),
        )
    becomes_varying = []
    for axis, t in result.items:
        have = dest_types.get(axis)
        if have is None or have is t or (have.is_varying and t.is_varying):
            continue
        if t.is_varying and (have is R or have is I) and _sole_and_gradient_free(dest):
            becomes_varying.append(axis)  # same data everywhere, now per-rank data: what V means
            continue
        raise SpmdTypeError(
            Rejection(
                f"An in-place op cannot change its tensor's type: {entry.display} would change "
                f"{what} from {have} to {t} on axis '{axis}'.",
                [("op", entry.display), ("destination", dest_types.format()), ("result", result.format()),
                 ("axis", f"'{axis}': {have} -> {t}")],
                ["the out-of-place form, assigning the result (e.g. `x = x + y` for `x += y`)"],
            ),
            user_source_line(),
        )
    if becomes_varying:
        STATE.uncacheable = True  # depends on the tensor's gradient and aliases, not only on types
        for axis in becomes_varying:
            dest_types = dest_types.replace(axis, V)
        dest._spmd_types = dest_types


def _sole_and_gradient_free(dest: torch.Tensor) -> bool:
    """No gradient to type and no other tensor on its storage: an R or I tensor may become V in place.

    Written in place with per-rank values, it holds different data on each rank; with no gradient
    there is no backward to get wrong, and with no alias no other tensor still claims R.
    """
    with _DisableTF():
        if dest.requires_grad:
            return False
        return not storage_shared(dest)


def _backward_from_typed_root(func, args, kwargs):
    """``loss.backward()`` / ``torch.autograd.backward`` from a typed root: marked for strict mode's check."""
    with typed_root():
        if func is _BACKWARD:
            return _typed_call(func, args, kwargs)
        return _run_swapped(func, args, kwargs) if _dispatch_depth() else _run(func, args, kwargs)


HANDLERS[_BACKWARD] = HANDLERS[torch.autograd.backward] = _backward_from_typed_root


def _check_backward_root(args, kwargs) -> None:
    root = args[0]
    types = getattr(root, "_spmd_types", None)
    gradient = args[1] if len(args) > 1 else kwargs.get("gradient")
    if types is None or gradient is not None:
        return
    for axis, t in types.items:
        if t is R:
            raise SpmdTypeError(
                Rejection(
                    "backward() from a Replicate (R) value seeds a gradient of 1 on every rank; "
                    "the gradient of R is a pending sum (P), so that seed means the mesh size, "
                    "not 1, and every gradient would be scaled by it.",
                    [("op", "Tensor.backward"), ("root", types.format()), ("axis", f"'{axis}': root is R")],
                    [f"spmd.convert(loss, '{axis}', src=spmd.R, dst=spmd.I)",
                     f"spmd.all_reduce(..., '{axis}', src=spmd.P, dst=spmd.I) where the loss is reduced"],
                ),
                user_source_line(),
            )


# ---------------------------------------------------------------------------
# giving a tensor its type


def make_typed(t: torch.Tensor, types: TypeMap) -> torch.Tensor:
    """An LTensor view of plain ``t`` with ``types`` (``t`` itself is left alone)."""
    t = settled(t)  # an AsyncCollectiveTensor (torchtitan's RowwiseParallel output) waited on first
    out = _run(torch.Tensor.view_as, (t, t), {})
    out.__class__ = _typed_class_for(out)
    out._spmd_types = types
    return out


def type_in_place(t: torch.Tensor, types: TypeMap) -> torch.Tensor:
    """Give ``t`` its types, same object (a leaf that requires grad also gets its gradient typed)."""
    if type(t) not in _TYPED_CLASSES:
        t.__class__ = _typed_class_for(t)
    t._spmd_types = types
    if t.requires_grad and t.is_leaf and not getattr(t, "_spmd_grad_hooked", False):
        t.register_post_accumulate_grad_hook(_type_grad)
        t.__dict__["_spmd_grad_hooked"] = True
    return t


def _type_grad(param: torch.Tensor) -> None:
    with _DisableTF():  # a typed parameter's .grad through __torch_function__ costs microseconds
        grad = param.grad
    types = getattr(param, "_spmd_types", None)
    if types is not None and STATE.strict:
        check_typed_root(param, types)  # strict mode: no backward from an untyped loss
    if grad is None or types is None:
        return
    back = types.backward()
    if getattr(grad, "_spmd_types", None) is back:
        return
    if type(grad) not in _TYPED_CLASSES:
        grad.__class__ = LTensor if type(grad) is torch.Tensor else _typed_class_for(grad)
    grad._spmd_types = back
    mark_grad(grad, param)
