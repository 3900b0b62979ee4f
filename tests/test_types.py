"""Type values: canonical, immutable, short names, cotangent duality, PartitionSpec."""

import pickle

import pytest

import spmd_types as spmd
from spmd_types._core.types import TypeMap


def test_long_names_alias_short_ones():
    assert spmd.Replicate is spmd.R and spmd.Invariant is spmd.I
    assert spmd.Varying is spmd.V and spmd.Partial is spmd.P and spmd.Shard is spmd.S


def test_types_are_canonical_and_printable():
    assert spmd.S(0) is spmd.S(0) and spmd.S(-1) is not spmd.S(1)
    assert [str(t) for t in (spmd.R, spmd.I, spmd.V, spmd.P, spmd.S(2))] == ["R", "I", "V", "P", "S(2)"]
    assert spmd.R.long_name == "Replicate" and spmd.S(1).long_name == "Shard(1)"
    assert pickle.loads(pickle.dumps(spmd.S(3))) is spmd.S(3)
    assert pickle.loads(pickle.dumps(spmd.P)) is spmd.P


def test_types_are_immutable():
    with pytest.raises(AttributeError):
        spmd.R._short = "X"


def test_shard_needs_an_int():
    with pytest.raises(TypeError, match="S\\(dim\\) needs an int tensor dim, got 'x'"):
        spmd.S("x")


@pytest.mark.parametrize(
    "fwd, bwd",
    [(spmd.R, spmd.P), (spmd.P, spmd.R), (spmd.I, spmd.I), (spmd.V, spmd.V), (spmd.S(1), spmd.S(1))],
)
def test_backward_type_swaps_r_and_p(fwd, bwd):
    assert spmd.backward_type(fwd) is bwd
    assert spmd.backward_type(spmd.backward_type(fwd)) is fwd


def test_backward_type_rejects_non_types():
    with pytest.raises(TypeError, match="backward_type needs an SPMD type"):
        spmd.backward_type("R")


def test_shard_is_varying():
    assert spmd.S(0).is_varying and spmd.V.is_varying and not spmd.R.is_varying


def test_type_maps_are_interned():
    a = TypeMap.of({"tp": spmd.R, "dp": spmd.V})
    b = TypeMap.of([("dp", spmd.V), ("tp", spmd.R)])
    assert a is b
    assert a.format(("dp", "tp")) == "{dp: V, tp: R}"
    assert a.backward() is TypeMap.of({"dp": spmd.V, "tp": spmd.P})
    assert pickle.loads(pickle.dumps(a)) is a


def test_partition_spec():
    spec = spmd.PartitionSpec(None, "tp", ("dp", "tp"))
    assert spec[1] == "tp" and repr(spec) == "PartitionSpec(None, 'tp', ('dp', 'tp'))"
    with pytest.raises(TypeError, match="PartitionSpec entries are None, an axis name or a tuple"):
        spmd.PartitionSpec(3)
