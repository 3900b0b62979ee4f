"""Checking one graph that torch.compile traced: dynamo's graph run once, typed, on fake tensors.

Dynamo traces the erased program: every op on a typed tensor is recorded as the plain op, and every
spmd call as one node holding its arguments (``_core/traced.py``). :func:`check_graph` runs that graph
through :class:`TypedInterpreter`: each graph input becomes a fake tensor with the shape, dtype and types
of the real input, and each node calls its own target on those typed values with checking on. That is
the eager checker itself (the same ``__torch_function__``, rules table and messages); only the line an
error names comes from the node (the user's line dynamo recorded) instead of the Python stack.

The result is what the compiled program needs at run time and nothing else: the types of the graph's
outputs, and the inputs a node typed in place (``assert_type`` on a graph input).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .._checker.run_ops import _TYPED_CLASSES
from .._checker.tensor import _DisableTF, _wrap
from .._core.errors import SpmdTypeError, checking_at
from .._core.traced import CHECKED, REBINDS, decode_call, region_depth, unwind_regions
from .._torch.private import (
    EnableTorchFunction,
    FakeTensorMode,
    TracingContext,
    TreeSpec,
    compiling_flag,
    set_compiling_flag,
    tree_flatten,
    tree_unflatten,
)
from .sites import eager_method, user_site, user_stack

__all__ = ["Checked", "check_graph", "typed_twin", "types_of"]


class Checked(NamedTuple):
    """What checking one graph found, for the compiled program to carry out at run time."""

    inputs: tuple  # per graph input: its (types, spec) when checked, None for a plain tensor or a non-tensor
    outputs: tuple  # per graph output: the (types, spec) to give it, or None
    typed_inputs: tuple  # (index, types, spec) of inputs that a node typed in place
    seconds: float  # time spent checking


def types_of(t: Any) -> tuple | None:
    """``(types, spec)`` of a typed tensor, None for anything else."""
    types = getattr(t, "_spmd_types", None) if isinstance(t, torch.Tensor) else None
    return None if types is None else (types, getattr(t, "_spmd_spec", None))


def typed_twin(real: Any, mode: Any) -> Any:
    """A fake tensor (``mode``'s) with ``real``'s shape, strides, dtype, device, gradient flag, parameter-ness, types."""
    if not isinstance(real, torch.Tensor):
        return real
    with _DisableTF():
        shape, stride, dtype, device, grad = tuple(real.shape), real.stride(), real.dtype, real.device, \
            real.requires_grad
        is_param = isinstance(real, torch.nn.Parameter)
    with mode:
        twin = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if is_param:
        twin = torch.nn.Parameter(twin, requires_grad=grad)
    elif grad:
        twin.requires_grad_(True)
    found = types_of(real)
    if found is not None:
        twin = _wrap(twin, found[0])
        if found[1] is not None:
            twin._spmd_spec = found[1]
    return twin


def check_graph(gm: torch.fx.GraphModule, example_inputs: list, mode: Any = None) -> Checked:
    """Check ``gm`` (dynamo's graph) on typed twins of ``example_inputs`` (with checking on); raise as eager would.

    ``mode`` is dynamo's fake mode for this graph: a value the graph reads from a tensor (``.item()``,
    ``.tolist()``: MoE token counts) is then dynamo's own symbol, with what dynamo learnt about it.
    """
    start = time.process_time()
    if mode is None:
        mode = FakeTensorMode(shape_env=ShapeEnv())
    saved = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True  # a graph may close over real tensors (a mask's table)
    depth = region_depth()
    try:
        twins = [typed_twin(x, mode) for x in example_inputs]
        before = [types_of(t) for t in twins]
        # dynamo calls a compiled graph with subclass dispatch off: the checker needs it on; a symbol the checker
        # reads from data is its own (dynamo's shape env must not wait for it in the compiled graph)
        fresh = mode.shape_env.ignore_fresh_unbacked_symbols() if mode.shape_env is not None else nullcontext()
        with _not_compiling(), EnableTorchFunction(), fresh:
            outputs = TypedInterpreter(gm, mode).run(*twins)
    finally:
        mode.allow_non_fake_inputs = saved
        unwind_regions(depth)  # a region a graph break left open closes with its graph
    typed_inputs = tuple(
        (i, *types_of(t)) for i, t in enumerate(twins) if types_of(t) is not None and types_of(t) != before[i]
    )
    flat_out = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    return Checked(tuple(before), tuple(types_of(o) for o in flat_out), typed_inputs,
                   time.process_time() - start)


_ALIAS = torch.ops.aten.alias.default


def dynamo_fake_mode() -> Any:
    """The fake mode of the graph dynamo is compiling now, or None."""
    context = TracingContext.try_get()
    return None if context is None else context.fake_mode


def _fresh(value: Any, mode: Any) -> Any:
    """Dynamo's example value of a node, as a new fake tensor (the checker may retype it in place) or as it is."""
    if isinstance(value, torch.Tensor):
        with mode:
            out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        return out.requires_grad_(True) if value.requires_grad else out
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v, mode) for v in value)
    return value


class _not_compiling:
    """Checking runs eager code paths: torch.compiler.is_compiling() is False while it does."""

    def __enter__(self) -> None:
        self.saved = compiling_flag()
        set_compiling_flag(False)

    def __exit__(self, *exc: Any) -> None:
        set_compiling_flag(self.saved)


class TypedInterpreter(torch.fx.Interpreter):
    """Runs dynamo's graph on typed fake tensors with checking on, each node at its user's line."""

    def __init__(self, gm: torch.fx.GraphModule, mode: Any) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.mode = mode

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        try:
            if n.op.startswith("call") and "example_value" in n.meta and not self._typed_inputs(n):
                return _fresh(n.meta["example_value"], self.mode)  # no typed operand: nothing to check, as dynamo saw it
            with checking_at(*user_site(n)):
                return super().run_node(n)
        except SpmdTypeError as err:
            err.traced_stack = user_stack(n)  # the user's frames, outermost first, as the trace recorded them
            raise

    def _typed_inputs(self, n: torch.fx.Node) -> bool:
        """Whether node ``n`` takes a typed value, or is an spmd call (which checks plain values too)."""
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "flat_apply_capture":
            return True
        found = []
        torch.fx.node.map_arg((n.args, n.kwargs), lambda a: found.append(self.env.get(a)))
        return any(type(v) in _TYPED_CLASSES or (isinstance(v, (list, tuple)) and any(type(x) in _TYPED_CLASSES
                                                                                     for x in v)) for v in found)

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return typed_twin(super().get_attr(target, args, kwargs), self.mode)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if len(args) >= 2 and isinstance(args[1], TreeSpec):  # a nonstrict-traced call
            found = decode_call(tree_unflatten(list(args[2:]), args[1])[0])
            if found is not None:
                name, call_args, call_kwargs = found
                result = CHECKED[name](*call_args, **call_kwargs)
                if name not in REBINDS:
                    return tree_flatten(result)[0]
                self._rebind(args[2:], call_args[0], result)
                return [0]
        if target is _ALIAS and len(args) == 1 and type(args[0]) in _TYPED_CLASSES:
            return args[0]  # LTensor's plain alias of an operand in the trace: the typed value itself
        return target(*args, **kwargs)

    def _rebind(self, flat_args: tuple, old: Any, new: Any) -> None:
        """Later nodes see ``new`` (a region's typed outputs) where this node was given ``old``."""
        new_leaves = tree_flatten(new)[0]
        swap = {id(o): n for o, n in zip(tree_flatten(old)[0], new_leaves) if isinstance(o, torch.Tensor)}
        for arg_node, value in zip(self.node.args[2:], flat_args):
            if isinstance(arg_node, torch.fx.Node) and id(value) in swap:
                self.env[arg_node] = swap[id(value)]

    def call_method(self, target: str, args: tuple, kwargs: dict) -> Any:
        self_obj, *rest = args
        return getattr(self_obj, eager_method(self.node, target))(*rest, **kwargs)
