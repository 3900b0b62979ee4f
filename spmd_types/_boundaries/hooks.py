"""``register_local_backward_hook``: the published API's declaration that a module backward hook keeps types.

The published package refuses a module backward hook it was not told about,
since it cannot see inside one. Here a hook is ordinary code: its ops on typed
gradients are checked like any other (docs/choices.md, choice 25), so an
unregistered hook is allowed too. Registering one records the declaration
(``is_local_backward_hook``) and returns the hook unchanged, so code written
for the published package, which registers each hook, runs as it is.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

__all__ = ["register_local_backward_hook", "is_local_backward_hook"]

F = TypeVar("F", bound=Callable[..., Any])

_LOCAL_HOOKS: weakref.WeakSet = weakref.WeakSet()


def register_local_backward_hook(fn: F) -> F:
    """Declare that a module backward hook (or pre-hook) leaves gradient types as they are; returns ``fn``.

    Example::

        @spmd.register_local_backward_hook
        def log_grad(module, grad_input, grad_output):
            print(grad_output[0].norm())

        module.register_full_backward_hook(log_grad)
    """
    if not callable(fn):
        raise TypeError(f"register_local_backward_hook takes a hook function, got {fn!r}")
    _LOCAL_HOOKS.add(fn)
    return fn


def is_local_backward_hook(fn: Any) -> bool:
    """Whether ``fn`` was registered with :func:`register_local_backward_hook`."""
    try:
        return fn in _LOCAL_HOOKS
    except TypeError:
        return False
