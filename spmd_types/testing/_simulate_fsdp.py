"""FSDP2 on simulated ranks: what ``fully_shard`` needs of torch's simulator, taught for one simulation.

torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) cannot run under ``LocalTensorMode`` as it is:

* it frees and refills each unsharded parameter by resizing its storage (``alloc_storage`` and
  ``free_storage`` in ``_fsdp_param.py``), and a LocalTensor, a wrapper with no storage of its own,
  refuses ("Attempted to call resize_() on an invalid python storage");
* it picks each rank's shard of a parameter by indexing a list of chunks with the rank's index in the
  shard group, which on simulated ranks is a per-rank int (a Python list takes plain ints only), or,
  where the shard group is the default group (a 1-D mesh), this process's rank on every rank;
* with a gradient divide factor other than the shard group's size (``set_gradient_divide_factor``) it
  reduce-scatters with ``ReduceOp.PREMUL_SUM(1 / factor)``, whose factor the simulator cannot read
  ("PREMUL_SUM: need to add binding for scaling factor").

Inside :func:`fsdp_on_simulated_ranks` these run rank by rank: each simulated rank's own storage is
resized, FSDP's mesh infos hold each rank's own index, and each rank takes its own chunk; a
``PREMUL_SUM`` reduce-scatter becomes FSDP's own alternative, a sum with the factor divided out before
and after it (``force_sum_reduction_for_comms``, the path FSDP takes for float16 and on MTIA). The rest of
FSDP runs unchanged: its all-gather and reduce-scatter are torch's collectives, which the simulator
runs on every rank's values, so what each simulated rank holds is what FSDP computed for it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from .._torch.private import fsdp_slots, int_on_rank, local_tensors_of, simulator
from ._rank_ints import group_index

__all__ = ["fsdp_on_simulated_ranks"]


@contextlib.contextmanager
def fsdp_on_simulated_ranks() -> Iterator[None]:
    """Inside, FSDP2's storage resizing, shard picking and group ranks run per simulated rank (see the module)."""
    try:
        slots = fsdp_slots()
    except ImportError:  # pragma: no cover - a torch without FSDP2
        yield
        return
    saved = [(owner, name, vars(owner)[name]) for owner, name in slots]
    try:
        for owner, name, current in saved:
            setattr(owner, name, _PER_RANK[name](current))
        yield
    finally:
        for owner, name, current in saved:
            setattr(owner, name, current)


def _each_rank(resize: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``alloc_storage`` / ``free_storage`` applied to every simulated rank's own tensor of a LocalTensor."""
    @functools.wraps(resize)
    def per_rank(tensor: torch.Tensor) -> None:
        locals_ = local_tensors_of(tensor)
        for t in (locals_.values() if locals_ is not None else (tensor,)):
            resize(t)

    return per_rank


class _Chunks(list):
    """FSDP's chunks of a parameter; indexed with a per-rank int, each simulated rank takes its own chunk."""

    def __getitem__(self, index: Any) -> Any:
        node = getattr(index, "node", None)
        if not isinstance(index, torch.SymInt) or not isinstance(node, simulator().LocalIntNode):
            return super().__getitem__(index)
        pieces = {}
        for rank in sorted(simulator().enabled_local_tensor_mode().ranks):
            chunk = local_tensors_of(super().__getitem__(int_on_rank(node, rank)))
            if chunk is None:
                raise RuntimeError("fully_shard on simulated ranks: a parameter that is one plain tensor, not one per "
                                   "simulated rank; make the model inside the simulation (in build())")
            pieces[rank] = chunk[rank].detach()  # a view of this rank's own parameter
        shapes = {tuple(p.shape) for p in pieces.values()}
        if len(shapes) > 1:
            raise NotImplementedError(
                f"fully_shard on simulated ranks: the ranks' shards have different shapes ({sorted(shapes)}); "
                "the simulation runs FSDP on parameters whose sharded dim splits evenly over the shard group")
        return simulator().LocalTensor(pieces)


def _chunks(chunk_with_empty: Callable[..., list]) -> Callable[..., list]:
    @functools.wraps(chunk_with_empty)
    def chunks(*args: Any, **kwargs: Any) -> list:
        return _Chunks(chunk_with_empty(*args, **kwargs))

    return chunks


def _ranks_per_rank(post_init: Callable[[Any], None]) -> Callable[[Any], None]:
    """A mesh info's ``shard_mesh_rank`` / ``replicate_mesh_rank``: each simulated rank's index in its group."""

    @functools.wraps(post_init)
    def per_rank(self: Any) -> None:
        post_init(self)
        mode = simulator().enabled_local_tensor_mode()
        if mode is None:
            return
        for rank_attr, group_attr in (("shard_mesh_rank", "shard_process_group"),
                                      ("replicate_mesh_rank", "replicate_process_group")):
            group = getattr(self, group_attr, None)
            if group is not None and group.size() > 1:
                setattr(self, rank_attr, group_index(group, frozenset(mode.ranks)))

    return per_rank


def _summed(divide_factors: Callable[..., tuple]) -> Callable[..., tuple]:
    """FSDP's choice of reduce ops, with a ``PREMUL_SUM`` reduce-scatter replaced by a sum and divisions."""
    import torch.distributed as dist

    @functools.wraps(divide_factors)
    def factors(*args: Any) -> tuple:
        chosen = divide_factors(*args)
        if getattr(chosen[2], "op", chosen[2]) != dist.ReduceOp.PREMUL_SUM:
            return chosen
        return divide_factors(*args[:5], True)  # (groups, reduce dtype, device type, factor, force sum)

    return factors


_PER_RANK: dict[str, Callable[[Any], Any]] = {
    "_get_gradient_divide_factors": _summed,
    "alloc_storage": _each_rank,
    "free_storage": _each_rank,
    "_chunk_with_empty": _chunks,
    "__post_init__": _ranks_per_rank,
}
