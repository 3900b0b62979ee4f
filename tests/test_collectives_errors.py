"""Bad arguments to typed communication fail before any communication, with these exact messages."""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh

import spmd_types as spmd
from spmd_types._comm.collectives import all_gather, all_reduce, all_to_all, redistribute, reduce_scatter
from spmd_types._comm.reinterpret_convert import convert, reinterpret
from spmd_types.testing import CommCounter

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def mesh():
    m = fake_mesh((4,), ("tp",))
    with spmd.set_current_mesh(m):
        yield m


def _raises(exc, fn, *args, **kwargs) -> BaseException:
    with CommCounter() as comms:
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
    assert comms.total == 0, "an error must come before any communication"
    return info.value


def test_unknown_axis(mesh):
    err = _raises(ValueError, all_reduce, torch.ones(4), "pp")
    assert str(err) == "spmd.all_reduce: unknown mesh axis 'pp'; the current mesh has axes 'tp'"


def test_src_not_a_type(mesh):
    err = _raises(TypeError, all_gather, torch.ones(4), "tp", src="V", dst=R)
    assert str(err) == (
        "spmd.all_gather: src must be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or spmd.S(d)), "
        "got 'V' of type str"
    )


def test_dst_not_a_type(mesh):
    err = _raises(TypeError, reduce_scatter, torch.ones(4), "tp", src=P, dst=0)
    assert str(err) == (
        "spmd.reduce_scatter: dst must be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or spmd.S(d)), "
        "got 0 of type int"
    )


def test_transition_not_in_table(mesh):
    err = _raises(spmd.SpmdTypeError, all_gather, torch.ones(4), "tp", src=P, dst=R)
    assert err.rule == (
        "spmd.all_gather cannot take src=P to dst=R: seed 003's forward/backward table has no such "
        "all_gather, so it has no backward."
    )
    assert err.seen == (("op", "spmd.all_gather(x, 'tp', src=spmd.P, dst=spmd.R)"), ("allowed", "V -> R, V -> I"))
    assert err.fixes == ("spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)",)


def test_convert_not_in_table_lists_allowed(mesh):
    err = _raises(spmd.SpmdTypeError, convert, torch.ones(4), "tp", src=P, dst=R)
    assert err.seen[1] == ("allowed", "R -> I, I -> R, R -> V, I -> V, R -> P, I -> P, V -> P")
    assert err.fixes == ("spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)",)


def test_src_does_not_match_the_tensor(mesh):
    with spmd.typecheck():
        x = spmd.assert_type(torch.ones(4, 2), {"tp": P})
        err = _raises(spmd.SpmdTypeError, all_gather, x, "tp", src=V, dst=R)
    assert err.rule == "spmd.all_gather's src= must be the input's type on the axis: src=V, but the tensor is P on axis 'tp'."
    assert err.seen == (
        ("op", "spmd.all_gather(x, 'tp', src=spmd.V, dst=spmd.R)"),
        ("input", "f32[4,2] {tp: P}"),
        ("axis", "'tp': P is not V"),
    )
    assert err.fixes == ("spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)",)
    assert err.source.endswith("test_collectives_errors.py:27: fn(*args, **kwargs)")  # the innermost user frame


def test_shard_accepts_varying_and_back(mesh):
    with spmd.typecheck():
        x = spmd.assert_type(torch.ones(4, 8), {"tp": S(1)})
        assert spmd.get_type(all_gather(x, "tp", src=V, dst=I)) == {"tp": I}
        y = spmd.assert_type(torch.ones(4, 8), {"tp": V})
        assert spmd.get_type(all_gather(y, "tp", src=S(0), dst=R)) == {"tp": R}


def test_non_divisible_reduce_scatter(mesh):
    err = _raises(ValueError, reduce_scatter, torch.ones(2, 6), "tp", src=P, dst=S(1))
    assert str(err) == (
        "spmd.reduce_scatter: dst=S(1) splits tensor dim 1 (size 6) into 4 equal shards on axis 'tp'; "
        "6 is not divisible by 4. Pass sizes= (one per rank) for uneven shards."
    )


def test_non_divisible_convert(mesh):
    err = _raises(ValueError, convert, torch.ones(5), "tp", src=R, dst=S(-1))
    assert str(err) == (
        "spmd.convert: dst=S(0) splits tensor dim 0 (size 5) into 4 equal shards on axis 'tp'; "  # S(-1), counted
        "5 is not divisible by 4. Pass sizes= (one per rank) for uneven shards."
    )


def test_stacked_varying_needs_one_entry_per_rank(mesh):
    err = _raises(ValueError, reduce_scatter, torch.ones(3, 2), "tp", src=P, dst=V)
    assert str(err) == (
        "spmd.reduce_scatter: dst=V keeps index `rank` of dim 0, so dim 0 must have one entry per rank of "
        "axis 'tp' (4); got shape [3, 2]"
    )
    err = _raises(ValueError, convert, torch.ones(3, 2), "tp", src=R, dst=V)
    assert str(err) == (
        "spmd.convert: dst=V keeps x[rank], so dim 0 must have one entry per rank of axis 'tp' (4); got shape [3, 2]"
    )


def test_dim_out_of_range(mesh):
    err = _raises(ValueError, all_gather, torch.ones(4, 2), "tp", src=S(2), dst=R)
    assert str(err) == "spmd.all_gather: src=S(2) names tensor dim 2, but the tensor has 2 dims"


def test_gather_dim_disagrees_with_shard(mesh):
    err = _raises(ValueError, all_gather, torch.ones(4, 2), "tp", src=S(0), dst=R, gather_dim=1)
    assert str(err) == "spmd.all_gather: src=S(0) already says dim 0; gather_dim=1 disagrees with it"


def test_all_to_all_v_to_v_splits_and_concatenates_dim_0_by_default(mesh):
    err = _raises(ValueError, all_to_all, torch.ones(3, 4), "tp", src=V, dst=V)
    assert str(err) == (
        "spmd.all_to_all: split_dim=0 splits tensor dim 0 (size 3) into 4 equal shards on axis 'tp'; "
        "3 is not divisible by 4."
    )


def test_bad_reduce_op(mesh):
    err = _raises(ValueError, all_reduce, torch.ones(4), "tp", op="prod")
    assert str(err) == "spmd.all_reduce: op must be 'sum', 'avg', 'max' or 'min', got 'prod'"
    err = _raises(ValueError, reduce_scatter, torch.ones(4), "tp", op="max")
    assert str(err) == "spmd.reduce_scatter: op must be 'sum' or 'avg', got 'max'"


def test_sizes_of_wrong_length(mesh):
    err = _raises(ValueError, all_gather, torch.ones(4), "tp", src=S(0), dst=R, sizes=[1, 2])
    assert str(err) == "spmd.all_gather: sizes= gives one shard size per rank of axis 'tp' (4 ranks), got [1, 2]"


def test_reinterpret_not_in_table(mesh):
    err = _raises(spmd.SpmdTypeError, reinterpret, torch.ones(4), "tp", src=P, dst=R)
    assert err.seen[1] == ("allowed", "R -> I, R -> V, R -> P, I -> R, I -> V, V -> P")


def test_redistribute_plain_varying_is_ambiguous(mesh):
    err = _raises(ValueError, redistribute, torch.ones(4, 4), "tp", src=S(0), dst=V)
    assert str(err) == (
        "spmd.redistribute: S(0) -> V does not say which dims to split and concatenate; use src=S(i), "
        "dst=S(j), or spmd.all_to_all(..., split_dim=, concat_dim=)"
    )


def test_flattened_axes_in_mesh_order():
    m = fake_mesh((2, 2), ("dp", "tp"))
    with spmd.set_current_mesh(m):
        err = _raises(ValueError, all_reduce, torch.ones(4), ("tp", "dp"))
    assert str(err) == "spmd.all_reduce: list the axes of a flattened collective in mesh order, ('dp', 'tp'), not ('tp', 'dp')"
