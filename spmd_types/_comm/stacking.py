"""A V side given a dim: the ranks' values stacked on that dim (the published meaning of gather_dim and friends).

V denotes the per-rank values stacked on a new dim; S(d) the shards
concatenated on dim d. ``all_gather(src=V, gather_dim=d)`` stacks on a new dim
d, ``reduce_scatter(dst=V, scatter_dim=d)`` takes this rank's entry of dim d
(which has one entry per rank) and drops the dim, and ``all_to_all(src=V,
dst=V, split_dim=i, concat_dim=j)`` unbinds dim i and stacks on dim j. Each is
the concatenating collective on a dim of size one per rank, with that dim added
(``unsqueeze``) or removed (``squeeze``, ``movedim``) by ordinary, typed and
differentiable tensor ops, so the backward follows.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._core.types import SpmdType, V
from .call import Begun, norm_dim

__all__ = ["stacked_input", "check_one_per_rank", "uneven_splits", "varying_dim"]


def stacked_input(opname: str, x: torch.Tensor, gather_dim: int) -> tuple[torch.Tensor, int]:
    """``(x with a new dim of size 1 at gather_dim, that dim)``: concatenating these stacks the values on it."""
    ndim = x.dim()
    if isinstance(gather_dim, int) and not isinstance(gather_dim, bool) and not -ndim - 1 <= gather_dim <= ndim:
        raise ValueError(f"{opname}: gather_dim={gather_dim} stacks the ranks' values on a new dim {gather_dim}, "
                         f"but a {ndim}-dim tensor has new dims {-ndim - 1} to {ndim}")
    d = norm_dim(opname, f"gather_dim={gather_dim}", gather_dim, ndim + 1)
    return x.unsqueeze(d), d


def check_one_per_rank(opname: str, x: torch.Tensor, dim_name: str, d: int, size: int, label: str) -> int:
    """``d`` counted from the front, checked to have one entry per rank (the values stacked on it)."""
    d = norm_dim(opname, f"{dim_name}={d}", d, x.dim())
    if x.shape[d] != size:
        raise ValueError(
            f"{opname}: a V side stacks the ranks' values on {dim_name}={d}, so dim {d} must have one entry per "
            f"rank of axis {label} ({size}); got shape {list(x.shape)}"
        )
    return d


def uneven_splits(begun: Begun, x: torch.Tensor, inputs: Any, outputs: Any, split: int,
                   concat: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Checked ``(input_split_sizes, output_split_sizes)``, or None for even pieces."""
    if inputs is None and outputs is None:
        return None
    opname, comm = begun.opname, begun.comm
    if split != 0 or concat != 0:
        raise ValueError(f"{opname}: uneven pieces (input_split_sizes=, output_split_sizes=) are rows of dim 0: "
                         f"src and dst V or S(0); got src={begun.src}, dst={begun.dst}")
    even = [x.shape[0] // comm.size] * comm.size  # the side not given: even pieces, as the published API
    found = []
    for name, sizes in (("input_split_sizes", inputs if inputs is not None else even),
                        ("output_split_sizes", outputs if outputs is not None else even)):
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise TypeError(f"{opname}: {name}= takes one size per rank, got {sizes!r}")
        sizes = tuple(sizes)
        if len(sizes) != comm.size:
            raise ValueError(f"{opname}: {name}= gives one size per rank of axis {comm.label} ({comm.size} ranks), "
                             f"got {len(sizes)}")
        found.append(sizes)
    total = sum(found[0])
    if isinstance(total, int) and isinstance(x.shape[0], int) and total != x.shape[0]:
        raise ValueError(f"{opname}: input_split_sizes={list(found[0])} add up to {total}, but dim 0 has "
                         f"size {x.shape[0]}")
    return found[0], found[1]


def varying_dim(opname: str, what: str, t: SpmdType, given: int | None, given_name: str, ndim: int) -> int | None:
    """The tensor dim a V/S(d) side lives on: S(d)'s d, else ``given`` (None: stacked on a new dim 0)."""
    if t is V:
        return None if given is None else norm_dim(opname, f"{given_name}={given}", given, ndim)
    dim = norm_dim(opname, f"{what}={t}", t.dim, ndim)
    if given is not None and norm_dim(opname, f"{given_name}={given}", given, ndim) != dim:
        raise ValueError(f"{opname}: {what}={t} already says dim {t.dim}; {given_name}={given} disagrees with it")
    return dim
