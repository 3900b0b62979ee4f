"""Shared fixtures and helpers for the rules tests: typed operands on a (dp=2, tp=4) fake mesh."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from conftest import fake_mesh

import spmd_types as spmd
from spmd_types import I, P, R, S, V
from spmd_types._checker import tensor as _tensor
from spmd_types._checker import zero_buffers as _zero_buffers


@pytest.fixture(scope="module")
def mesh():
    return fake_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test sees the rules themselves, not a result cached by an earlier test."""
    for cache in (*getattr(_tensor, "_CACHES", ()), *_zero_buffers.KNOWN):
        cache.clear()
    yield


NOT_LINEAR = "is not linear in"
P_TIMES_P = "Partial * Partial"
P_PLUS = "can only be added to another pending sum"
P_TIMES_NON_R = "can only be multiplied by a Replicate"
NEEDS_R = "must be Replicate (R)"
IN_PLACE = "An in-place op cannot change its tensor's type"


def typed(t: torch.Tensor, tp, dp=R) -> torch.Tensor:
    return spmd.assert_type(t, {"dp": dp, "tp": tp})


@pytest.fixture
def x(mesh):
    """Typed operands, made inside typecheck(); the test body runs inside it too."""
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        torch.manual_seed(0)
        ns = SimpleNamespace(
            r=typed(torch.randn(4, 4), R),
            i=typed(torch.randn(4, 4, requires_grad=True), I),  # differentiable: I mixing matters for gradients
            v=typed(torch.randn(4, 4), V),
            r_grad=typed(torch.randn(4, 4, requires_grad=True), R),  # R that needs a gradient: never meets I
            p=typed(torch.randn(4, 4), P),
            s0=typed(torch.randn(4, 4), S(0)),
            mask=typed(torch.rand(4, 4) > 0.5, R),
            mask_v=typed(torch.rand(4, 4) > 0.5, V),
            idx=typed(torch.tensor([0, 2]), R),
            idx_v=typed(torch.tensor([0, 2]), V),
            idx_p=typed(torch.tensor([0, 2]), P),
            target=typed(torch.tensor([0, 1, 2, 3]), R),
            w3=typed(torch.randn(2, 4, 4), R),
        )
        yield ns


def rejects(fragment: str):
    """Expect an SpmdTypeError whose message contains ``fragment`` (plain text, not a regex)."""
    return pytest.raises(spmd.SpmdTypeError, match=re.escape(fragment))


def tp_type(out: torch.Tensor):
    types = spmd.get_type(out)
    assert types is not None, f"{type(out).__name__} came back untyped"
    assert types["dp"] is R, types
    return types["tp"]


