"""Functions that type themselves are registered with no decorator: the published API's detection of hooks.

A ``torch.autograd.Function`` with an ``spmd_typecheck`` (or the older
``typecheck_forward``) staticmethod says how it types itself, so it needs no
``register_autograd_function`` call. Functions that exist when the package is
imported are found by walking ``torch.autograd.Function``'s subclasses (torch's
own included); a Function defined later is registered when its class is made,
by a wrapper around torch's ``FunctionMeta.__init__`` that registers a class
carrying a hook and changes nothing else (no class without a hook is touched).
The outermost ``typecheck()`` walks the subclasses again when a Function class
was made since the last walk (one that inherits its hook) or the set of seen
classes changed; otherwise it costs one comparison (a training step enters
``typecheck()`` every step).
"""

from __future__ import annotations

from typing import Any

import torch

from .._checker.asserts import ON_FIRST_TYPECHECK
from .autograd_functions import KIND_APPLY, register_autograd_function, registration_of
from .hook_apply import run_spmd_typecheck

KIND_APPLY["spmd_typecheck"] = run_spmd_typecheck  # a hooked class's apply: the real apply, then its hook

__all__ = ["register_hooked_functions", "install", "HOOKS"]

HOOKS = ("spmd_typecheck", "typecheck_forward")
_SEEN: set[type] = set()
_ORIGINAL_INIT: list = []
_WALKED = [-1]  # len(_SEEN) after the last walk; -1 when a Function class was made since


def _has_hook(cls: type) -> bool:
    return any(callable(getattr(cls, name, None)) for name in HOOKS)


def _register_if_hooked(cls: type) -> None:
    if cls in _SEEN:
        return
    _SEEN.add(cls)
    if _has_hook(cls) and registration_of(cls) is None and "forward" in _own_or_inherited(cls):
        register_autograd_function(cls)


def _own_or_inherited(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in vars(klass)}


def register_hooked_functions() -> None:
    """Register every existing Function subclass that carries a hook and is not registered yet."""
    stack = list(torch.autograd.Function.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls not in _SEEN:
            _register_if_hooked(cls)
        stack.extend(cls.__subclasses__())
    _WALKED[0] = len(_SEEN)


def _walk_if_changed() -> None:
    """At the outermost typecheck(): walk again only if a Function class was made, or one forgotten, since."""
    if _WALKED[0] != len(_SEEN):
        register_hooked_functions()


def install() -> None:
    """Register the hooked Functions that exist, and those made from now on (idempotent)."""
    from torch.autograd.function import FunctionMeta

    if not _ORIGINAL_INIT:
        original = FunctionMeta.__init__
        _ORIGINAL_INIT.append(original)

        def __init__(cls: Any, name: str, bases: tuple, attrs: dict) -> None:  # noqa: N807 - the metaclass's own
            original(cls, name, bases, attrs)
            _WALKED[0] = -1  # the next typecheck() walks again (a subclass may inherit a hook)
            if any(h in attrs for h in HOOKS):
                _register_if_hooked(cls)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        FunctionMeta.__init__ = __init__  # type: ignore[method-assign]
        ON_FIRST_TYPECHECK.append(_walk_if_changed)
    register_hooked_functions()
