"""Typing a fused kernel by a reference implementation (the published API's ``register_decomposition``).

The reference runs on meta copies of the arguments that carry the same types
(and partition specs), inside the same ``typecheck()``: every op in it is
checked by the rules and its outputs come out typed. The real Function then
runs on plain aliases, and its outputs take the reference's output types,
leaf by leaf. No storage is allocated for the reference's values.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._checker.tensor import _DisableTF, _wrap, make_typed
from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._torch.private import tree_flatten, tree_map, tree_unflatten

__all__ = ["decomposed_apply"]


def _meta_like(a: Any) -> Any:
    """A meta tensor with ``a``'s shape, dtype, requires_grad and types (anything else as is)."""
    if not isinstance(a, torch.Tensor):
        return a
    with _DisableTF():
        meta = torch.empty_like(a, device="meta").requires_grad_(a.requires_grad)
    types = getattr(a, "_spmd_types", None)
    if types is None:
        return meta
    out = make_typed(meta, types)
    spec = getattr(a, "_spmd_spec", None)
    if spec is not None:
        out._spmd_spec = spec
    return out


def decomposed_apply(cls: type, ref_impl: Callable[..., Any], run: Callable[[tuple, dict], Any],
                     args: tuple, kwargs: dict) -> Any:
    """Type ``cls``'s outputs by ``ref_impl``'s on meta copies; ``run(args, kwargs)`` runs the Function for real."""
    ref = ref_impl(*tree_map(_meta_like, args), **tree_map(_meta_like, kwargs))
    real = run(args, kwargs)
    ref_leaves, ref_tree = tree_flatten(ref)
    real_leaves, real_tree = tree_flatten(real)
    if ref_tree != real_tree:
        raise SpmdTypeError(
            Rejection(
                f"register_decomposition: the reference implementation of {cls.__qualname__} returns a different "
                "structure than the Function.",
                [("reference", str(ref_tree)), ("function", str(real_tree))],
                ["make the reference return what the Function's apply returns, leaf for leaf"],
            ),
            user_source_line(),
        )
    typed = []
    for r, o in zip(ref_leaves, real_leaves):
        types = getattr(r, "_spmd_types", None) if isinstance(r, torch.Tensor) else None
        if types is not None and isinstance(o, torch.Tensor):
            o = _wrap(o, types)
            spec = getattr(r, "_spmd_spec", None)
            if spec is not None:
                o._spmd_spec = spec
        typed.append(o)
    return tree_unflatten_like(real, typed)


def tree_unflatten_like(real: Any, leaves: list) -> Any:
    return tree_unflatten(leaves, tree_flatten(real)[1])
