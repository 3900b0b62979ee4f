"""spmd calls inside torch.compile: one graph node each, which the compiled graph's checker reads back.

While dynamo traces, a call such as ``spmd.convert(x, "tp", src=I, dst=R)`` or ``spmd.assert_type(x, ...)``
becomes one call of a ``nonstrict_trace`` function: dynamo records one node holding the call's name and
arguments as constants and does not trace its body; AOTAutograd then traces the body, which is the erased
call (its autograd Function, the functional collectives of its forward and, through the Function, of its
backward). The checker (``spmd_types/_compile``) finds the node, decodes the arguments and runs the same
call, typed, on typed meta values: the eager code path, so the same rules and messages.

Arguments travel as graph constants: str, int, float, bool, None, dtypes, and tuples, lists and dicts of
them. A type becomes a tagged tuple (``(TYPE_TAG, "S(0)")``), a partition spec and a process group too
(the group by name); anything else refuses with a clear error at trace time.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .state import STATE
from .types import PartitionSpec, Shard, SpmdType, _by_short_name

__all__ = [
    "routed", "traced_call", "register_call", "decode_call", "NODE_TAG", "CHECKED", "compiling", "dynamo_tracing",
    "typed_tensor_traced", "TRACE_HOOKS",
]

compiling = torch.compiler.is_compiling  # dynamo traces, or a backend compiles (AOT, inductor)
dynamo_tracing = torch.compiler.is_dynamo_compiling  # True only in code dynamo itself traces

# The compile room's hook, called with no arguments when a trace meets a typed tensor or an spmd call.
TRACE_HOOKS: list = []


def typed_tensor_traced() -> None:
    """A typed tensor (or an spmd call) met while torch.compile traces or compiles, outside dynamo's own trace."""
    for hook in TRACE_HOOKS:
        hook()

NODE_TAG = "spmd_types.call"
TYPE_TAG = "spmd_types.type"
SPEC_TAG = "spmd_types.partition_spec"
GROUP_TAG = "spmd_types.group"
NONE = ("spmd_types.none",)  # None is no graph constant

# name -> what the call runs in the compiled program (the erased call, on plain tensors)
BODIES: dict[str, Callable[..., Any]] = {}
# name -> the call the checker runs on typed values (the public function)
CHECKED: dict[str, Callable[..., Any]] = {}


def register_call(name: str, checked: Callable[..., Any], body: Callable[..., Any] | None = None) -> None:
    """Spmd call ``name``: ``checked`` is the public function; ``body`` what its graph node runs (default: it).

    The body returns a tensor, or a number when the call's result is the input itself (``assert_type``):
    a graph node returns no input as its output.
    """
    CHECKED[name] = checked
    BODIES[name] = checked if body is None else body


class _Inside(threading.local):
    on = False  # running a node's body: the spmd calls it makes run as in eager


_INSIDE = _Inside()


def routed() -> bool:
    """Whether an spmd call is traced by torch.compile and so becomes one graph node."""
    return compiling() and not _INSIDE.on


def traced_call(name: str, *args: Any, **kwargs: Any) -> Any:
    """The graph node of spmd call ``name(*args, **kwargs)`` (code dynamo traces)."""
    _make_node()
    return _NODE[0](NODE_TAG, name, encode(args), encode(kwargs))


_NODE: list = []


def _make_node() -> None:
    """Build the nonstrict-traced node function on first use; note that this graph holds spmd calls.

    Dynamo runs it for real (``_dynamo_marked_constant``, as ``torch._dynamo.assume_constant_result``
    marks a function), so torch._dynamo is imported only once a compile is under way.
    """
    typed_tensor_traced()
    if not _NODE:
        from torch._dynamo import nonstrict_trace

        _NODE.append(nonstrict_trace(_run_node))


_make_node._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _run_node(tag: str, name: str, args: Any, kwargs: Any) -> Any:
    """The node's body: the erased call (at dynamo's trace on fake tensors, in AOTAutograd, or at run time)."""
    saved = STATE.checking, _INSIDE.on
    STATE.checking, _INSIDE.on = False, True
    try:
        return BODIES[name](*decode(args), **decode(kwargs))
    finally:
        STATE.checking, _INSIDE.on = saved


def decode_call(flat: tuple) -> tuple[str, tuple, dict] | None:
    """``(name, args, kwargs)`` from a node's unflattened positional arguments, or None if not an spmd call."""
    if len(flat) != 4 or flat[0] != NODE_TAG:
        return None
    _, name, args, kwargs = flat
    return name, decode(args), decode(kwargs)


def encode(value: Any) -> Any:
    """``value`` as graph constants (see the module docstring)."""
    if isinstance(value, SpmdType):
        return (TYPE_TAG, value._short)
    if isinstance(value, PartitionSpec):
        return (SPEC_TAG, encode(tuple(value)))
    if isinstance(value, (tuple, list)):
        return type(value)(encode(v) for v in value)
    if isinstance(value, dict):
        return {encode(k): encode(v) for k, v in value.items()}
    if value is None:
        return NONE
    if isinstance(value, (torch.Tensor, str, int, float, bool, torch.dtype)):
        return value
    if isinstance(value, torch.distributed.ProcessGroup):
        return (GROUP_TAG, value.group_name)
    raise NotImplementedError(
        f"an spmd call inside torch.compile takes arguments that can be graph constants (str, int, types, "
        f"process groups, tuples and dicts of them); got {type(value).__name__}"
    )


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if type(value) is tuple and len(value) == 1 and type(value[0]) is str and value[0] == NONE[0]:
        return None
    if type(value) is tuple and len(value) == 2 and isinstance(value[0], str):
        if value[0] == TYPE_TAG:
            short = value[1]
            return Shard(int(short[2:-1])) if short.startswith("S(") else _by_short_name(short)
        if value[0] == SPEC_TAG:
            return PartitionSpec(*decode(value[1]))
        if value[0] == GROUP_TAG:
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(value[1])
    if isinstance(value, (tuple, list)):
        return type(value)(decode(v) for v in value)
    if isinstance(value, dict):
        return {decode(k): decode(v) for k, v in value.items()}
    return value
