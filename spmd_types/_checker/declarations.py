"""Checks on what a boundary declares and on what it is called with, before anything is asserted.

``local_map``, ``typed_boundary`` and ``attach_boundary`` take ``in_types`` (one
type dict, or None, per positional argument) and ``out_types`` (one type dict,
or one per output). A dict given as ``in_types`` would be read as its keys,
and a leading tensor argument with no ``in_types`` entry would go unchecked,
so both are errors naming the argument; so is ``attach_boundary`` on
something that has no forward hooks.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["check_declarations", "check_positional", "check_module"]


def check_declarations(who: str, in_types: Any, out_types: Any) -> None:
    """``in_types``: a sequence of type dicts (or None, or itself None where ``who`` allows it); ``out_types``: a
    type dict, or a sequence of them (or None)."""
    if isinstance(in_types, (Mapping, str)) or not isinstance(in_types, Sequence):
        raise TypeError(
            f"{who}: in_types takes one type dict (or None) per positional argument, e.g. "
            f"[{{'tp': spmd.R}}]; got {in_types!r}"
        )
    entries = [("in_types", i, d) for i, d in enumerate(in_types)]
    if not isinstance(out_types, Mapping):
        if isinstance(out_types, str) or not isinstance(out_types, Sequence):
            raise TypeError(f"{who}: out_types takes a type dict, or one (or None) per output; got {out_types!r}")
        entries += [("out_types", i, d) for i, d in enumerate(out_types)]
    for what, i, d in entries:
        if d is not None and not isinstance(d, Mapping):
            raise TypeError(f"{who}: {what}[{i}] must be a type dict {{axis: type}} or None, got {d!r}")


def check_positional(who: str, args: Sequence[Any], in_types: Sequence[Any]) -> int:
    """How many leading arguments ``in_types`` leaves out (a method's ``self``); a tensor among them is an error."""
    offset = len(args) - len(in_types)
    if offset < 0:
        raise TypeError(f"{who}: {len(in_types)} in_types for {len(args)} arguments")
    for i, a in enumerate(args[:offset]):
        if isinstance(a, torch.Tensor):
            entries = "entry" if len(in_types) == 1 else "entries"
            raise TypeError(
                f"{who}: in_types has {len(in_types)} {entries} for {len(args)} positional arguments, so argument "
                f"{i} (a {type(a).__name__} of shape {list(a.shape)}) would go unchecked; give one entry per "
                "positional argument (None leaves one unchecked)"
            )
    return offset


def check_module(who: str, module: Any) -> None:
    """``attach_boundary`` works through forward hooks, which only an ``nn.Module`` has."""
    if not isinstance(module, torch.nn.Module):
        name = getattr(module, "__qualname__", None) or type(module).__name__
        raise TypeError(
            f"{who} takes an nn.Module (it asserts types in the module's forward hooks), got {type(module).__name__} "
            f"{name!r}; for a function use @spmd.typed_boundary(in_types=..., out_types=...)"
        )
