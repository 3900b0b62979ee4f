"""Catch custom ``torch.autograd.Function`` classes that touch typed tensors without a registration.

A custom Function's backward is written by hand, so its forward ops say
nothing about the communication its backward does (Megatron's copy-to region
is an identity forward with an all-reduce backward). The package therefore
refuses to type one from its forward alone: inside :func:`spmd_types.typecheck`,
a typed tensor reaching an op while an unregistered Function's forward runs
raises :class:`SpmdTypeError` naming the class and the registration that fixes it.

How it is seen, with no patching of torch: a Function's forward always runs
inside ``Function.apply`` with both grad mode and forward-mode AD off (plain
``torch.no_grad()`` leaves forward-mode AD on, so it costs nothing). When a
typed op runs in that state, the stack is searched for ``Function.apply``
frames; their ``cls`` is the Function being applied. This module is the low layer (the
tensor layer calls :func:`check_no_unregistered_function`); registration
itself lives in ``_autograd_functions``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .._core.errors import Rejection, SpmdTypeError, user_source

__all__ = ["ALLOWED", "check_no_unregistered_function", "unregistered_error"]

# Function classes whose forward may run on typed tensors: registered ones, and the package's own.
ALLOWED: dict[type, str] = {}

_APPLY_CODE = torch.autograd.function.Function.apply.__func__.__code__  # type: ignore[attr-defined]


# torch's own Functions whose backward is the true derivative of ordinary ops: their bodies are checked
# op by op (re-running ops on simulated ranks; identity with module backward hooks; checkpoint recomputation;
# the identities FSDP2 and DDP put on a module's activations to run their hooks when backward reaches them,
# whose communication is on the parameters, never on the activations' gradients).
_TORCH_TRANSPARENT = frozenset({
    "torch.distributed._local_tensor._LocalContiguous",
    "torch.nn.modules._functions.BackwardHookFunction",
    "torch.utils.checkpoint.CheckpointFunction",
    "torch.distributed.fsdp._fully_shard._fsdp_state.RegisterPreBackwardFunction",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction",
    "torch.nn.parallel.distributed._DDPSink",
})


def check_no_unregistered_function() -> None:
    """Raise if an unregistered custom Function's forward is running (call only with grad mode off).

    Every ``Function.apply`` on the stack counts, not just the innermost: a
    transparent Function (its body checked op by op) may run inside an
    unregistered one.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY_CODE:
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type) and cls not in ALLOWED and not _own(cls) and not _torch_transparent(cls):
                raise unregistered_error(cls, _caller_line(frame))
        frame = frame.f_back


def _own(cls: type) -> bool:
    """The package's own Functions (the typed ops, the DTensor bridge): their forwards run on plain aliases.

    Only a reader of metadata sees the typed base of such an alias (torch.compile's frame
    conversion reads ``x._base``); that read is answered by the tensor layer, never refused here.
    """
    return cls.__module__.startswith(_PACKAGE)


_PACKAGE = __name__.split(".", 1)[0] + "."


def _torch_transparent(cls: type) -> bool:
    return f"{cls.__module__}.{cls.__qualname__}" in _TORCH_TRANSPARENT


def _caller_line(apply_frame: Any) -> str | None:
    """The user's line that called ``cls.apply(...)`` (outside spmd_types and torch)."""
    found = user_source(apply_frame.f_back)
    return found[0] if found else None


def unregistered_error(cls: type, source: str | None) -> SpmdTypeError:
    name = f"{cls.__module__}.{cls.__qualname__}"
    return SpmdTypeError(
        Rejection(
            f"The custom autograd Function {cls.__name__} is applied to typed tensors, but it is not "
            "registered: its backward is written by hand, so its forward ops do not say what its backward "
            "communicates, and typing it from the forward alone could hide a wrong gradient.",
            [("function", name)],
            [
                f"spmd.register_autograd_function({cls.__name__}, local=True)  # no communication in "
                "forward or backward",
                f"spmd.register_autograd_function({cls.__name__}, op='all_reduce', axis='tp', src=spmd.P, "
                "dst=spmd.R)  # behaves like that spmd call",
                f"spmd.register_autograd_function({cls.__name__}, rule=lambda *types: ...)  # output types "
                "from input types",
            ],
            notes=["check a registration in your tests with spmd.testing.verify_registration"],
        ),
        source,
    )
