"""Registering existing ``torch.autograd.Function`` classes with their SPMD types.

A registration is a claim about what the Function does, forward and
backward, in terms the checker knows:

* ``local=True``: no communication either way; the output types follow the
  standard rule for a non-linear op (R with R is R, V with R or V is V, I only
  with I, no P).
* ``op=..., axis=..., src=..., dst=...``: it behaves like ``spmd.<op>(x, axis,
  src=, dst=)`` on its first tensor argument (Megatron's copy-to region is
  ``reinterpret(x, 'tp', src=I, dst=R)``: identity forward, all-reduce backward).
* ``rule=...``: ``rule(*arg_types)`` gives the output types.
* ``transparent=True``: its forward is checked op by op, like ordinary code,
  and its output types are what those ops give. Only sound when the backward
  is the true derivative of the forward (activation checkpointing).

Typed inputs are checked against the claim before the Function runs; the
Function itself then runs with subclass dispatch off (its typed inputs, and
what it saved of them, seen as the plain tensors they are), so its forward and
its hand-written backward do exactly what they did before. Registration sets
``apply`` on the registered class only (never on ``torch.autograd.Function``);
with checking off the wrapper calls the original ``apply`` straight away.
:func:`spmd_types.testing.verify_registration` checks a claim on simulated ranks.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, NamedTuple

import torch

from .._checker.reading import present
from .._checker.run_ops import _TYPED_CLASSES
from .._checker.tensor import _wrap
from .._comm.call import begin, type_result, unwrap
from .._core.errors import Rejection, SpmdTypeError, op_error, user_source_line
from .._core.mesh import current_mesh
from .._core.state import STATE
from .._core.types import SpmdType, TypeMap, check_type_value
from .._guards.function_guard import ALLOWED, torch_transparent
from .._local.op_registry import OpEntry
from .._local.rules import infer
from .._local.rules_table import Row, RuleKind
from .._torch.private import DisableTorchFunctionSubclass, is_torch_function_enabled
from .compiled_functions import breaks_a_checked_trace, dynamo_disabled
from .decomposition import decomposed_apply
from .plain_run import UNTYPED_LEAVES, original_apply, plain, plain_gradients, plain_kw, run_plain

__all__ = ["register_autograd_function", "registration_of", "Registration", "unregister_autograd_function",
           "run_eagerly_under_compile",
           "register_local_autograd_function", "register_decomposition", "pure_rule", "rule_reads"]

_OPS = ("reinterpret", "convert", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_DisableTF = DisableTorchFunctionSubclass
_tf_enabled = is_torch_function_enabled
# how the kinds registered by higher rooms apply: "spmd_typecheck" (the published hook, hook_registration.py
# fills it with hook_apply's runner when the package is imported)
KIND_APPLY: dict[str, Callable[..., Any]] = {}


class Registration(NamedTuple):
    """What a registered Function claims to do."""

    kind: str  # "local", "op", "rule", "transparent", "typecheck_forward", "spmd_typecheck" or "decomposition"
    op: str | None = None
    axis: Any = None
    src: SpmdType | None = None
    dst: SpmdType | None = None
    reduce: str = "sum"
    rule: Callable[..., Any] | None = None
    original_apply: Any = None  # the class's own ``apply`` before registration, if it defined one
    original_backward: Any = None  # the class's own ``backward``, wrapped to receive plain gradients
    original_forward: Any = None  # the class's own ``forward``, wrapped to run eagerly under a checked compile
    rule_shapes: bool = False  # the rule takes ``shapes=`` (each argument's shape, None for a non-tensor)
    pure: bool = False  # the rule is marked pure_rule: its answers are remembered
    reads: Any = None  # what the rule reads of its arguments (rule_reads), or None: all of them


_REGISTRY: dict[type, Registration] = {}
_LOCK = threading.Lock()


def register_autograd_function(
    cls: type | None = None,
    *,
    local: bool = False,
    op: str | None = None,
    axis: Any = None,
    src: SpmdType | None = None,
    dst: SpmdType | None = None,
    reduce: str = "sum",
    rule: Callable[..., Any] | None = None,
    transparent: bool = False,
) -> Any:
    """Tell the checker what a custom ``torch.autograd.Function`` does, so it may run on typed tensors.

    Exactly one of ``local=True``, ``op=`` (with ``axis``, ``src``, ``dst``),
    ``rule=`` or ``transparent=True``. ``axis`` is a mesh axis name, a
    ``ProcessGroup``, or a callable ``(args, kwargs) -> axis`` (for Functions
    that take their group as an argument). ``rule(*arg_types)`` receives, per
    positional argument, the tensor's ``TypeMap`` (``None`` if it is a plain
    tensor) or the argument itself when it is not a tensor, and returns the
    output's types (a dict ``{axis: type}``), or a tuple of them for several
    outputs; a rule with a ``shapes`` parameter also gets ``shapes=``, each
    argument's shape (None for a non-tensor), to check sizes (split sizes
    against rows) before anything runs. Registering again replaces the claim.
    Usable as a class decorator.

    Example::

        spmd.register_autograd_function(
            _CopyToModelParallelRegion, op="reinterpret", axis=lambda args, kwargs: args[1],
            src=spmd.I, dst=spmd.R,
        )

        @spmd.register_autograd_function(local=True)
        class FusedGelu(torch.autograd.Function):
            ...
    """
    if (cls is not None and not (local or transparent) and op is None and rule is None
            and callable(getattr(cls, "spmd_typecheck", None))):
        reg = Registration("spmd_typecheck")  # the published API's hook (0.2.4 on): the class types itself
    elif (cls is not None and not (local or transparent) and op is None and rule is None
            and callable(getattr(cls, "typecheck_forward", None))):
        reg = Registration("typecheck_forward")  # the published API: the class types itself
    else:
        reg = _registration(local, op, axis, src, dst, reduce, rule, transparent, cls)
    if cls is None:
        return lambda c: register_autograd_function(
            c, local=local, op=op, axis=axis, src=src, dst=dst, reduce=reduce, rule=rule, transparent=transparent
        )
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"register_autograd_function takes a torch.autograd.Function subclass, got {cls!r}")
    _install(cls, reg)
    return cls


def _install(cls: type, reg: Registration) -> None:
    with _LOCK:
        previous = _REGISTRY.get(cls)
        own = cls.__dict__.get("apply")
        if previous is not None:
            original, backward = previous.original_apply, previous.original_backward
            forward = previous.original_forward
        else:
            original = own.__func__ if isinstance(own, classmethod) else None
            cls.apply = classmethod(dynamo_disabled(_typed_apply))  # type: ignore[method-assign]
            backward, forward = cls.__dict__.get("backward"), cls.__dict__.get("forward")
            if backward is not None:
                cls.backward = staticmethod(plain_gradients(backward))  # type: ignore[attr-defined]
            if forward is not None:
                cls.forward = staticmethod(breaks_a_checked_trace(forward))  # type: ignore[attr-defined]
        _REGISTRY[cls] = reg._replace(original_apply=original, original_backward=backward, original_forward=forward)
        ALLOWED[cls] = reg.kind


def run_eagerly_under_compile() -> None:
    """Make every registered class's ``apply`` one that torch.compile runs eagerly (called when a compile starts)."""
    apply = dynamo_disabled(_typed_apply)
    with _LOCK:
        for cls in _REGISTRY:
            if cls.__dict__.get("apply").__func__ is not apply:
                cls.apply = classmethod(apply)  # type: ignore[method-assign]


def unregister_autograd_function(cls: type) -> None:
    """Undo :func:`register_autograd_function` (the class gets its own ``apply`` back)."""
    with _LOCK:
        reg = _REGISTRY.pop(cls, None)
        ALLOWED.pop(cls, None)
        if reg is None:
            return
        if reg.original_apply is not None:
            cls.apply = classmethod(reg.original_apply)  # type: ignore[method-assign]
        else:
            del cls.apply
        if reg.original_backward is not None:
            cls.backward = reg.original_backward  # type: ignore[attr-defined]
        if reg.original_forward is not None:
            cls.forward = reg.original_forward  # type: ignore[attr-defined]


def registration_of(cls: type) -> Registration | None:
    """The claim registered for ``cls``, or None."""
    return _REGISTRY.get(cls)


def _registration(local, op, axis, src, dst, reduce, rule, transparent, cls=None) -> Registration:
    given = [name for name, on in (("local", local), ("op", op is not None), ("rule", rule is not None),
                                   ("transparent", transparent)) if on]
    if len(given) != 1:
        own = (f"; or give {cls.__name__} a typecheck_forward staticmethod"
               if isinstance(cls, type) and not given else "")
        raise TypeError(
            "register_autograd_function takes exactly one of local=True, op=... (with axis, src, dst), rule=... "
            f"or transparent=True; got {', '.join(given) or 'none'}{own}"
        )
    kind = given[0]
    if kind != "op":
        extra = [n for n, v in (("axis", axis), ("src", src), ("dst", dst)) if v is not None]
        if extra:
            raise TypeError(f"register_autograd_function: {', '.join(extra)} go with op=..., not with {kind}")
        if kind == "rule" and not callable(rule):
            raise TypeError(f"register_autograd_function: rule must be callable, got {rule!r}")
        return Registration(kind, rule=rule, rule_shapes=kind == "rule" and _takes_shapes(rule),
                            pure=getattr(rule, "__spmd_pure_rule__", False),
                            reads=getattr(rule, "__spmd_rule_reads__", None))
    if op not in _OPS:
        raise ValueError(f"register_autograd_function: op must be one of {', '.join(_OPS)}; got {op!r}")
    if axis is None:
        raise TypeError("register_autograd_function: op=... needs axis= (a mesh axis name, a ProcessGroup, or a "
                        "callable (args, kwargs) -> axis)")
    src = check_type_value(src, "register_autograd_function: src")
    dst = check_type_value(dst, "register_autograd_function: dst")
    from .._local.transitions import allowed, find

    table_src = src
    if op in ("all_reduce", "reduce_scatter") and src.is_varying:
        from .._core.types import P

        table_src = P
    if find(op, table_src, dst) is None:
        shown = ", ".join(f"{s} -> {d}" for s, d in allowed(op))
        raise ValueError(f"register_autograd_function: spmd.{op} has no src={src} -> dst={dst} (allowed: {shown})")
    return Registration("op", op=op, axis=axis, src=src, dst=dst, reduce=reduce)


# ---------------------------------------------------------------------------
# applying a registered Function


def _typed_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    reg = _REGISTRY.get(cls)
    if reg is None or not STATE.checking or reg.kind == "transparent" or not _tf_enabled():
        # (subclass dispatch off: called from a registered Function's forward or backward, which run as written)
        # A subclass of a registered class is not registered: its forward meets the guard.
        return original_apply(cls, reg.original_apply if reg is not None else None, args, kwargs)
    if reg.kind == "rule" and not kwargs:  # the common case (Megatron's Functions): one pass reads the arguments
        own, typed = _own_types(args)
        if not typed:
            return original_apply(cls, reg.original_apply, args, kwargs)
        out_types = _rule_types(cls, reg, args, own)
        _refuse_global(cls)
        return _type_outputs(cls, run_plain(cls, reg.original_apply, args, kwargs), out_types)
    if not _any_typed(args, kwargs):
        return original_apply(cls, reg.original_apply, args, kwargs)
    if reg.kind == "op":
        return _apply_as_op(cls, reg, args, kwargs)
    if reg.kind == "typecheck_forward":
        return _apply_typecheck_forward(cls, reg, args, kwargs)
    if reg.kind == "spmd_typecheck":  # the published hook: the real apply on plain aliases, then the hook types it
        return KIND_APPLY["spmd_typecheck"](cls, lambda: original_apply(cls, reg.original_apply, plain(args), {}),
                                            args, kwargs)
    if reg.kind == "decomposition":
        return decomposed_apply(cls, reg.rule, lambda a, k: original_apply(cls, reg.original_apply, plain(a),
                                                                           plain_kw(k)),
                                args, kwargs)
    if reg.kind == "rule":
        out_types = _rule_types(cls, reg, args)
    else:
        out_types = _local_types(cls, args, kwargs)
    _refuse_global(cls)
    return _type_outputs(cls, run_plain(cls, reg.original_apply, args, kwargs), out_types)


class _Inside(threading.local):
    classes: tuple = ()


_INSIDE = _Inside()


def _apply_typecheck_forward(cls: type, reg: Registration, args: tuple, kwargs: dict) -> Any:
    """The class types itself: ``typecheck_forward`` asserts its inputs, calls ``apply``, asserts its outputs.

    Its own ``apply`` call runs the Function on plain aliases of the inputs, so
    the outputs come back untyped and ``typecheck_forward``'s asserts type them.
    """
    if cls in _INSIDE.classes:
        return original_apply(cls, reg.original_apply, plain(args), plain_kw(kwargs))
    _INSIDE.classes = _INSIDE.classes + (cls,)
    try:
        return cls.typecheck_forward(*args, **kwargs)
    finally:
        _INSIDE.classes = _INSIDE.classes[:-1]


def register_local_autograd_function(cls: type) -> type:
    """Register a Function that does no communication: the standard rule types it (``local=True``).

    The published API's name for ``register_autograd_function(cls, local=True)``; usable as a decorator.
    torch 2.14 calls it on FSDP2's ``RegisterPostBackwardFunction``; a torch Function this package already
    checks op by op (an identity that runs hooks, ``_guards/function_guard.py``) stays checked that way, which
    also types it in global SPMD.

    Example::

        @spmd.register_local_autograd_function
        class FusedSwiGLU(torch.autograd.Function):
            ...
    """
    if isinstance(cls, type) and torch_transparent(cls):
        return register_autograd_function(cls, transparent=True)
    return register_autograd_function(cls, local=True)


def register_decomposition(cls: type, ref_impl: Callable[..., Any] | None = None) -> Any:
    """Type a fused-kernel Function by a plain-torch reference implementation of it.

    Under checking, ``ref_impl`` runs on meta copies of the arguments (typed
    like them, so every op in it is checked and typed), the Function runs for
    real on plain aliases, and its outputs get the reference's output types.
    Sound when the Function's backward is the true derivative of ``ref_impl``
    and it communicates nothing itself. Returns ``ref_impl``; with one argument,
    a decorator for it.

    Example::

        @spmd.register_decomposition(FusedRoPE)
        def rope_reference(x, cos, sin):
            return x * cos + rotate_half(x) * sin
    """
    if ref_impl is None:
        return lambda f: register_decomposition(cls, f)
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"register_decomposition takes a torch.autograd.Function subclass, got {cls!r}")
    if not callable(ref_impl):
        raise TypeError(f"register_decomposition: the reference implementation must be callable, got {ref_impl!r}")
    _install(cls, Registration("decomposition", rule=ref_impl))
    return ref_impl


def _any_typed(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    for a in args:
        if _typed(a):
            return True
    for v in kwargs.values():
        if _typed(v):
            return True
    return False


def _typed(a: Any) -> bool:
    tp = type(a)
    if tp in _TYPED_CLASSES:
        return True
    if tp in UNTYPED_LEAVES:  # the arguments a Function mostly gets: answered without a lookup
        return False
    if isinstance(a, torch.Tensor):
        return getattr(a, "_spmd_types", None) is not None
    if tp is list or tp is tuple:
        for x in a:
            if _typed(x):
                return True
    return False


def _apply_as_op(cls: type, reg: Registration, args: tuple, kwargs: dict) -> Any:
    index = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
    if index is None:
        raise TypeError(f"{cls.__qualname__} is registered as spmd.{reg.op} on its first tensor argument, "
                        "but it got no tensor argument")
    others = [i for i, a in enumerate(args) if i != index and _typed(a)] + [k for k, v in kwargs.items() if _typed(v)]
    if others:
        raise SpmdTypeError(
            Rejection(
                f"{cls.__qualname__} is registered as spmd.{reg.op} on its first tensor argument, but another "
                "argument is typed too, and the registration does not say what happens to it.",
                [("function", cls.__qualname__), ("typed arguments", ", ".join(str(o) for o in [index] + others))],
                [f"spmd.register_autograd_function({cls.__qualname__}, rule=...)"],
            ),
            user_source_line(),
        )
    axis = reg.axis(args, kwargs) if _is_axis_callable(reg.axis) else reg.axis
    x = args[index]
    begun = begin(reg.op, x, axis, reg.src, reg.dst, reg.reduce)
    plain_args = args[:index] + (unwrap(x),) + args[index + 1:]
    out = original_apply(cls, reg.original_apply, plain_args, kwargs)
    if isinstance(out, torch.Tensor):
        return type_result(begun, x, out)
    if isinstance(out, (tuple, list)):
        return type(out)(type_result(begun, x, o) if isinstance(o, torch.Tensor) else o for o in out)
    return out


def _is_axis_callable(axis: Any) -> bool:
    import torch.distributed as dist

    return callable(axis) and not isinstance(axis, (str, dist.ProcessGroup))


def _arg_types(cls: type, args: tuple) -> list[Any]:
    """Per argument: a tensor's types presented on the current mesh (None if plain), else the argument itself."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(present(a, cls.__qualname__)[0] if getattr(a, "_spmd_types", None) is not None else None)
        else:
            out.append(a)
    return out


def _own_types(args: tuple) -> tuple[tuple, bool]:
    """Per argument: a tensor's own types (None if plain), a list's items (split sizes), else the argument;
    and whether any argument is typed (:func:`_any_typed`'s answer)."""
    out = []
    typed = False
    for a in args:
        tp = type(a)
        if tp in _TYPED_CLASSES:
            out.append(a._spmd_types)
            typed = True
        elif tp in _SCALARS:  # flags, sizes, None: most of a Megatron Function's arguments
            out.append(a)
        elif isinstance(a, torch.Tensor):
            found = getattr(a, "_spmd_types", None)
            out.append(found)
            typed = typed or (found is not None and tp not in UNTYPED_LEAVES)
        elif tp is list and all(type(x) is int for x in a):
            out.append((_LIST, tuple(a)))  # split sizes: by value, told apart from a tuple
        else:
            out.append(a)
            typed = typed or ((tp is list or tp is tuple) and _typed(a))
    return tuple(out), typed


_LIST = object()
_SCALARS = frozenset({type(None), bool, int, float, str, torch.dtype})


def _takes_shapes(rule: Callable[..., Any]) -> bool:
    import inspect

    try:
        return "shapes" in inspect.signature(rule).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


def pure_rule(rule: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``rule`` a function of its arguments and the current mesh only: its accepted results are then
    remembered per argument types (a user's rule may read anything, so it is asked every time). A call that
    reads more (global state) sets ``STATE.uncacheable`` and is not remembered. Mark before registering: the
    registration reads the mark."""
    rule.__spmd_pure_rule__ = True  # type: ignore[attr-defined]
    return rule


def rule_reads(summary: Callable[[tuple, tuple], Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark what a :func:`pure_rule` reads of its arguments: ``summary(own, args)`` (``own``: each argument's own
    types, or the argument) is hashable and stands for all of it, so calls that differ only in what the rule
    does not read share one remembered answer (an all-to-all's split sizes change with every step's routing;
    its rule reads their count and total). The summary must cover everything the rule reads but the shapes
    and the current mesh, which the key holds anyway."""
    def mark(rule: Callable[..., Any]) -> Callable[..., Any]:
        rule.__spmd_rule_reads__ = summary  # type: ignore[attr-defined]
        return rule

    return mark


# (class, rule, argument types and values, mesh token) -> output types, for rules marked pure_rule
_RULE_RESULTS: dict[tuple, Any] = {}


def _rule_types(cls: type, reg: Registration, args: tuple, own: tuple | None = None) -> Any:
    assert reg.rule is not None
    shapes = None
    if reg.rule_shapes:
        with _DisableTF():  # a typed tensor's .shape through __torch_function__ costs microseconds
            shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
    key = None
    if reg.pure:
        mesh = current_mesh()
        # Keyed by the arguments' own types: the types the rule reads (presented on the current mesh) are a
        # function of them and of the mesh, which its token stands for; presenting them waits for a miss.
        own = _own_types(args)[0] if own is None else own
        key = (cls, reg.rule, own if reg.reads is None else reg.reads(own, args), shapes,
               None if mesh is None else mesh.token)
        try:
            found = _RULE_RESULTS.get(key, _NOT_FOUND)
        except TypeError:  # an unhashable argument (a list of split sizes): asked every time
            found = key = None
        if found is not _NOT_FOUND and key is not None:
            return found
    arg_types = _arg_types(cls, args)
    STATE.uncacheable = False
    result = reg.rule(*arg_types, shapes=shapes) if reg.rule_shapes else reg.rule(*arg_types)
    if isinstance(result, Rejection):
        raise SpmdTypeError(result, user_source_line())
    if isinstance(result, (tuple, list)):
        out = tuple(_as_types(cls, r) for r in result)
    else:
        out = _as_types(cls, result)
    if key is not None and not STATE.uncacheable:  # a pure rule that read global state this time says so
        if len(_RULE_RESULTS) >= 4096:
            _RULE_RESULTS.clear()
        _RULE_RESULTS[key] = out
    return out


_NOT_FOUND = object()


def _as_types(cls: type, value: Any) -> TypeMap | None:
    if value is None or isinstance(value, TypeMap):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"the rule registered for {cls.__qualname__} must return {{axis: type}} dicts, got {value!r}")
    mesh = current_mesh()
    space = None
    if mesh is not None:
        missing = [a for a in mesh.typed_axes if a not in value]
        if missing:
            raise ValueError(f"the rule registered for {cls.__qualname__} gave no type for axis "
                             f"{', '.join(repr(a) for a in missing)}")
        value = {a: t for a, t in value.items() if a in mesh.typed_axes}  # axes of size 1 carry no type
        space = mesh.space
    return TypeMap.of({a: check_type_value(t, f"the rule for {cls.__qualname__}: axis {a!r}")
                       for a, t in value.items()}, space)


def _local_types(cls: type, args: tuple, kwargs: dict) -> TypeMap | None:
    row = Row((), RuleKind.NONLINEAR, f"{cls.__qualname__} is registered local=True: the standard rule")
    entry = OpEntry(cls.apply, f"{cls.__name__}.apply", row, False)
    result = infer(entry, args, kwargs, STATE.strict)
    if isinstance(result, Rejection):
        raise op_error(result, "apply", ())
    return result


def _refuse_global(cls: type) -> None:
    if not STATE.global_mode:
        return
    mesh = current_mesh()
    global_axes = mesh.global_axes(STATE.local_axes) if mesh is not None else frozenset()
    if global_axes:
        raise NotImplementedError(
            f"{cls.__qualname__} (registered with local=True or rule=) has no partition-spec rule for global SPMD "
            f"on axes {sorted(global_axes)}: call it inside spmd.local_map, or typecheck those axes locally"
        )


def _type_outputs(cls: type, out: Any, out_types: Any) -> Any:
    if isinstance(out, torch.Tensor):
        if isinstance(out_types, tuple):
            raise TypeError(f"the rule for {cls.__qualname__} gave {len(out_types)} types for one output")
        return _wrap(out, out_types) if out_types is not None else out
    if isinstance(out, (tuple, list)):
        tensors = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor)]
        per = out_types if isinstance(out_types, tuple) else tuple(out_types for _ in tensors)
        if len(per) != len(tensors):
            raise TypeError(f"the rule for {cls.__qualname__} gave {len(per)} types for {len(tensors)} outputs")
        typed = dict(zip(tensors, per))
        return type(out)(_wrap(o, typed[i]) if typed.get(i) is not None else o for i, o in enumerate(out))
    return out
