"""Two bugs the fuzzer found (issue 11, item 6), pinned.

1. ``spmd.all_to_all(x, ax, src=S(d), dst=S(d))`` scrambled blocks. Seed 003:
   ``all_to_all(S(i) -> S(j))`` maps the shards of dim i of a tensor to the
   shards of dim j of the same tensor, ``concat(xs, i).chunk(n, j)``; for
   ``i = j`` that is ``xs`` itself. So it is the identity, with no
   communication, forward and backward, in local and global SPMD (the same
   answer ``redistribute(src=S(d), dst=S(d))`` gives).
2. ``redistribute(x, ax, src=X, dst=X)`` returned ``x`` without checking ``src``
   against ``x``'s type.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import CommCounter, denote, pair, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def tp4():
    mesh = fake_mesh((4,), ("tp",))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        yield mesh



def _spec_all_to_all(xs: list[torch.Tensor], i: int, j: int) -> list[torch.Tensor]:
    """Seed 003's all_to_all(S(i) -> S(j)) on the per-rank list: concat(xs, i).chunk(n, j)."""
    return list(torch.cat(xs, i).chunk(len(xs), j))


@pytest.mark.parametrize("i,j", [(0, 0), (1, 1), (0, 1), (1, 0)])
def test_all_to_all_matches_the_seed_spec(tp4, i, j):
    x = random_value(tp4, {"tp": V}, (4, 8), seed=i * 2 + j)
    x.requires_grad_()
    with CommCounter() as comms:
        y = spmd.all_to_all(x, "tp", src=S(i), dst=S(j))
    xs = [rank_values(x)[r] for r in range(4)]
    want = _spec_all_to_all(xs, i, j)
    for r, v in rank_values(y).items():
        torch.testing.assert_close(v, want[r])
    expected = {} if i == j else {"all_to_all": 1}
    assert comms.counts == expected, "S(d) -> S(d) moves nothing"
    g = random_value(tp4, {"tp": V}, tuple(y.shape), seed=9)
    with CommCounter() as comms:
        (gx,) = torch.autograd.grad(y, x, g)
    assert comms.counts == expected
    torch.testing.assert_close(pair(y, g, tp4, {"tp": S(j)}), pair(x, gx, tp4, {"tp": S(i)}))


def test_all_to_all_same_shard_needs_no_divisible_dim(tp4):
    x = random_value(tp4, {"tp": V}, (3, 5))  # 5 is not divisible by 4: nothing is split
    with spmd.typecheck():
        t = spmd.assert_type(x, {"tp": S(1)})
        with CommCounter() as comms:
            y = spmd.all_to_all(t, "tp", src=S(1), dst=S(1))
        assert comms.total == 0
        assert spmd.get_type(y) == {"tp": S(1)}
    assert all(torch.equal(v, rank_values(x)[r]) for r, v in rank_values(y).items())


def test_all_to_all_same_shard_in_global_spmd(tp4):
    x = random_value(tp4, {"tp": V}, (2, 8))
    with spmd.typecheck(local=False):
        t = spmd.assert_type(x, {"tp": S(0)})
        with CommCounter() as comms:
            y = spmd.all_to_all(t, "tp", src=S(0), dst=S(0))
        assert comms.total == 0
        assert spmd.get_type(y) == {"tp": S(0)}
        assert spmd.get_partition_spec(y) == spmd.get_partition_spec(t)
        z = spmd.all_to_all(t, "tp", src=S(0), dst=S(1))  # a real move, for contrast
        assert spmd.get_partition_spec(z) != spmd.get_partition_spec(t)
    torch.testing.assert_close(denote(y, tp4, {"tp": S(0)}), denote(x, tp4, {"tp": S(0)}))
    torch.testing.assert_close(denote(z, tp4, {"tp": S(1)}), denote(x, tp4, {"tp": S(0)}))


def test_redistribute_same_type_checks_src(tp4):
    x = random_value(tp4, {"tp": V}, (4, 2))
    with spmd.typecheck():
        v = spmd.assert_type(x, {"tp": V})
        with CommCounter() as comms:
            with pytest.raises(spmd.SpmdTypeError) as info:
                spmd.redistribute(v, "tp", src=R, dst=R)
        assert comms.total == 0
        err = info.value
        assert err.rule == (
            "spmd.redistribute's src= must be the input's type on the axis: src=R, but the tensor is V on axis 'tp'."
        )
        assert err.seen == (("op", "spmd.redistribute(x, 'tp', src=spmd.R, dst=spmd.R)"),
                            ("input", "f32[4,2] {tp: V}"), ("axis", "'tp': V is not R"))
        assert err.fixes == ("spmd.all_gather(x, 'tp', src=spmd.V, dst=spmd.R)",)
        s1 = spmd.assert_type(x, {"tp": S(1)})
        assert spmd.redistribute(s1, "tp", src=S(1), dst=S(1)) is s1
        assert spmd.redistribute(s1, "tp", src=V, dst=V) is s1  # in local SPMD, V and S(d) agree
        with pytest.raises(spmd.SpmdTypeError):
            spmd.redistribute(s1, "tp", src=S(0), dst=S(0))
    assert spmd.redistribute(x, "tp", src=R, dst=R) is x  # outside typecheck: nothing is checked
