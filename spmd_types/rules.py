"""The published API's ``spmd_types.rules``: type-only operations for a Function's ``spmd_typecheck`` hook.

A Function that communicates or wraps an opaque kernel says how it types
itself in an ``spmd_typecheck`` staticmethod; no decorator is needed (its class
is registered when it is made). The hook names the forward arguments it needs
as keyword-only parameters and returns the output type(s), composed from these
operations, each of which returns an :class:`NdimWithSpmdType` (a rank and a
type, no data). Every tensor argument must reach an operation (or
``ignore``), and every output must be typed.

Example::

    from spmd_types import rules

    class LinearAllReduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, group):
            ...

        @staticmethod
        def spmd_typecheck(*, x, weight, group):
            y = rules.einsum("mk,nk->mn", x, weight)
            return rules.all_reduce(y, group, src=spmd.P, dst=spmd.I)
"""

from ._boundaries.hook_apply import bind_forward_args, hook_kwargs, hook_shape
from ._boundaries.hook_apply import run_spmd_typecheck as _run_spmd_typecheck
from ._boundaries.hook_rules import (
    all_gather,
    all_reduce,
    all_to_all,
    convert,
    einsum,
    ignore,
    output,
    reduce_scatter,
    reinterpret,
)
from ._core.phantom import NdimWithSpmdType

__all__ = ["NdimWithSpmdType", "einsum", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reinterpret",
           "convert", "ignore", "output", "bind_forward_args", "hook_kwargs", "hook_shape", "run_typecheck"]


def run_typecheck(cls: type, func, args: tuple):  # noqa: ANN001, ANN201 - the published signature
    """Run ``func(*args)`` (a Function's real ``apply``) and then ``cls.spmd_typecheck`` on its outputs.

    Example::

        out = rules.run_typecheck(LinearAllReduce, LinearAllReduce.apply, (x, w, group))
    """
    return _run_spmd_typecheck(cls, lambda: func(*args), tuple(args), {})
