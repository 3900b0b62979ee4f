"""Where the core hands DTensor inputs to ``spmd_types.integrations.dtensor`` (imported only when a DTensor shows up).

The core never imports DTensor: a DTensor can only exist once
``torch.distributed.tensor`` is loaded, so the check reads ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["is_dtensor", "interop", "load_if_imported"]

_PLAIN = torch.Tensor


def is_dtensor(x: Any) -> bool:
    """True if ``x`` is a DTensor (cheap for plain tensors)."""
    if type(x) is _PLAIN:
        return False
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def interop() -> Any:
    """The ``spmd_types.integrations.dtensor.bridge`` module (loaded on first use)."""
    from ..integrations.dtensor import bridge  # the core's one door upwards (tests/test_layering.py)

    return bridge


_LOADED: list[bool] = []


def load_if_imported() -> None:
    """Load the DTensor integration once DTensor is imported (``spmd.typecheck()`` calls this on entry).

    Its registrations (``DTensor.from_local`` of a typed tensor, checked like
    ``spmd.to_dtensor``) must be in place before the first op of the block.
    """
    if not _LOADED and "torch.distributed.tensor" in sys.modules:
        interop()
        _LOADED.append(True)

