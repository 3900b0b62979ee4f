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

import torch

from .call import norm_dim

__all__ = ["stacked_input", "check_one_per_rank"]


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
