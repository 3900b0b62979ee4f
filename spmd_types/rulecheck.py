"""The published API's ``spmd_types.rulecheck``: a Function's ``spmd_typecheck`` hook checked against its kernel.

``rulecheck(cls, args, placements=None, *, mesh=None, rtol=1e-4, atol=1e-5,
local_tensor_mode=False)`` runs the Function on simulated ranks for each
placement of its inputs and compares what the hook's types say the outputs
mean with the kernel run on the global inputs (see
``spmd_types/testing/_rulecheck.py``). ``spmd.rulecheck`` is this module, and
calling it calls the function. Ours for registrations is
``spmd.testing.verify_registration``.

Example::

    from spmd_types.rulecheck import rulecheck
    report = rulecheck(LinearAllReduce, (x, weight, "tp"))
"""

import sys
import types as _types

from .testing._rulecheck import RuleCheckError, RuleCheckPlacement, RuleCheckRejection, RuleCheckReport, rulecheck

__all__ = ["rulecheck", "RuleCheckError", "RuleCheckReport", "RuleCheckRejection", "RuleCheckPlacement"]


class _CallableModule(_types.ModuleType):
    """``spmd.rulecheck(...)`` calls :func:`rulecheck`; ``spmd.rulecheck.rulecheck`` is the same function."""

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204 - rulecheck's own signature
        return rulecheck(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
