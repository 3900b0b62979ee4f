"""The result cache's extended keys: an answer that read more than the operands' types.

The typed-op result cache (``tensor.py``) is keyed by the op and its operands' types and markers. A few
answers also read something else, which the rules say through ``STATE.uncacheable``: which operands carry a
gradient (a gradient-free acceptance, ``BY_GRADIENT``), or the current mesh (operands typed on other
presentations of the ranks, moved onto it: ``BY_MESH``), or both. Such an answer is cached under its key
extended by exactly what it read, and the plain key holds a :class:`Keyed` marker that says how to extend it.
``tests/test_result_cache.py`` checks that a hit equals the full inference.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.mesh import current_mesh
from .._core.state import BY_GRADIENT, BY_GRADIENT_AND_MESH, BY_MESH
from .._local.rules import backward_possible
from .._torch.private import DisableTorchFunctionSubclass

__all__ = ["Keyed", "keyed_by", "more_key", "gradient_bits"]

_DisableTF = DisableTorchFunctionSubclass


class Keyed:
    """In the result cache: look again with the key extended by the gradient bits and/or the current mesh."""

    __slots__ = ("grad", "mesh")

    def __init__(self, grad: bool, mesh: bool) -> None:
        self.grad, self.mesh = grad, mesh


_KEYED_BY = {BY_GRADIENT: Keyed(True, False), BY_MESH: Keyed(False, True), BY_GRADIENT_AND_MESH: Keyed(True, True)}


def keyed_by(reason: Any) -> Keyed:
    """The marker for an answer that read ``reason`` (``STATE.uncacheable``: one of the ``BY_*`` values)."""
    return _KEYED_BY[reason]


def more_key(keyed: Keyed, key: tuple, args: tuple, kwargs: dict) -> tuple:
    """``key`` with what a ``keyed`` answer also read: the operands' gradient bits, the current mesh's token."""
    mesh = current_mesh() if keyed.mesh else None
    return (key, gradient_bits(args, kwargs) if keyed.grad else None, None if mesh is None else mesh.token, keyed)


def gradient_bits(args: tuple, kwargs: dict) -> tuple:
    """Which tensor operands carry a gradient (the rules' ``Operand.grad``), in order, and whether any can."""
    bits = [backward_possible()]

    def visit(a: Any) -> None:
        if isinstance(a, torch.Tensor):
            bits.append(a.requires_grad)
        elif type(a) is list or type(a) is tuple:
            for x in a:
                visit(x)

    with _DisableTF():
        for a in (*args, *kwargs.values()):
            visit(a)
    return tuple(bits)
