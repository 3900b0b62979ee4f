"""Checking under torch.compile: dynamo's graph of the erased program, checked once, then compiled."""

from .._core.traced import TRACE_HOOKS
from .backend import install

if install not in TRACE_HOOKS:
    TRACE_HOOKS.append(install)
