"""Writing values into a buffer of zeros: the result takes the values' type (docs/index.md, choice 30).

The rows of the rules table with a ``zero_buffer`` write values into a
tensor. When that tensor holds only zeros, it is the identity of the sum, so
the result is the values alone: ``torch.zeros(n, h).scatter_add_(0, idx, x)``
is P for a P ``x``. Torch's plain factories are not seen by the checker, so
"zeros" is known by reading the buffer (one reduction, a host sync on an
accelerator), and only where the ordinary rule refuses, or would write a
typed result into a plain buffer. The type the relaxed rule gives is kept per
call signature (the result cache's key, extended as the result cache extends
it when the answer also read the operands' gradient bits or the current mesh:
``result_keys.py``), so a call seen before costs the buffer checks and no
inference; the buffer itself is checked on every call.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.errors import Rejection
from .._core.state import STATE
from .._core.types import TypeMap
from .._local.op_registry import OpEntry
from .._local.rules import backward_possible, infer
from .._torch.private import DisableTorchFunctionSubclass, storage_holders
from .result_keys import Keyed, keyed_by, more_key
from .run_ops import holds_only_zeros

__all__ = ["known_into_zeros", "into_zeros", "remember", "KNOWN", "storage_shared"]

_DisableTF = DisableTorchFunctionSubclass

# non-strict, strict: the result cache's key -> the type a qualifying buffer of zeros gave that call (or a Keyed
# marker: the type is under the key extended by what the answer also read)
KNOWN: tuple[dict, dict] = ({}, {})


def _buffer(entry: OpEntry, args, kwargs) -> Any:
    return args[0] if args else kwargs.get(entry.row.zero_buffer)


def _qualifies(buf: Any, dest: Any) -> bool:
    """``buf`` holds only zeros and carries no gradient (whose type would be the values' backward type).

    A plain buffer written in place is typed before the write, so no other
    tensor may share its storage: a view of it, the tensor it views, or an
    alias typed by ``assert_type`` would keep its own type (or none) and hold
    the new values.
    """
    if not isinstance(buf, torch.Tensor):
        return False
    with _DisableTF():
        if buf.requires_grad and backward_possible():
            return False
        if dest is buf and getattr(buf, "_spmd_types", None) is None and storage_shared(buf):
            return False
    return holds_only_zeros(buf)


def storage_shared(t: torch.Tensor) -> bool:
    """Whether a tensor other than ``t`` holds ``t``'s storage (a view, its base, an alias)."""
    try:
        storage = t.untyped_storage()
        # held by t and by the storage object just made; a third holder is another tensor (or saved for backward)
        return storage_holders(storage) > 2
    except (RuntimeError, NotImplementedError, AttributeError):  # a tensor without storage: assume it is shared
        return True


def known_into_zeros(entry: OpEntry, args, kwargs, dest: Any, key: Any) -> TypeMap | None:
    """The type this call's signature got into zeros before, if its buffer qualifies again; else None."""
    if key is None:
        return None
    known = KNOWN[STATE.strict]
    types = known.get(key)
    if type(types) is Keyed:
        types = known.get(more_key(types, key, args, kwargs))
    if types is None or not _qualifies(_buffer(entry, args, kwargs), dest):
        return None
    STATE.uncacheable = True  # the answer depends on the buffer's values: not for the result cache
    return types


def into_zeros(entry: OpEntry, args, kwargs, dest: Any,
               result: TypeMap | Rejection) -> tuple[TypeMap | Rejection, bool, bool | str]:
    """``(type, relaxed, read)``: the ordinary rule's ``result``, or the relaxed rule's if the buffer qualifies.

    ``read`` says what else the relaxed answer read (``STATE.uncacheable``): False, the call's signature alone;
    ``BY_GRADIENT`` / ``BY_MESH`` / both, also which operands carry a gradient (choice 13) or the current mesh;
    True, anything (or no relaxed answer): not to be remembered.
    """
    if not _qualifies(_buffer(entry, args, kwargs), dest):
        return result, False, True
    STATE.uncacheable = False
    relaxed = infer(entry, args, kwargs, STATE.strict, zero_buffer=True)
    read = STATE.uncacheable
    STATE.uncacheable = True  # the answer depends on the buffer's values: not for the result cache
    if relaxed is None:  # nothing typed but the buffer: the ordinary rule's answer stands
        return result, False, True
    return relaxed, True, read


def remember(key: Any, types: TypeMap, read: bool | str, args, kwargs) -> None:
    """Keep the relaxed answer for ``key`` (extended by what it also ``read``, as :func:`into_zeros` says)."""
    known = KNOWN[STATE.strict]
    if read is False:
        known[key] = types
    elif read is not True:
        keyed = keyed_by(read)
        known[key] = keyed
        known[more_key(keyed, key, args, kwargs)] = types
