"""Typed checkpoints: ``state_dict()`` keeps types, ``torch.load(weights_only=True)`` restores them, loads check them.

* Saving: a typed parameter's ``state_dict()`` entry is a typed tensor, inside
  ``typecheck()`` or not (``detach()`` keeps the type; see ``_tensor.py``).
  A typed optimizer's state (made inside ``typecheck()``) is typed too.
* ``torch.load(..., weights_only=True)``: importing ``spmd_types`` allows the
  few globals a typed tensor pickles to, all our own and none of them able
  to run other code: the LTensor class, the TypedParameter rebuild function,
  and the rebuilders of type values and type maps (which validate what they
  are given).
* Loading: ``module.load_state_dict`` refuses a typed value of another type
  (torch names the key); :func:`load_state_dict` checks a module's or an
  optimizer's state up front and names the key and both types.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Iterator, Mapping

import torch

from .._checker.loaded_types import check_loaded_type
from .._checker.tensor import LTensor, _rebuild_typed_parameter
from .._core.types import S, _by_short_name, _type_map_of

__all__ = ["load_state_dict", "check_state_dict", "SAFE_GLOBALS"]

SAFE_GLOBALS = (LTensor, _rebuild_typed_parameter, _type_map_of, _by_short_name, S)


def _allow_typed_tensors() -> None:
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:  # torch >= 2.4
        add(list(SAFE_GLOBALS))


_allow_typed_tensors()


def check_state_dict(target: Any, state_dict: Mapping[str, Any]) -> None:
    """Raise ``SpmdTypeError`` if a typed value in ``state_dict`` has another type than ``target``'s.

    ``target`` is an ``nn.Module`` or a ``torch.optim.Optimizer``. Untyped
    values (a plain checkpoint) and untyped live tensors pass. An optimizer's
    state tensor is compared with the live state's, or, before the first step,
    with its parameter's type when it has the parameter's shape (moments).

    Example::

        spmd.check_state_dict(model, torch.load("ckpt.pt", weights_only=True))
    """
    for what, loaded, live in _pairs(target, state_dict):
        check_loaded_type(what, getattr(loaded, "_spmd_types", None),
                          getattr(live, "_spmd_types", None))


def load_state_dict(target: Any, state_dict: Mapping[str, Any], **kwargs: Any) -> Any:
    """``target.load_state_dict(state_dict, **kwargs)`` after :func:`check_state_dict`.

    Example::

        spmd.load_state_dict(model, ckpt["model"])
        spmd.load_state_dict(optimizer, ckpt["optimizer"])
    """
    check_state_dict(target, state_dict)
    return target.load_state_dict(state_dict, **kwargs)


def _pairs(target: Any, state_dict: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(the loaded value's place, as code; the value; the live tensor) for every tensor both sides have."""
    if isinstance(target, torch.nn.Module):
        live = target.state_dict(keep_vars=True)
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and isinstance(live.get(key), torch.Tensor):
                yield f"state_dict[{key!r}]", value, live[key]
        return
    if isinstance(target, torch.optim.Optimizer):
        yield from _optimizer_pairs(target, state_dict)
        return
    raise TypeError(f"spmd.check_state_dict takes an nn.Module or a torch.optim.Optimizer, got {type(target).__name__}")


def _optimizer_pairs(opt: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    saved_groups = state_dict.get("param_groups", [])
    saved_ids = chain.from_iterable(g["params"] for g in saved_groups)
    params = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in opt.param_groups)))
    for index, entries in state_dict.get("state", {}).items():
        param = params.get(index)
        if param is None or not isinstance(entries, Mapping):
            continue
        live_state = opt.state.get(param, {})
        for name, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            live = live_state.get(name)
            if not isinstance(live, torch.Tensor):
                live = param if value.shape == param.shape else None
            if live is not None:
                yield f"state_dict['state'][{index!r}][{name!r}]", value, live
