"""Per-rank ints on the rank simulator: a value that differs by simulated rank, as torch's ``SymInt``."""

from __future__ import annotations

from typing import Any

import torch

from .._torch.private import prepare_collective_groups, simulator

__all__ = ["group_index", "per_rank_int"]


def group_index(group: Any, ranks: frozenset[int]) -> Any:
    """Each simulated rank's index in its copy of ``group`` (torch's simulator lays groups out by offset)."""
    members, offsets, _ = prepare_collective_groups(group)
    index = {o + r: i for o in offsets for i, r in enumerate(members)}
    return per_rank_int({r: index[r] for r in ranks})


def per_rank_int(values: dict[int, int]) -> Any:
    """A plain int where every rank holds the same one, else a per-rank ``SymInt``."""
    LocalIntNode = simulator().LocalIntNode

    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return torch.SymInt(LocalIntNode(values))
