"""Named random streams on the CPU, on plain ranks and on simulated ones (Megatron's RNG tracker, on the CPU).

Megatron's ``get_cuda_rng_tracker().fork()`` runs a region (attention dropout) in the model-parallel
stream, seeded per tp rank, which continues where it stopped the last time; the default stream is put
back afterwards. Its CUDA states do not exist on the CPU; :class:`Streams` does the same with torch's
CPU generator, and under the rank simulator (``LocalTensorMode``, whose ranks each keep their own
generator state) with every simulated rank's state.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch


def _state() -> Any:
    """The generator state of every simulated rank (a copy of the simulator's table), or torch's one state."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    lm = enabled_local_tensor_mode()
    states = getattr(lm, "_per_rank_rng_states", None) if lm is not None else None
    return ("ranks", dict(states)) if states else ("plain", torch.get_rng_state())


def _restore(state: Any) -> None:
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    kind, value = state
    if kind == "ranks":
        table = enabled_local_tensor_mode()._per_rank_rng_states
        table.clear()
        table.update(value)
    else:
        torch.set_rng_state(value)


class Streams:
    """Named streams: ``with streams.fork(name, seed):`` runs in stream ``name`` (seeded by ``seed`` the first time).

    Each simulation (each ``LocalTensorMode``) has streams of its own, as each new process would.
    """

    def __init__(self) -> None:
        self.plain: dict[str, Any] = {}
        self.simulated: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def fork(self, name: str, seed: Any) -> Iterator[None]:
        from torch.distributed._local_tensor import enabled_local_tensor_mode

        lm = enabled_local_tensor_mode()
        saved = self.plain if lm is None else self.simulated.setdefault(lm, {})
        outer = _state()
        if name in saved:
            _restore(saved[name])
        else:
            torch.manual_seed(seed)  # a per-rank int seeds each simulated rank
        try:
            yield
        finally:
            saved[name] = _state()
            _restore(outer)


@contextlib.contextmanager
def fork(seed: Any) -> Iterator[None]:
    """Inside: torch's stream seeded with ``seed`` (a per-rank int seeds each simulated rank); outside as before."""
    with Streams().fork("stream", seed):
        yield
