"""Resolve the rules table's op names to the callables ``__torch_function__`` sees."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .rules_table import ROWS, Row, RuleKind

__all__ = ["OpEntry", "ENTRIES", "entry_for", "display_name", "UNRESOLVED"]

_NAMESPACES = {"torch": torch, "Tensor": torch.Tensor, "F": F, "torch.linalg": torch.linalg}

_DUNDER_SYMBOLS = {
    "__add__": "+", "__radd__": "+", "__iadd__": "+=", "__sub__": "-", "__rsub__": "-",
    "__isub__": "-=", "__mul__": "*", "__rmul__": "*", "__imul__": "*=", "__truediv__": "/",
    "__rtruediv__": "/", "__itruediv__": "/=", "__matmul__": "@", "__rmatmul__": "@",
    "__pow__": "**", "__rpow__": "**", "__neg__": "unary -", "__getitem__": "x[i]",
    "__setitem__": "x[i] = v", "__eq__": "==", "__ne__": "!=", "__lt__": "<", "__le__": "<=",
    "__gt__": ">", "__ge__": ">=", "__floordiv__": "//", "__mod__": "%",
}


@dataclass(frozen=True)
class OpEntry:
    """A callable, how messages name it, its row, and whether it writes in place."""

    func: Callable[..., Any]
    display: str
    row: Row
    inplace: bool
    known: bool = True


def _is_inplace(attr_name: str) -> bool:
    if attr_name in ("__setitem__", "copy_"):
        return True
    if attr_name.startswith("__i") and attr_name.endswith("__"):
        return True
    return attr_name.endswith("_") and not attr_name.endswith("__")


def _resolve(name: str) -> tuple[Callable[..., Any] | None, str]:
    if name.endswith(".__set__"):  # assigning a property: ``x.grad = g`` calls ``grad.__set__``
        ns_name, _, attr_name = name[: -len(".__set__")].rpartition(".")
        desc = _NAMESPACES[ns_name].__dict__.get(attr_name) or getattr(_NAMESPACES[ns_name], attr_name, None)
        setter = getattr(desc, "__set__", None)
        return setter, f"{attr_name}.__set__"
    ns_name, _, attr_name = name.rpartition(".")
    ns = _NAMESPACES[ns_name]
    attr = ns.__dict__.get(attr_name) if ns is torch.Tensor else getattr(ns, attr_name, None)
    if attr is None and ns is torch.Tensor:
        attr = getattr(ns, attr_name, None)
    if attr is None:
        return None, attr_name
    if isinstance(attr, (property, types.GetSetDescriptorType, types.MemberDescriptorType)):
        return attr.__get__, attr_name
    return attr, attr_name


def display_name(name: str) -> str:
    _, _, attr_name = name.rpartition(".")
    symbol = _DUNDER_SYMBOLS.get(attr_name)
    return f"{name} ({symbol})" if symbol else name


def _build() -> tuple[dict[Any, OpEntry], list[str]]:
    entries: dict[Any, OpEntry] = {}
    unresolved: list[str] = []
    for row in ROWS:
        for raw in row.names:
            optional = raw.startswith("?")
            name = raw.lstrip("?")
            func, attr_name = _resolve(name)
            if func is None:
                if not optional:
                    unresolved.append(name)
                continue
            if func in entries:
                if entries[func].row is not row and not optional:
                    raise AssertionError(f"{name} is in two rows of the typing-rules table")
                continue
            entries[func] = OpEntry(func, display_name(name), row, _is_inplace(attr_name))
    return entries, unresolved


ENTRIES, UNRESOLVED = _build()

_UNKNOWN_ROW = Row((), RuleKind.NONLINEAR, "not in the typing-rules table, so treated as non-linear")


def _unknown_display(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    owner = getattr(getattr(func, "__objclass__", None), "__name__", None)
    if owner == "TensorBase" or owner == "Tensor":
        return f"Tensor.{name}"
    if module.startswith("torch.nn.functional") or module == "torch._C._nn":
        return f"F.{name}"
    if module.startswith("torch"):
        return f"torch.{name}"
    return f"{module}.{name}" if module else name


def entry_for(func: Any) -> OpEntry:
    """The table entry for ``func``; an op not in the table gets a non-linear entry."""
    entry = ENTRIES.get(func) or _UNKNOWN_ENTRIES.get(func)
    if entry is None:
        name = getattr(func, "__name__", "")
        entry = OpEntry(func, _unknown_display(func), _UNKNOWN_ROW, _is_inplace(name), known=False)
        try:
            _UNKNOWN_ENTRIES[func] = entry  # kept apart: ENTRIES is the table and nothing else
        except TypeError:  # unhashable callables are rare; just do not cache them
            pass
    return entry


_UNKNOWN_ENTRIES: dict[Any, OpEntry] = {}
