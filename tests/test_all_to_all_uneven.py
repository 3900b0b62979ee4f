"""all_to_all with uneven pieces (MoE token routing), V -> V on dim 0, on simulated ranks against its meaning.

Rank r sends rows ``input_split_sizes[j]`` (its own list) of its tensor to rank j
and receives ``output_split_sizes[j]`` rows from each j, in rank order. The split
lists differ per rank, so they come from a typed count exchange and ``tolist()``
(per-rank ints on simulated ranks), as torchtitan's token dispatcher does.
"""

from __future__ import annotations

import torch

import spmd_types as spmd
from spmd_types.testing import CommCounter, per_rank, rank_values, simulate

N = 4
SENDS = {0: [1, 0, 2, 1], 1: [0, 2, 1, 0], 2: [3, 1, 0, 0], 3: [1, 1, 1, 1]}  # SENDS[r][j]: rows r sends to j


# made here, outside any simulation (under LocalTensorMode a new tensor is one per rank)
ROWS = {r: torch.randn(sum(SENDS[r]), 3, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        for r in range(N)}


def _rows(r: int) -> torch.Tensor:
    return ROWS[r].clone()


def _received(r: int) -> torch.Tensor:
    """What rank r receives: from each rank j in order, the piece j sends to r."""
    return torch.cat([ROWS[j][sum(SENDS[j][:r]):sum(SENDS[j][:r]) + SENDS[j][r]] for j in range(N)])


EXPECTED = {r: _received(r) for r in range(N)}
GRAD_OUT = {r: torch.full_like(EXPECTED[r], float(r + 1)) for r in range(N)}


def _route(x, counts):
    recv = spmd.all_to_all(counts.view(N, 1), "ep", src=spmd.V, dst=spmd.V).view(-1)  # even: the count exchange
    return spmd.all_to_all(x, "ep", src=spmd.V, dst=spmd.V, input_split_sizes=counts.tolist(),
                           output_split_sizes=recv.tolist())


def test_forward_is_the_exchange_of_pieces_and_backward_sends_them_back():
    with simulate((N,), ("ep",), ranks="local", device="cpu"), spmd.typecheck():
        counts = spmd.assert_type(per_rank(lambda r: torch.tensor(SENDS[r])), {"ep": spmd.V})
        x = spmd.assert_type(per_rank(_rows).requires_grad_(), {"ep": spmd.V})
        with CommCounter() as forward:
            y = _route(x, counts)
        assert spmd.get_type(y) == {"ep": spmd.V}
        for r, got in rank_values(y).items():
            torch.testing.assert_close(got, EXPECTED[r], rtol=0, atol=0)
        g = per_rank(lambda r: GRAD_OUT[r].clone())
        with CommCounter() as backward:
            y.backward(g)
        assert forward.counts == {"all_to_all": 2} and backward.counts == {"all_to_all": 1}
        # adjoint identity: <A x, g> = <x, A^T g>, summed over ranks
        lhs = sum((rank_values(y)[r] * rank_values(g)[r]).sum() for r in range(N))
        rhs = sum((rank_values(x)[r] * rank_values(x.grad)[r]).sum() for r in range(N))
        torch.testing.assert_close(lhs, rhs)
        for r in range(N):  # each row of x gets the factor of the rank it went to
            want = torch.cat([torch.full((SENDS[r][j], 3), float(j + 1), dtype=torch.float64) for j in range(N)])
            torch.testing.assert_close(rank_values(x.grad)[r], want)


def test_erased_gives_the_same_values():
    with simulate((N,), ("ep",), ranks="local", device="cpu"):
        counts = per_rank(lambda r: torch.tensor(SENDS[r]))
        y = _route(per_rank(_rows), counts)
        for r, got in rank_values(y).items():
            torch.testing.assert_close(got, EXPECTED[r], rtol=0, atol=0)


def test_inplace_all_reduce_writes_into_the_tensor_and_retypes_it():
    with simulate((N,), ("ep",), ranks="local", device="cpu"), spmd.typecheck():
        x = spmd.assert_type(per_rank(lambda r: torch.full((2,), float(r))), {"ep": spmd.P})
        out = spmd.all_reduce(x, "ep", src=spmd.P, dst=spmd.R, inplace=True)
        assert out is x and spmd.get_type(x) == {"ep": spmd.R}
        for v in rank_values(x).values():
            assert torch.equal(v, torch.full((2,), 6.0))
