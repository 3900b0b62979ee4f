"""torch.vmap and the other torch.func transforms meeting typed tensors (one clear error), and torch.compile's hook.

A transform hands its function functorch's own wrapped tensors (batched, or
tracking gradients), plain tensors that cannot carry a type, and unwraps the
results into plain tensors: the types would silently disappear. So inside
:func:`spmd_types.typecheck` the package refuses, at the two places it can see:

* ``torch.vmap(f)(x)`` with a typed ``x``: vmap reads ``x.dim()`` while it
  sets up the batch; the tensor layer asks :func:`vmap_setup_caller` only for
  that metadata call (a frame lookup, nothing on any other op);
* a typed tensor meeting a transform's wrapped tensor inside ``f`` (a typed
  value closed over): the operand is marked by :func:`is_transform_tensor`,
  which makes the op a cache miss, and the slow path raises.

The fix is :func:`spmd_types.no_typecheck` with declared types around the
transform: the types go in and come out at its edges.

``torch.compile`` traces typed code as the erased program (see ``spmd_types/_compile``): while
dynamo traces, an op on a typed tensor runs as the plain op (:func:`compiling` is asked first), and the
tensor layer reports the first typed tensor a trace meets to :func:`typed_tensor_traced`, which hands
it to the hook the compile room installs: the graph is then checked before it is compiled.
"""

from __future__ import annotations

import sys

import torch

from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.traced import TRACE_HOOKS, compiling, dynamo_tracing, typed_tensor_traced
from .._torch.private import is_functorch_wrapped_tensor

__all__ = [
    "vmap_setup_caller", "is_transform_tensor", "transform_error", "compiling", "dynamo_tracing",
    "typed_tensor_traced", "TRACE_HOOKS",
]


_is_wrapped = is_functorch_wrapped_tensor
_SETUP = "_process_batched_inputs"


def vmap_setup_caller(depth: int = 2) -> bool:
    """True when the frame ``depth`` levels up is torch.vmap setting up its batched inputs."""
    frame = sys._getframe(depth)
    return frame.f_code.co_name == _SETUP and frame.f_code.co_filename.endswith("vmap.py")


def is_transform_tensor(t: torch.Tensor) -> bool:
    """True for functorch's wrapped tensors (vmap's batched, grad's tracking tensors)."""
    return _is_wrapped(t)


def transform_error(shown: str) -> SpmdTypeError:
    return SpmdTypeError(
        Rejection(
            "torch.vmap and the other torch.func transforms cannot carry SPMD types: they hand their function "
            "plain wrapped tensors and return plain tensors, so the types would be silently dropped.",
            [("operand", shown)],
            ["spmd.no_typecheck(torch.vmap(f), in_types=[...], out_types=...)(x)"],
            notes=["the batch dim is local: declare the types f gives one slice, for the whole batch"],
        ),
        user_source_line(),
    )
