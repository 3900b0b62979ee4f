"""Reduced propagation on ordinary DTensor ops, with torch left unmodified.

DTensor's sharding rules know ``Replicate`` but not ``Reduced``, and torch
cannot be changed here, so a DTensor that has a ``Reduced()`` placement is a
:class:`ReducedDTensor`, a DTensor subclass that

1. computes every op as DTensor would with ``Reduced`` read as ``Replicate``
   (the data layout is the same; ``__torch_dispatch__`` hands DTensor a base
   DTensor whose spec says ``Replicate()``), and
2. re-attaches ``Reduced`` on the outputs (after the op ran, still in
   ``__torch_dispatch__``, so autograd's own copies such as the gradient a
   leaf accumulates keep it too): on each mesh dim where *every* DTensor input is ``Reduced`` and the
   output came out ``Replicate()``, the output is ``Reduced()``.

Rule 2 is seed 001's intersection rule, not seed 000's "inputs must agree"
(which raises). Seed 003 types R (Reduced) and I (Replicate) differently only
in backward: R's gradient is P, I's is I, and I never mixes with R because an
R+I result of type R would need an all-reduce in backward to hand the I input
its I gradient. Typing the result I (Replicate) needs none: the R input's
gradient I -> P is a local ``convert`` (DTensor's Replicate -> Partial). So
the intersection rule never adds backward communication, and never raises
on a program DTensor accepts. Unary ops keep ``Reduced``; ``Reduced`` with
``Shard`` gives what DTensor gives (``Shard``: op(R, V) -> V); matmul of two
``Reduced`` operands stays ``Reduced`` (seed 001).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor, Replicate

from ..._torch.private import dtensor_local, dtensor_spec, dtensor_spec_class, set_dtensor_spec, tree_map
from .placements import Reduced, strip_reduced

DTensorSpec = dtensor_spec_class()  # torch.distributed.tensor._dtensor_spec.DTensorSpec

__all__ = ["ReducedDTensor", "as_reduced_class", "plain_dtensor", "reduced_dims"]


def _replace_spec(spec: DTensorSpec, placements: tuple) -> DTensorSpec:
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def plain_dtensor(t: DTensor) -> DTensor:
    """A base-class DTensor alias of ``t`` with ``Reduced`` read as ``Replicate`` (no autograd link)."""
    spec = dtensor_spec(t)
    placements = strip_reduced(spec.placements)
    if type(t) is DTensor and placements == spec.placements:
        return t
    return DTensor(dtensor_local(t).detach(), _replace_spec(spec, placements), requires_grad=False)  # type: ignore[call-arg]


def reduced_dims(t: Any) -> frozenset[int]:
    """The mesh dims on which DTensor ``t`` is ``Reduced``."""
    return frozenset(i for i, p in enumerate(dtensor_spec(t).placements) if isinstance(p, Reduced))


def as_reduced_class(t: DTensor, dims: frozenset[int]) -> DTensor:
    """Give fresh DTensor ``t`` ``Reduced()`` on ``dims`` where it is ``Replicate()`` (in place; returns ``t``)."""
    placements = list(dtensor_spec(t).placements)
    changed = False
    for d in dims:
        p = placements[d]
        if isinstance(p, Replicate) and not isinstance(p, Reduced):
            placements[d] = Reduced()
            changed = True
    if changed:
        set_dtensor_spec(t, _replace_spec(dtensor_spec(t), tuple(placements)))
        if type(t) is DTensor:
            t.__class__ = ReducedDTensor
    return t


class ReducedDTensor(DTensor):
    """A DTensor with at least one ``Reduced()`` placement; ops propagate ``Reduced`` (module docstring).

    Made by :func:`spmd_types.to_dtensor` and the typed collectives; not
    constructed by hand.

    Example::

        w = spmd.all_gather(w_shard, "dp", src=spmd.S(0), dst=spmd.R)   # a ReducedDTensor
        w.sin().placements        # (Reduced(),): every input Reduced on dp
        (w + r).placements        # (Replicate(),) for r Replicate(): the intersection rule
    """

    __slots__ = ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        dims: list[frozenset[int]] = []
        originals: dict[int, DTensor] = {}

        def unwrap(t: Any) -> Any:
            if not isinstance(t, DTensor):
                return t
            dims.append(reduced_dims(t))
            plain = plain_dtensor(t)
            originals[id(plain)] = t
            return plain

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        keep = frozenset.intersection(*dims) if dims else frozenset()

        def rewrap(o: Any) -> Any:
            if not isinstance(o, DTensor):
                return o
            if id(o) in originals:  # an in-place op returns its input, which keeps its own placements
                return originals[id(o)]
            return as_reduced_class(o, keep) if keep else o

        return tree_map(rewrap, out)
