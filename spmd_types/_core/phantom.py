"""A tensor as a typing rule sees it: a rank and an SPMD type (the published API's ``NdimWithSpmdType``).

Hooks written with ``spmd_types.rules`` compute types with no data:
every rules operation returns one of these. ``get_local_type``,
``get_partition_spec`` and ``assert_type_like`` read it as they read a typed
tensor. The coverage stack records which tensors a running hook has used
(in a hook that uses ``rules``, every tensor argument of the Function's forward
must reach a rule, an ``assert_type``, a type read or ``rules.ignore``).

Example::

    y = rules.einsum("mk,nk->mn", x, w)    # an NdimWithSpmdType
    y.ndim, spmd.get_local_type(y)
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["NdimWithSpmdType", "touch", "COVERAGE", "RULES_USED"]


class NdimWithSpmdType:
    """A rank and an SPMD type, nothing else: what ``spmd_types.rules`` operations take and return.

    ``local_type`` is ``{MeshAxis: R | I | V | P}``; ``partition_spec`` says
    which axes shard which dims (None: none). Real typed tensors are accepted
    wherever one of these is.

    Example::

        from spmd_types.rules import NdimWithSpmdType
        d = NdimWithSpmdType(2)      # untyped until a rule or assert_type gives it a type
    """

    __slots__ = ("ndim", "local_type", "partition_spec")

    def __init__(self, ndim: int, local_type: dict | None = None, partition_spec: Any = None) -> None:
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0:
            raise TypeError(f"NdimWithSpmdType(ndim) takes a rank (an int >= 0), got {ndim!r}")
        self.ndim = ndim
        self.local_type = local_type
        self.partition_spec = partition_spec

    def dim(self) -> int:
        return self.ndim

    def __repr__(self) -> str:
        text = f"NdimWithSpmdType(ndim={self.ndim}, {self.local_type if self.local_type is not None else '{}'}"
        return text + (f", {self.partition_spec!r})" if self.partition_spec is not None else ")")


class _Coverage(threading.local):
    def __init__(self) -> None:
        self.stack: list[set[int]] = []


COVERAGE = _Coverage()


RULES_USED = "rules"  # in a hook's coverage set: the hook used a rules operation, so its coverage is checked


def touch(*values: Any, rule: bool = False) -> None:
    """Mark values as used by the running hook (no effect when no hook is running); ``rule``: by a rules op."""
    if COVERAGE.stack:
        touched = COVERAGE.stack[-1]
        for v in values:
            touched.add(id(v))
        if rule:
            touched.add(RULES_USED)  # type: ignore[arg-type]


def assert_phantom(value: NdimWithSpmdType, types: Any, partition_spec: Any) -> NdimWithSpmdType:
    """``assert_type`` on an NdimWithSpmdType: an untyped one is given the type; a typed one is checked."""
    from .errors import SpmdTypeError
    from .regions import normalize_axis
    from .types import PartitionSpec, Shard, V

    given = {normalize_axis(a): t for a, t in types.items()} if hasattr(types, "items") else {}
    shards = {a: t.dim % max(value.ndim, 1) for a, t in given.items() if isinstance(t, Shard)}
    local = {a: (V if t.is_varying else t) for a, t in given.items() if a.size() > 1}
    spec = partition_spec
    if shards and spec is None:
        spec = PartitionSpec(*(next((a for a, d in shards.items() if d == i), None) for i in range(value.ndim)))
    if value.local_type is None:
        value.local_type, value.partition_spec = local, spec
        return value
    for a, t in local.items():
        have = value.local_type.get(a)
        if have is not t:
            raise SpmdTypeError(f"assert_type: the value is {have} on axis {a!r}, and the assertion says {t}")
    return value
