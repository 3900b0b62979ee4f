"""A typed tensor's metadata (shape, dtype, requires_grad, size(), ...) read without subclass dispatch.

torch reads every attribute of a tensor subclass that has ``__torch_function__`` through it: it
builds the call, and the class answers; about 4 us a read on the CI machine, where a plain tensor
answers in 0.1 to 0.5. These reads compute nothing and carry no type (the rules table's metadata
rows leave them unchecked), and a training step makes hundreds of them (Megatron's layers read
``requires_grad``, ``dtype`` and ``size()`` of every activation). So LTensor answers them itself,
with subclass dispatch off, in about 0.8 us.

They still go through ``__torch_function__`` when that has more to do: while torch.compile traces
or compiles (a typed tensor read there tells the compile room that a graph holds typed values),
and under a dispatch mode (the rank simulator: a typed tensor is then also the mode's subclass).
Setting and deleting go through it always (``t.grad = g`` is rare and its row says what it does).

Example::

    t = spmd.assert_type(torch.randn(4, 16), {"tp": spmd.R})   # inside typecheck()
    t.shape, t.dtype, t.size(0)   # answered by these properties, no __torch_function__ call
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch.private import DisableTorchFunctionSubclass, len_torch_dispatch_stack

__all__ = ["FAST_ATTRIBUTES", "install_metadata_reads"]

# the attributes read most in a training step (Megatron-core and torchtitan models counted); every one is a
# row of the rules table's metadata kind
FAST_ATTRIBUTES = ("requires_grad", "dtype", "shape", "is_leaf", "device", "grad", "ndim", "is_cuda")

_DisableTF = DisableTorchFunctionSubclass
_dispatch_depth = len_torch_dispatch_stack
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_COMPILER = torch.compiler
_SIZE = torch.Tensor.size


def _fast_property(name: str) -> property:
    base = getattr(torch.Tensor, name)  # torch's own descriptor (Tensor inherits it from C)
    get = base.__get__

    def fget(self: torch.Tensor) -> Any:
        if _dispatch_depth() or _dynamo_tracing() or _COMPILER._is_compiling_flag:
            return get(self)
        with _DisableTF():
            return get(self)

    def fset(self: torch.Tensor, value: Any) -> None:
        base.__set__(self, value)

    def fdel(self: torch.Tensor) -> None:
        base.__delete__(self)

    return property(fget, fset, fdel, doc=f"``Tensor.{name}``, read without subclass dispatch")


def _size(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.size``, read without subclass dispatch."""
    if _dispatch_depth() or _dynamo_tracing() or _COMPILER._is_compiling_flag:
        return _SIZE(self, *args, **kwargs)
    with _DisableTF():
        return _SIZE(self, *args, **kwargs)


def install_metadata_reads(cls: type) -> None:
    """Give ``cls`` (LTensor) the fast reads of :data:`FAST_ATTRIBUTES` and ``size()``."""
    for name in FAST_ATTRIBUTES:
        setattr(cls, name, _fast_property(name))
    cls.size = _size  # type: ignore[attr-defined]
