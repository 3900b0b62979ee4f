"""spmd calls inside torch.compile: one graph node each, which the compiled graph's checker reads back.

While dynamo traces, a call such as ``spmd.convert(x, "tp", src=I, dst=R)`` or ``spmd.assert_type(x, ...)``
becomes one call of a ``nonstrict_trace`` function: dynamo records one node holding the call's name and
arguments as constants and does not trace its body; AOTAutograd then traces the body, which is the erased
call (its autograd Function, the functional collectives of its forward and, through the Function, of its
backward). The checker (``spmd_types/_compile``) finds the node, decodes the arguments and runs the same
call, typed, on typed fake values: the eager code path, so the same rules and messages.

Arguments travel as graph constants (``traced_args.py``). Regions (``local_map``, ``spmd.local()``,
``no_typecheck``) become an enter node and an exit node; the checker keeps their state between the two
(:func:`push_region`, :func:`pop_region`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .._torch.private import dynamo
from .state import STATE
from .traced_args import decode, encode

__all__ = [
    "routed", "traced_call", "register_call", "decode_call", "NODE_TAG", "CHECKED", "REBINDS", "compiling",
    "dynamo_tracing", "typed_tensor_traced", "TRACE_HOOKS", "push_region", "pop_region", "unwind_regions",
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

# name -> what the call runs in the compiled program (the erased call, on plain tensors)
BODIES: dict[str, Callable[..., Any]] = {}
# name -> the call the checker runs on typed values (the public function)
CHECKED: dict[str, Callable[..., Any]] = {}
# the calls whose checked result replaces their first argument's tensors for the rest of the graph
REBINDS: set[str] = set()


def register_call(name: str, checked: Callable[..., Any], body: Callable[..., Any] | None = None, *,
                  rebinds: bool = False) -> None:
    """Spmd call ``name``: ``checked`` is the public function; ``body`` what its graph node runs (default: it).

    The body returns a tensor, or a number when the call's result is the input itself (``assert_type``):
    a graph node returns no input as its output. ``rebinds``: the checked call returns its first argument
    typed (a region's declared outputs), and later nodes see those typed values.
    """
    CHECKED[name] = checked
    BODIES[name] = checked if body is None else body
    if rebinds:
        REBINDS.add(name)


def zero(*args: Any, **kwargs: Any) -> int:
    """The body of a node that only the checker acts on (a region's edge, an assertion)."""
    return 0


# The checker's open regions, innermost last: context managers entered at a region's enter node.
_REGIONS: list = []


def push_region(cm: Any) -> None:
    cm.__enter__()
    _REGIONS.append(cm)


def pop_region() -> None:
    _REGIONS.pop().__exit__(None, None, None)


def unwind_regions(depth: int) -> None:
    """Close the regions opened past ``depth`` (a graph that ended, or failed, inside one)."""
    while len(_REGIONS) > depth:
        pop_region()


def region_depth() -> int:
    return len(_REGIONS)


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
        _NODE.append(dynamo().nonstrict_trace(_run_node))


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
