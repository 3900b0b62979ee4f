"""A random stream forked for a region, on plain ranks and on simulated ones (Megatron's RNG tracker, on the CPU).

Megatron's ``get_cuda_rng_tracker().fork()`` runs a region (attention dropout, sequence-parallel dropout)
in the model-parallel stream, seeded per tp rank, and puts the default stream back afterwards. Its CUDA
states do not exist on the CPU; :func:`fork` does the same with torch's CPU generator, and under the
rank simulator (``LocalTensorMode``, whose ranks each keep their own generator state) with every
simulated rank's state.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def fork(seed: Any) -> Iterator[None]:
    """Inside: torch's stream seeded with ``seed`` (a per-rank int seeds each simulated rank); outside as before."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    lm = enabled_local_tensor_mode()
    states = getattr(lm, "_per_rank_rng_states", None) if lm is not None else None
    saved = dict(states) if states else None
    plain = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        if saved is not None:
            states.clear()
            states.update(saved)
        torch.set_rng_state(plain)
