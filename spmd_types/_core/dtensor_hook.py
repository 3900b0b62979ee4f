"""Where the core hands DTensor inputs to ``spmd_types.integrations.dtensor`` (imported only when a DTensor shows up).

The core never imports DTensor: a DTensor can only exist once
``torch.distributed.tensor`` is loaded, so the check reads ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["is_dtensor", "interop"]

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
