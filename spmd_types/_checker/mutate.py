"""``mutate_type``: retype a tensor in place when its meaning changed without an op the checker saw.

A buffer filled by an in-place collective, or a count that is about to be
read per rank, changes its type under the same object. ``src`` is checked;
nothing runs. A tensor that carries a gradient may only change in a way
whose backward leaves the gradient's data as it is (a ``reinterpret`` whose
dual is again a ``reinterpret``: ``V -> P``, ``R -> V``, ``R -> P``); any
other change has a backward that changes the gradient, which the in-place
retype cannot record (``I -> R`` all-reduces it, ``R -> I`` keeps it on one
rank): use ``spmd.reinterpret``. A tensor typed on another presentation of the
ranks is first presented on the current mesh (by regions, never by names).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .._core.errors import Rejection, SpmdTypeError, user_source_line
from .._core.implicit_mesh import mesh_of_space
from .._core.mesh import current_mesh, resolve_axes, set_current_mesh
from .._core.state import STATE
from .._core.traced import register_call, routed, traced_call, zero
from .._core.types import SpmdType, V, base_type, check_type_value, compatible
from .._local.transitions import backward_of, find
from .reading import rehome_here
from .trace import log_op

__all__ = ["mutate_type"]


def mutate_type(tensor: torch.Tensor, axis: Any = None, *, src: Any, dst: Any) -> torch.Tensor:
    """Change ``tensor``'s type in place from ``src`` to ``dst`` (checked) on ``axis``, or on several axes.

    Call shapes: ``mutate_type(t, axis, src=R, dst=I)``; ``mutate_type(t, src=R, dst=I)``
    (every typed axis); ``mutate_type(t, src=R, dst={a: I, b: P})``;
    ``mutate_type(t, src={a: R, b: I}, dst=P)``; ``mutate_type(t, src={a: R}, dst={a: I})``.
    ``S(d)`` is compared and stored as V locally. Outside :func:`typecheck` it
    changes a type given there by ``assert_type`` (a plain tensor stays plain).

    Example::

        counts = tokens_per_expert(...)                    # typed P on 'tp'
        spmd.mutate_type(counts, "tp", src=spmd.P, dst=spmd.V)
    """
    if not STATE.checking:  # a type given outside typecheck() changes as its record (published.py)
        if routed():
            return tensor  # the erased program traced by torch.compile
        from .published import mutate_remembered

        return mutate_remembered(tensor, axis, src, dst)
    if routed():  # torch.compile traces: one graph node, which the compiled graph's checker reads
        traced_call("mutate_type", tensor, axis, src=src, dst=dst)
        return tensor
    types = getattr(tensor, "_spmd_types", None)
    if types is not None and current_mesh() is None:  # typed by groups alone: its own mesh
        own = mesh_of_space(types.space)
        if own is not None:
            with set_current_mesh(own):
                return mutate_type(tensor, axis, src=src, dst=dst)
    if types is None:
        raise SpmdTypeError(
            Rejection("spmd.mutate_type needs a typed tensor: it changes a type, and this tensor has none.",
                      [("tensor", "untyped")], ["spmd.assert_type(t, {...}) first"]),
            user_source_line(),
        )
    types = rehome_here(tensor, "spmd.mutate_type")
    updates = _updates(types, axis, src, dst)
    carries_grad = tensor.requires_grad and torch.is_grad_enabled()
    new = types
    for name, s, d in updates:
        have = types.get(name)
        if not compatible(have, s, tensor.dim()):
            raise SpmdTypeError(
                Rejection(f"spmd.mutate_type's src= must be the tensor's type: src={s}, but the tensor is {have} "
                          f"on axis '{name}'.", [("tensor", types.format()), ("axis", f"'{name}': {have} is not {s}")],
                          []),
                user_source_line(),
            )
        if carries_grad and not _gradient_safe(have, d):
            raise SpmdTypeError(
                Rejection(f"spmd.mutate_type cannot change {have} to {d} on axis '{name}' of a tensor that carries a "
                          "gradient: that change's backward changes the gradient, which an in-place retype cannot "
                          "record.",
                          [("tensor", types.format())],
                          _retype_fixes(name, have, d)),
                user_source_line(),
            )
        new = new.replace(name, d)
    tensor._spmd_types = new  # type: ignore[attr-defined]
    if STATE.tracing:
        log_op("mutate_type", [types], tensor)
    return tensor


def _updates(types: Any, axis: Any, src: Any, dst: Any) -> list[tuple[str, SpmdType, SpmdType]]:
    """``(axis name, src, dst)`` for each axis the call names (axes of size 1 dropped)."""
    if isinstance(src, Mapping) or isinstance(dst, Mapping):
        if axis is not None:
            raise TypeError("spmd.mutate_type: give axis, or dicts of axes in src/dst, not both")
        if isinstance(src, Mapping) and isinstance(dst, Mapping):
            s, d = _by_name(src, "src"), _by_name(dst, "dst")
            if set(s) != set(d):
                raise ValueError(f"spmd.mutate_type: src and dst name different axes: "
                                 f"{sorted(set(s) ^ set(d))}")
            return [(n, s[n], d[n]) for n in d]
        if isinstance(dst, Mapping):
            s_one = _type(src, "src")
            return [(n, s_one, t) for n, t in _by_name(dst, "dst").items()]
        d_one = _type(dst, "dst")
        return [(n, t, d_one) for n, t in _by_name(src, "src").items()]
    s_one, d_one = _type(src, "src"), _type(dst, "dst")
    names = types.axes() if axis is None else resolve_axes(axis)
    return [(n, s_one, d_one) for n in names]


def _by_name(types: Mapping[Any, Any], what: str) -> dict[str, SpmdType]:
    if current_mesh() is None:
        raise RuntimeError("spmd.mutate_type needs a current mesh to resolve its axes")
    out: dict[str, SpmdType] = {}
    for key, t in types.items():
        t = _type(t, what)
        for name in resolve_axes(key):
            out[name] = t
    return out


def _type(t: Any, what: str) -> SpmdType:
    t = check_type_value(t, f"spmd.mutate_type: {what}")
    return V if t.is_varying else t  # S(d) is V locally


def _retype_fixes(name: str, have: SpmdType, dst: SpmdType) -> list[str]:
    """The retype that records its backward: a reinterpret, when seed 003's table has one (P -> V has none)."""
    if find("reinterpret", have, dst) is not None:
        return [f"x = spmd.reinterpret(x, '{name}', src={have.code()}, dst={dst.code()})"]
    return []


def _gradient_safe(have: SpmdType | None, dst: SpmdType) -> bool:
    """True when retyping ``have`` -> ``dst`` needs no backward communication (a reinterpret whose dual is one)."""
    if have is None:
        return False
    s, d = base_type(have), base_type(dst)
    if s is d:
        return True
    if find("reinterpret", s, d) is None:
        return False
    return backward_of("reinterpret", s, d)[0] == "reinterpret"


register_call("mutate_type", mutate_type, zero)
