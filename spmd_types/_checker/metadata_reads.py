"""A typed tensor's metadata (shape, dtype, requires_grad, ...) read without subclass dispatch.

torch reads every attribute of a tensor subclass that has ``__torch_function__`` through it: it
builds the call, and the class answers; about 4 us a read on the CI machine, where a plain tensor
answers in 0.1 to 0.2. These reads compute nothing and carry no type (the rules table's metadata
rows leave them unchecked), and a training step makes hundreds of them (Megatron's layers read
``requires_grad`` and ``dtype`` of every activation). So LTensor answers them itself, with subclass
dispatch off, in under 1 us.

They still go through ``__torch_function__`` when that has more to do: under a dispatch mode (the
rank simulator: a typed tensor is then also the mode's subclass) and while torch.compile compiles.
torch.compile's tracer (dynamo) never calls these properties: it asks whether a subclass overrides
an attribute by comparing it with ``torch.Tensor``'s own, and each property here compares equal to
the descriptor it reads, so dynamo traces the read through ``__torch_function__`` as before (which
tells the compile room that a graph holds typed values). Setting ``grad`` and ``requires_grad`` is
answered here too (``zero_grad()`` sets every parameter's ``grad`` to None each step; both rows are
unchecked); other sets and every delete go through ``__torch_function__``. Methods (``size()``,
``dim()``) are not answered here: dynamo would see an overridden method and break its graph.

Example::

    t = spmd.assert_type(torch.randn(4, 16), {"tp": spmd.R})   # inside typecheck()
    t.shape, t.dtype, t.requires_grad   # answered by these properties, no __torch_function__ call
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch.private import call_without_subclass_dispatch, len_torch_dispatch_stack

__all__ = ["FAST_ATTRIBUTES", "install_metadata_reads"]

# the attributes read most in a training step (Megatron-core and torchtitan models counted); every one is a
# row of the rules table's metadata kind
FAST_ATTRIBUTES = ("requires_grad", "dtype", "shape", "is_leaf", "device", "grad", "ndim", "is_cuda")
# ... and those set most: every parameter's ``grad = None`` in ``zero_grad()`` (rows of the metadata kind as well)
FAST_SETS = frozenset({"grad", "requires_grad"})

_OFF_CALL = call_without_subclass_dispatch  # get(self) with subclass dispatch off
_dispatch_depth = len_torch_dispatch_stack
_COMPILER = torch.compiler


class _FastRead(property):
    """A property that compares equal to the ``torch.Tensor`` descriptor it reads (what dynamo checks)."""

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__base

    def __hash__(self) -> int:
        return hash(self.__base)

    def base(self, descriptor: Any) -> _FastRead:
        self.__base = descriptor
        return self


def _fast_property(name: str) -> property:
    base = getattr(torch.Tensor, name)  # torch's own descriptor (Tensor inherits it from C)
    get = base.__get__

    def fget(self: torch.Tensor) -> Any:
        if _dispatch_depth() or _COMPILER._is_compiling_flag:
            return get(self)
        return _OFF_CALL(get, (), (self,))

    set_ = base.__set__

    def fset(self: torch.Tensor, value: Any) -> None:
        if _dispatch_depth() or _COMPILER._is_compiling_flag:
            set_(self, value)
        else:
            _OFF_CALL(set_, (), (self, value))

    # sets other than FAST_SETS, and deletes, are torch's own (through __torch_function__)
    return _FastRead(fget, fset if name in FAST_SETS else set_, base.__delete__,
                     doc=f"``Tensor.{name}``, read without subclass dispatch").base(base)


def install_metadata_reads(cls: type) -> None:
    """Give ``cls`` (LTensor) the fast reads of :data:`FAST_ATTRIBUTES`."""
    for name in FAST_ATTRIBUTES:
        setattr(cls, name, _fast_property(name))
