"""The published spmd_types API (the peer package's, which torchtitan calls), on our implementation.

Each test states one behaviour a caller relies on: the import layout and
names, in-place typing, reading types, mutate_type, local_map's declarations,
local(), the registrations, trace(), traceback filtering, the DTensor helpers
and the shorthand ops. Where we deliberately differ from the published package,
a test shows our behaviour (docs/published_api.md lists the differences).
"""

from __future__ import annotations

import contextlib
import io
import logging
import pathlib
import re
import subprocess
import sys
import traceback

import pytest
import torch
from conftest import by_region
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_types as spmd
from spmd_types.testing import CommCounter, per_rank, rank_values, simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
PS = spmd.PartitionSpec


@pytest.fixture
def local():
    """(dp=2, tp=4) on fake ranks, current, local SPMD checking."""
    with simulate((2, 4), ("dp", "tp")) as mesh, spmd.typecheck():
        yield mesh


@pytest.fixture
def glob():
    """(dp=2, tp=4) on fake ranks, current, global SPMD checking."""
    with simulate((2, 4), ("dp", "tp")) as mesh, spmd.typecheck(local=False):
        yield mesh


def _typed(types, *shape, grad=False):
    t = torch.randn(*shape or (4,), requires_grad=grad)
    spmd.assert_type(t, types)
    return t


# ---------------------------------------------------------------------------
# G1: modules, names, the type values

# every spmd.<name> torchtitan 0.3.0 writes (grep of its source)
TORCHTITAN_NAMES = (
    "S", "R", "I", "V", "P", "assert_type", "is_type_checking", "PerMeshAxisSpmdType", "no_typecheck", "mutate_type",
    "local_map", "PartitionSpec", "redistribute", "local", "register_autograd_function", "get_local_type",
    "register_local_autograd_function", "Shard", "reinterpret_mesh", "current_mesh", "all_to_all", "set_current_mesh",
    "PerMeshAxisSpmdTypes", "spmd_type_to_dtensor_placement", "shard",
)


def test_every_name_torchtitan_uses_exists():
    missing = [n for n in TORCHTITAN_NAMES if not hasattr(spmd, n)]
    assert missing == []


def test_the_published_modules():
    from spmd_types.checker import is_type_checking, local_map, no_typecheck, typecheck
    from spmd_types.runtime import get_local_type, get_partition_spec, has_local_type
    from spmd_types.types import (
        DimSharding,
        LocalSpmdType,
        PerMeshAxisLocalSpmdType,
        PerMeshAxisSpmdType,
        PerMeshAxisSpmdTypes,
        TensorSharding,
    )

    assert (typecheck, local_map, no_typecheck, is_type_checking) == (
        spmd.typecheck, spmd.local_map, spmd.no_typecheck, spmd.is_type_checking)
    assert (get_local_type, get_partition_spec, has_local_type) == (
        spmd.get_local_type, spmd.get_partition_spec, spmd.has_local_type)
    assert spmd.runtime.mutate_type is spmd.mutate_type and spmd.checker.typecheck is spmd.typecheck
    assert spmd.types.Shard is spmd.Shard
    assert PerMeshAxisSpmdType is spmd.types.AxisType and isinstance(spmd.R, PerMeshAxisLocalSpmdType)
    assert TensorSharding(None, "tp") == (None, "tp") and repr(TensorSharding("tp")) == "TensorSharding('tp')"
    for alias in (LocalSpmdType, PerMeshAxisSpmdTypes, DimSharding):
        assert alias is not None

    def annotated(t: spmd.PerMeshAxisSpmdType) -> spmd.PerMeshAxisSpmdTypes:  # evaluated at def time
        return {"tp": t}

    assert annotated(R) == {"tp": R}


def test_shard_is_a_class_and_types_are_canonical():
    assert isinstance(S(1), spmd.Shard) and S(1).dim == 1 and spmd.Shard(1) is S(1)
    assert not isinstance(R, spmd.Shard) and not isinstance(V, spmd.Shard)
    assert (spmd.Replicate, spmd.Invariant, spmd.Varying, spmd.Partial) == (R, I, V, P)
    assert [str(t) for t in (R, I, V, P, S(0), S(-1))] == ["R", "I", "V", "P", "S(0)", "S(-1)"]
    assert S(0) == S(0) and S(0) != S(1) and S(0) != V
    assert (R.value, V.value, isinstance(S(0), spmd.PerMeshAxisLocalSpmdType)) == ("R", "V", False)


def test_backward_type_as_a_method_and_a_function():
    for t, g in ((R, P), (P, R), (I, I), (V, V), (S(2), S(2))):
        assert t.backward_type() is g and spmd.backward_type(t) is g


def test_spmd_type_error_is_a_type_error_and_a_runtime_error():
    """A TypeError (CONTRACT section 10) and, as the published SpmdTypeError is, a RuntimeError: code written for
    either catches it."""
    assert issubclass(spmd.SpmdTypeError, TypeError) and issubclass(spmd.SpmdTypeError, RuntimeError)


def test_partition_spec_entries_and_normalizing(local):
    tp = local.get_group("tp")
    assert PS(spmd.MeshAxis.of(tp), None) == (spmd.MeshAxis.of(4, 1), None)
    assert PS(tp, ("dp", "tp"))[0] is tp  # a group entry is kept as given until normalized
    assert spmd.normalize_partition_spec(PS(tp, ("dp", spmd.MeshAxis.of(4, 1)), None)) == PS("tp", ("dp", "tp"), None)
    assert spmd.normalize_axis("tp") == spmd.MeshAxis.of(tp) == spmd.normalize_axis(tp)
    assert spmd.normalize_mesh(["dp", tp]) == frozenset({spmd.MeshAxis.of(2, 4), spmd.MeshAxis.of(4, 1)})
    assert (spmd.format_axis("tp"), spmd.format_axis(tp)) == ("'tp'", "tp")
    with pytest.raises(TypeError) as info:
        PS(3)
    assert str(info.value) == "PartitionSpec entries are None, an axis name or a tuple of axis names; got 3"


def test_importing_the_package_imports_the_checker():
    """Difference: the published package keeps its checker out of `import spmd_types`; ours imports it (LTensor)."""
    code = "import sys, spmd_types; print('spmd_types._checker.tensor' in sys.modules, spmd_types.runtime.__name__)"
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "True spmd_types.runtime"  # and spmd.runtime needs no import of its own


# ---------------------------------------------------------------------------
# G5: assert_type and its relatives


def test_assert_type_types_the_object_given(local):
    x = torch.randn(4, 6)
    assert spmd.assert_type(x, {"dp": V, "tp": R}) is x
    assert spmd.get_type(x) == {"dp": V, "tp": R}
    h = torch.randn(4, requires_grad=True) * 2  # a non-leaf: typed in place too, autograd history kept
    spmd.assert_type(h, {"dp": V, "tp": V})
    assert spmd.get_type(h) == {"dp": V, "tp": V} and h.grad_fn is not None


def test_a_list_or_tuple_is_typed_element_by_element(local):
    xs = [torch.randn(2), torch.randn(3)]
    out = spmd.assert_type(xs, {"dp": V, "tp": R})
    assert type(out) is list and all(o is x for o, x in zip(out, xs))
    assert [spmd.get_type(x) for x in xs] == [{"dp": V, "tp": R}] * 2
    pair = spmd.assert_type((torch.randn(2), torch.randn(2)), {"dp": R, "tp": R})
    assert type(pair) is tuple and spmd.get_type(pair[1]) == {"dp": R, "tp": R}


def test_a_bare_type_means_every_axis(local):
    assert spmd.get_type(spmd.assert_type(torch.randn(2), R)) == {"dp": R, "tp": R}
    assert spmd.get_type(spmd.assert_type(torch.randn(2, 4), S(1))) == {"dp": S(1), "tp": S(1)}
    with spmd.set_current_mesh(None, local_axes=()), pytest.raises(spmd.SpmdTypeError):
        spmd.assert_type(_typed({"dp": V, "tp": V}), R)


def test_a_bare_type_needs_a_mesh():
    with spmd.typecheck(), pytest.raises(RuntimeError) as info:
        spmd.assert_type(torch.randn(2), R)
    assert str(info.value) == "assert_type(x, spmd.R) types every axis of the current mesh, and none is current"


def test_outside_typecheck_assert_type_remembers_and_typecheck_applies_it():
    """Choice 4: outside typecheck() the tensor stays plain (erased: no cost) and remembers its type; the next
    typecheck() types it (torchtitan types its parameters at parallelize time, outside typecheck())."""
    with simulate((2,), ("tp",)):
        x = torch.randn(2)
        assert spmd.assert_type(x, {"tp": V}) is x and type(x) is torch.Tensor
        assert spmd.has_local_type(x) and spmd.get_local_type(x) == by_region({"tp": V})
        with spmd.typecheck():
            assert type(x) is spmd.LTensor and spmd.get_type(x) == {"tp": V}


def test_an_untyped_tensors_type_covers_every_axis(local):
    """Difference: a type here covers every typed axis of the mesh (choice 1): an omitted axis is V (R in global)."""
    x = spmd.assert_type(torch.randn(2), {"dp": R})
    assert spmd.get_type(x) == {"dp": R, "tp": V}
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(x, {"tp": I})  # the published API would add tp: I to the type here
    assert info.value.rule == "Type assertion failed: the tensor is V on axis 'tp', and the assertion says I."


def test_asserts_refine_named_axes_only(local):
    x = spmd.assert_type(torch.randn(4, 8), {"dp": R, "tp": V})
    assert spmd.assert_type(x, {"dp": R}) is x and spmd.assert_type(x, {"tp": V}) is x
    spmd.assert_type(x, {"tp": S(1)})
    assert spmd.get_type(x) == {"dp": R, "tp": S(1)}
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(x, {"dp": V})
    assert info.value.rule == "Type assertion failed: the tensor is R on axis 'dp', and the assertion says V."


def test_asserting_p_on_a_v_tensor_is_refused(local):
    """Difference: the published assert_type turns V into P silently; here that is a reinterpret, said so."""
    x = spmd.assert_type(torch.randn(4), {"dp": R, "tp": V})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(x, {"tp": P})
    assert info.value.rule == "Type assertion failed: the tensor is V on axis 'tp', and the assertion says P."
    assert info.value.fixes == ("spmd.convert(x, 'tp', src=spmd.V, dst=spmd.P)",)


def test_shard_types_on_assert(local):
    x = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(-1)})
    assert spmd.get_type(x) == {"dp": R, "tp": S(1)} and spmd.get_local_type(x) == by_region({"dp": R, "tp": V})
    with pytest.raises(ValueError) as info:
        spmd.assert_type(torch.randn(4, 6), {"tp": S(2)})
    assert str(info.value) == "S(2) on axis 'tp' is out of range for a 2-d tensor"
    with pytest.raises(ValueError) as info:
        spmd.assert_type(torch.randn(()), {"tp": S(0)})
    assert str(info.value) == "S(0) on axis 'tp' is out of range for a 0-d tensor"


def test_s_minus_one_is_the_last_dim_everywhere(local):
    """Found by this test: a tensor asserted S(-1) failed src=S(1) (and the reverse), on a 2-d tensor."""
    x = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(1)})
    assert spmd.assert_type(x, {"tp": S(-1)}) is x
    assert spmd.get_type(spmd.all_gather(x, "tp", src=S(-1), dst=R)) == {"dp": R, "tp": R}
    y = spmd.reduce_scatter(spmd.assert_type(torch.randn(4, 8), {"dp": R, "tp": P}), "tp", src=P, dst=S(-1))
    assert spmd.get_type(spmd.all_gather(y, "tp", src=S(1), dst=I)) == {"dp": R, "tp": I}
    spmd.mutate_type(x, "tp", src=S(-1), dst=P)
    assert spmd.get_type(x) == {"dp": R, "tp": P}


def test_two_axes_sharding_one_dim_are_ordered_by_the_mesh(glob):
    """Difference: the published API refuses two S(0) without a spec; ours orders them as the mesh does."""
    x = spmd.assert_type(torch.randn(4, 6), {"tp": S(0), "dp": S(0)})
    assert spmd.get_partition_spec(x) == PS(("dp", "tp"), None)


def test_a_v_assert_on_a_sharded_tensor_passes_in_global_spmd(glob):
    """Found by this test: in global SPMD asserting V on an S(d) axis compared an empty spec and failed."""
    x = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(0)})
    assert spmd.assert_type(x, {"tp": V}) is x
    assert spmd.get_type(x) == {"dp": R, "tp": S(0)} and spmd.get_partition_spec(x) == PS("tp", None)
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(x, {"tp": V}, PS(None, "tp"))  # an explicit spec is still compared
    assert info.value.rule == "Type assertion failed: the tensor's partition spec differs from the asserted one."


def test_partition_spec_on_assert(glob):
    x = spmd.assert_type(torch.randn(4, 6), {"dp": R}, PS(None, "tp"))
    assert spmd.get_type(x) == {"dp": R, "tp": V} and spmd.get_partition_spec(x) == PS(None, "tp")
    with pytest.raises(ValueError) as info:
        spmd.assert_type(torch.randn(4, 6), {"tp": R}, PS("tp", None))
    assert str(info.value) == "axis 'tp' shards a dim in the partition spec but its type is R, not V"


def test_get_and_has_local_type(local):
    plain = torch.randn(2)
    assert spmd.get_local_type(plain) == {} and not spmd.has_local_type(plain)
    x = spmd.assert_type(torch.randn(4, 2), {"dp": P, "tp": S(0)})
    assert spmd.get_local_type(x) == by_region({"dp": P, "tp": V}) and spmd.has_local_type(x)
    assert spmd.get_type(x) == {"dp": P, "tp": S(0)}  # ours keeps the layout in the type
    assert spmd.get_axis_local_type(x, "tp") is V and spmd.get_axis_local_type(x, local.get_group("dp")) is P
    assert spmd.maybe_get_axis_local_type(plain, "tp") is None
    with pytest.raises(ValueError) as info:
        spmd.get_axis_local_type(plain, "tp")
    assert str(info.value) == "get_axis_local_type: the tensor has no type on axis 'tp' (its type: {})"


def test_assert_type_like(glob):
    src = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(1)})
    out = spmd.assert_type_like(torch.randn(4, 6), src)
    assert spmd.get_type(out) == {"dp": R, "tp": S(1)} and spmd.get_partition_spec(out) == PS(None, "tp")
    other = spmd.assert_type_like(torch.randn(4, 6), src, {"dp": P})
    assert spmd.get_type(other) == {"dp": P, "tp": S(1)}
    with pytest.raises(TypeError) as info:
        spmd.assert_type_like(torch.randn(2), torch.randn(2))
    assert str(info.value) == "assert_type_like: the source tensor is untyped; type it first"


def test_assert_local_type_and_its_like(local):
    src = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(1)})
    assert spmd.get_type(spmd.assert_local_type(torch.randn(2), {"dp": I, "tp": I})) == {"dp": I, "tp": I}
    assert spmd.get_type(spmd.assert_local_type_like(torch.randn(4, 6), src)) == {"dp": R, "tp": S(1)}


def test_typed_values_are_tensor_subclass_instances(local):
    """Difference: the published API types plain torch.Tensor objects by an attribute; ours swaps in a subclass."""
    x = spmd.assert_type(torch.randn(2), {"dp": V, "tp": V})
    assert isinstance(x, spmd.LTensor) and type(x) is not torch.Tensor


# ---------------------------------------------------------------------------
# G6: mutate_type


def test_mutate_type_call_shapes(local):
    x = _typed({"dp": R, "tp": R})
    assert spmd.mutate_type(x, "tp", src=R, dst=I) is x and spmd.get_type(x) == {"dp": R, "tp": I}
    x = _typed({"dp": R, "tp": R})
    spmd.mutate_type(x, src=R, dst=V)  # every axis
    assert spmd.get_type(x) == {"dp": V, "tp": V}
    x = _typed({"dp": R, "tp": R})
    spmd.mutate_type(x, src=R, dst={"dp": V, "tp": I})  # torchtitan's vision encoders
    assert spmd.get_type(x) == {"dp": V, "tp": I}
    x = _typed({"dp": R, "tp": I})
    spmd.mutate_type(x, src={"dp": R, "tp": I}, dst=P)
    assert spmd.get_type(x) == {"dp": P, "tp": P}
    x = _typed({"dp": R, "tp": I})
    spmd.mutate_type(x, src={"dp": R, local.get_group("tp"): I}, dst={"dp": V, "tp": R})
    assert spmd.get_type(x) == {"dp": V, "tp": R}


def test_mutate_type_checks_src_before_changing_anything(local):
    x = _typed({"dp": R, "tp": I})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.mutate_type(x, src=R, dst=V)
    assert info.value.rule == ("spmd.mutate_type's src= must be the tensor's type: src=R, but the tensor is I on axis "
                               "'tp'.")
    assert spmd.get_type(x) == {"dp": R, "tp": I}
    with pytest.raises(ValueError) as info:
        spmd.mutate_type(x, src={"dp": R}, dst={"dp": V, "tp": R})
    assert str(info.value) == "spmd.mutate_type: src and dst name different axes: ['tp']"
    with pytest.raises(TypeError) as info:
        spmd.mutate_type(x, "tp", src={"tp": I}, dst=P)
    assert str(info.value) == "spmd.mutate_type: give axis, or dicts of axes in src/dst, not both"
    with pytest.raises(ValueError) as info:
        spmd.mutate_type(x, "xp", src=I, dst=P)
    assert str(info.value) == "unknown mesh axis 'xp'; the current mesh has axes 'dp', 'tp'"
    assert spmd.get_type(x) == {"dp": R, "tp": I}


def test_mutate_type_needs_a_typed_tensor(local):
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.mutate_type(torch.randn(2), "tp", src=R, dst=V)
    assert info.value.rule == ("spmd.mutate_type needs a typed tensor: it changes a type, and this tensor has "
                               "none.")


def test_mutate_type_takes_shards_as_v(local):
    x = _typed({"dp": V, "tp": S(0)})
    spmd.mutate_type(x, "tp", src=S(0), dst=S(0))
    assert spmd.get_type(x) == {"dp": V, "tp": V}  # stored as V: locally S(d) is V
    spmd.mutate_type(x, "tp", src=S(0), dst=P)
    assert spmd.get_type(x) == {"dp": V, "tp": P}


def test_outside_typecheck_mutate_type_does_nothing():
    with simulate((2,), ("tp",)):
        x = torch.randn(2)
        assert spmd.mutate_type(x, "tp", src=R, dst=V) is x and not spmd.has_local_type(x)


def test_a_tensor_with_a_gradient_changes_only_where_the_backward_needs_nothing(local):
    g = _typed({"dp": R, "tp": R}, grad=True)
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.mutate_type(g, "tp", src=R, dst=I)  # reinterpret R -> I: its backward keeps the gradient on one rank
    assert info.value.rule == (
        "spmd.mutate_type cannot change R to I on axis 'tp' of a tensor that carries a gradient: that change's "
        "backward changes the gradient, which an in-place retype cannot record.")
    assert info.value.fixes == ("x = spmd.reinterpret(x, 'tp', src=spmd.R, dst=spmd.I)",)
    with torch.no_grad():
        spmd.mutate_type(g, "tp", src=R, dst=I)  # no gradient recorded: any change
    assert spmd.get_type(g)["tp"] is I
    h = _typed({"dp": V, "tp": I}, grad=True) * 2
    with pytest.raises(spmd.SpmdTypeError):
        spmd.mutate_type(h, "tp", src=I, dst=V)  # reinterpret I -> V: its backward all-reduces
    spmd.mutate_type(h, "dp", src=V, dst=P)  # reinterpret V -> P: the gradient's data is unchanged
    assert spmd.get_type(h) == {"dp": P, "tp": I}
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.mutate_type(h, "dp", src=P, dst=V)  # no reinterpret takes P to V: no fix to offer
    assert info.value.fixes == ()


def test_mutate_type_then_a_collective_on_simulated_ranks():
    """A per-rank sum mutated V -> P, all-reduced: the value and the gradient of one device."""
    tp = 4
    with simulate((tp,), ("tp",), ranks="local", device="cpu"), spmd.typecheck():
        x = per_rank(lambda r: torch.arange(3, dtype=torch.float64) + r).requires_grad_()
        spmd.assert_type(x, {"tp": V})
        h = x * 2
        spmd.mutate_type(h, "tp", src=V, dst=P)  # the per-rank values are summands now
        with CommCounter() as comms:
            y = spmd.all_reduce(h, "tp", src=P, dst=I)
            (y * y).sum().backward()
        assert comms.counts == {"all_reduce": 1}
        values, grads = rank_values(y), rank_values(x.grad)
    full = torch.stack([torch.arange(3, dtype=torch.float64) + r for r in range(tp)]).requires_grad_()
    ref = (2 * full).sum(0)
    (ref * ref).sum().backward()
    for r in range(tp):
        torch.testing.assert_close(values[r], ref.detach())
        torch.testing.assert_close(grads[r], full.grad[r])


# ---------------------------------------------------------------------------
# G7 and G8: local_map, local(), local axes


@spmd.local_map(in_types=[PS("tp", None)], out_types={"dp": R, "tp": S(0)})
def _plus_one(x):
    """Declared at import, before any mesh exists: the axis names resolve at each call."""
    return x + 1


class _Attention(torch.nn.Module):
    @spmd.local_map(out_types=PS(None, "tp"))  # torchtitan's form: a method, out_types only
    def forward(self, x):
        return x * 2


def test_declarations_resolve_at_call_time(glob):
    x = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(0)})
    assert spmd.get_type(_plus_one(x)) == {"dp": R, "tp": S(0)}
    y = _Attention()(spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(1)}))
    assert spmd.get_type(y) == {"dp": R, "tp": V} and spmd.get_partition_spec(y) == PS(None, "tp")


def test_redistribute_from_the_last_dim_as_torchtitans_loss(glob):
    x = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(-1)})
    y = spmd.redistribute(x, glob.get_group("tp"), src=S(-1), dst=I)
    assert spmd.get_type(y) == {"dp": R, "tp": I} and spmd.get_partition_spec(y) == PS(None, None)


def test_local_map_infers_inputs_by_default(glob):
    @spmd.local_map(out_types={"dp": R, "tp": S(1)})
    def scale(x, k):
        return x * k

    x = spmd.assert_type(torch.randn(4, 8), {"dp": R, "tp": S(1)})
    y = scale(x, 3)
    assert spmd.get_type(y) == {"dp": R, "tp": S(1)} and spmd.get_partition_spec(y) == PS(None, "tp")


def test_local_map_declarations(glob):
    @spmd.local_map(in_types=[({"dp": R}, PS(None, "tp")), PS(None, "tp")], out_types=PS("tp", None))
    def f(a, b):
        return (a + b).t().contiguous()

    x = spmd.assert_type(torch.randn(4, 8), {"dp": R, "tp": S(1)})
    y = f(x, x)
    assert spmd.get_type(y) == {"dp": R, "tp": V} and spmd.get_partition_spec(y) == PS("tp", None)
    r = spmd.assert_type(torch.randn(4, 8), {"dp": R, "tp": R})
    with pytest.raises(spmd.SpmdTypeError) as info:
        f(x, r)
    assert info.value.rule == "Type assertion failed: the tensor is R on axis 'tp', and the assertion says V."


def test_local_map_nested_lists(glob):
    @spmd.local_map(in_types=[[{"tp": R, "dp": R}, {"tp": S(0), "dp": R}], None],
                    out_types=[{"dp": R, "tp": S(0)}, {"dp": R, "tp": R}])
    def g(xs, k):
        return xs[0] + xs[1], xs[0] * k

    a = spmd.assert_type(torch.randn(4), {"dp": R, "tp": R})
    b = spmd.assert_type(torch.randn(4), {"dp": R, "tp": S(0)})
    s, m = g([a, b], 2.0)
    assert (spmd.get_type(s), spmd.get_type(m)) == ({"dp": R, "tp": S(0)}, {"dp": R, "tp": R})
    with pytest.raises(TypeError) as info:
        g([a], 2.0)
    assert str(info.value) == ("local_map: the declaration [{'tp': R, 'dp': R}, {'tp': S(0), 'dp': R}] does not "
                               "match the argument's structure (list)")


def test_infer_only_as_the_whole_in_types():
    with pytest.raises(TypeError) as info:
        spmd.local_map(in_types=[spmd.Infer], out_types={"tp": V})
    assert str(info.value) == "local_map: in_types[0] is Infer; only in_types as a whole may be Infer"
    with pytest.raises(TypeError) as info:
        spmd.local_map(out_types=[spmd.Infer])
    assert str(info.value) == "local_map: out_types[0] is Infer; only in_types as a whole may be Infer"


def test_local_map_argument_count(local):
    f = spmd.local_map(in_types=[{"tp": V}, {"tp": V}], out_types={"tp": V})(lambda a, b: a)
    with pytest.raises(TypeError) as info:
        f(_typed({"tp": V}))
    assert str(info.value).endswith("<lambda>): 2 in_types for 1 arguments")


def test_a_none_declaration_skips_the_argument(local):
    """Difference: the published local_map refuses a tensor given a None entry; here None skips the argument."""
    f = spmd.local_map(in_types=[None, {"dp": V, "tp": V}], out_types={"dp": V, "tp": V})(lambda a, b: a + b)
    out = f(_typed({"dp": V, "tp": R}), _typed({"dp": V, "tp": V}))
    assert spmd.get_type(out) == {"dp": V, "tp": V}


def test_local_is_local_spmd_for_a_block(glob):
    x = spmd.assert_type(torch.randn(4, 8), {"dp": R, "tp": S(1)})
    with spmd.local():
        v = spmd.assert_type(torch.randn(3), {"dp": R, "tp": V})  # V with no layout: fine locally
        w = x * 2
        assert spmd.get_partition_spec(w) is None and spmd.get_type(v + 1) == {"dp": R, "tp": V}
    with pytest.raises(spmd.SpmdTypeError) as info:
        v + 1
    assert info.value.rule.startswith("Global SPMD: input has no layout")


def test_local_outside_typecheck_is_a_no_op():
    with spmd.local():
        assert not spmd.is_type_checking()


def test_local_axes_on_the_current_mesh(local):
    with spmd.set_current_mesh(None, local_axes=("dp",)) as m:
        assert m.local_axes == {"dp"} and m.axis_names == ("dp", "tp")
    with spmd.set_current_mesh(None, local_axes=[local.get_group("dp"), spmd.MeshAxis.of(4, 1)]) as m:
        assert m.local_axes == {"dp", "tp"}
    with pytest.raises(ValueError) as info:
        spmd.set_current_mesh(None, local_axes=("tp",)).__enter__()
    assert str(info.value) == ("set_current_mesh(local_axes=...): local axes come before every global axis, "
                               "outermost first (dp, tp); got (tp)")
    with pytest.raises(ValueError) as info:
        spmd.set_current_mesh(None, local_axes=("dp", "dp")).__enter__()
    assert str(info.value) == "set_current_mesh(local_axes=...): axis 'dp' is given twice"


def test_local_axes_stay_local_under_global_checking(glob):
    with spmd.set_current_mesh(None, local_axes=("dp",)):
        x = spmd.assert_type(torch.randn(4, 8), {"dp": V, "tp": S(1)})
        assert spmd.get_partition_spec(x) == PS(None, "tp")
    with pytest.raises(spmd.SpmdTypeError):
        spmd.assert_type(torch.randn(4, 8), {"dp": V, "tp": S(1)})


def test_local_dp_with_global_tp_on_simulated_ranks():
    """torchtitan's multimodal set-up: dp local (a batch per rank), tp global (column- then row-parallel linears)."""
    import torch.nn.functional as F

    def draw(*shape, seed):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    xs, w1, w2 = [draw(3, 4, seed=d) for d in range(2)], draw(6, 4, seed=10), draw(4, 6, seed=11)
    with simulate((2, 2), ("dp", "tp"), ranks="local", device="cpu"), spmd.typecheck(local=False), \
            spmd.set_current_mesh(None, local_axes=("dp",)):
        x = spmd.assert_type(per_rank(lambda r: xs[r // 2].clone()), {"dp": V, "tp": R})
        a = spmd.assert_type(per_rank(lambda r: w1.chunk(2, 0)[r % 2].clone()), {"dp": R, "tp": S(0)})
        b = spmd.assert_type(per_rank(lambda r: w2.chunk(2, 1)[r % 2].clone()), {"dp": R, "tp": S(1)})
        h = F.linear(x, a)
        assert spmd.get_type(h) == {"dp": V, "tp": V} and spmd.get_partition_spec(h) == PS(None, "tp")
        with CommCounter() as comms:
            y = spmd.all_reduce(F.linear(h, b), "tp", src=P, dst=R)  # the collective claims the pending sum
        assert comms.counts == {"all_reduce": 1} and spmd.get_type(y) == {"dp": V, "tp": R}
        z = spmd.redistribute(y, "dp", src=V, dst=I)  # on the local axis: the per-rank batches, stacked
        assert spmd.get_type(z) == {"dp": I, "tp": R}
        ys, zs = rank_values(y), rank_values(z)
    for r in range(4):
        torch.testing.assert_close(ys[r], F.linear(F.linear(xs[r // 2], w1), w2))
        torch.testing.assert_close(zs[r], torch.stack([ys[r % 2], ys[2 + r % 2]]))


def test_typecheck_takes_strict_mode_and_inherits_when_nested():
    """The published typecheck(strict_mode='strict'|'permissive', local=None): torch 2.14's local_map calls
    spmd_types._checker.typecheck(strict_mode="strict"). Nested, what is not given is inherited. The outermost
    default stays permissive (choice 41; the published default is strict)."""
    from spmd_types._checker import typecheck
    from spmd_types._core.state import STATE

    with spmd.typecheck():
        assert STATE.strict is False and STATE.global_mode is False
    with typecheck(strict_mode="strict"):
        assert STATE.strict is True
        with spmd.typecheck(local=False):
            assert STATE.strict is True and STATE.global_mode is True
            with spmd.typecheck("permissive"):
                assert STATE.strict is False and STATE.global_mode is True
        assert STATE.strict is True and STATE.global_mode is False
    assert STATE.checking is False


# ---------------------------------------------------------------------------
# G11: registrations


def test_register_autograd_function_with_typecheck_forward(local):
    seen = []

    @spmd.register_autograd_function
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k, None

        @staticmethod
        def typecheck_forward(x, k):
            seen.append(k)
            spmd.assert_type(x, {"tp": V})
            out = Scale.apply(x, k)  # the real Function, on plain aliases: no recursion
            spmd.assert_type(out, {**{a: t for a, t in spmd.get_local_type(x).items() if a != spmd.normalize_axis("tp")},
                                   "tp": P})  # x's other axes as they are, tp now P
            return out

    x = _typed({"dp": R, "tp": V}, grad=True)
    y = Scale.apply(x, 2.0)
    assert spmd.get_type(y) == {"dp": R, "tp": P} and seen == [2.0]  # non-tensor arguments reach it
    with pytest.raises(spmd.SpmdTypeError) as info:
        Scale.apply(_typed({"dp": R, "tp": R}), 2.0)
    assert info.value.rule == "Type assertion failed: the tensor is R on axis 'tp', and the assertion says V."


def test_register_local_autograd_function(local):
    @spmd.register_local_autograd_function
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    assert spmd.get_type(Square.apply(_typed({"dp": R, "tp": V}))) == {"dp": R, "tp": V}
    with pytest.raises(spmd.SpmdTypeError):
        Square.apply(_typed({"dp": R, "tp": P}))  # the standard rule: no P through a non-linear op


def test_an_unregistered_function_is_refused_even_when_permissive(local):
    """Difference: the published checker leaves its output untyped when permissive; here it is an error (choice 14)."""

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    with pytest.raises(spmd.SpmdTypeError) as info:
        Plain.apply(_typed({"dp": R, "tp": V}))
    assert "Plain" in info.value.rule and "not registered" in info.value.rule


class _FusedRms(torch.autograd.Function):
    """A fused RMS norm: a hand-written backward (here by re-running the reference under autograd)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _rms(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
            return torch.autograd.grad(_rms(xx, ww), (xx, ww), g)


def _rms(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def test_register_decomposition_types_by_the_reference_and_keeps_the_numerics():
    reference = spmd.register_decomposition(_FusedRms)(_rms)
    assert reference is _rms
    try:
        x_full = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        w_full = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with simulate((2,), ("tp",), ranks="local", device="cpu"), spmd.typecheck():
            x = spmd.assert_type(per_rank(lambda r: x_full.chunk(2)[r].clone()).requires_grad_(), {"tp": S(0)})
            w = spmd.assert_type(per_rank(lambda r: w_full.clone()).requires_grad_(), {"tp": R})
            with CommCounter() as forward:
                out = _FusedRms.apply(x, w)
            assert forward.counts == {} and spmd.get_type(out) == {"tp": V}
            loss = spmd.all_reduce((out * out).sum(), "tp", src=V, dst=I)
            loss.backward()
            got = (rank_values(loss)[0], torch.cat([rank_values(x.grad)[r] for r in range(2)]),
                   rank_values(x.grad), sum(rank_values(w.grad).values()), spmd.get_type(w.grad))
            with pytest.raises(spmd.SpmdTypeError) as info:
                _FusedRms.apply(spmd.assert_type(torch.randn(4, 6), {"tp": P}), w)  # the reference's rules apply
            assert info.value.rule.startswith("Partial * Partial")
        xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
        ref = (_rms(xr, wr) ** 2).sum()
        ref.backward()
        torch.testing.assert_close(got[0], ref.detach())
        torch.testing.assert_close(got[1], xr.grad)
        torch.testing.assert_close(got[3], wr.grad)  # an R weight's gradient is P: its summands add up
        assert got[4] == {"tp": P}
    finally:
        spmd.unregister_autograd_function(_FusedRms)


def test_register_decomposition_refuses_a_reference_of_another_shape(local):
    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, a, b):
            return 2 * a + 3 * b

    spmd.register_decomposition(Two, lambda x: x * 2)
    with pytest.raises(spmd.SpmdTypeError) as info:
        Two.apply(_typed({"dp": R, "tp": V}))
    assert info.value.rule == ("register_decomposition: the reference implementation of "
                               "test_register_decomposition_refuses_a_reference_of_another_shape.<locals>.Two "
                               "returns a different structure than the Function.")


# ---------------------------------------------------------------------------
# G12: trace()


def test_trace_logs_asserts_ops_and_collectives(local, caplog):
    with caplog.at_level(logging.INFO, logger="spmd_types.trace"), spmd.trace():
        x = spmd.assert_type(torch.randn(4), {"dp": R, "tp": V})
        y = x * 2
        spmd.all_gather(y, "tp", src=V, dst=R)
        spmd.mutate_type(y, "dp", src=R, dst=V)
        torch.randn(2) + 1  # untyped: nothing to say
    lines = [r.getMessage().split("  ", 1)[1] for r in caplog.records]
    assert lines == [
        "assert_type(untyped) -> {dp: R, tp: V}",
        "Tensor.__mul__ (*)({dp: R, tp: V}, 2) -> {dp: R, tp: V}",
        "spmd.all_gather({dp: R, tp: V}) -> {dp: R, tp: R}",
        "mutate_type({dp: R, tp: V}) -> {dp: V, tp: V}",
    ]
    assert caplog.records[0].getMessage().split(":")[0].endswith("test_published_api.py")


def test_trace_disabled_is_silent(local, caplog):
    with caplog.at_level(logging.INFO, logger="spmd_types.trace"), spmd.trace(False):
        spmd.assert_type(torch.randn(4), {"dp": R, "tp": V}) * 2
    assert caplog.records == []


# ---------------------------------------------------------------------------
# G13: traceback filtering


def _fail(mode):
    with spmd.traceback_filtering(mode):
        spmd.assert_type(_typed({"dp": R, "tp": V}), {"tp": R})


def _frames(err):
    return [f.filename.rsplit("/", 1)[-1] for f in traceback.extract_tb(err.__traceback__)]


def test_filtered_tracebacks_show_the_users_frames(local):
    """Found by this test: no mode removed a frame (contextlib put the original traceback back)."""
    for mode in ("quiet_remove_frames", "remove_frames"):
        with pytest.raises(spmd.SpmdTypeError) as info:
            _fail(mode)
        assert set(_frames(info.value)) == {"test_published_api.py"}, mode
        assert info.value.__notes__ == [
            "spmd_types left its own and torch's frames out of this traceback; SPMD_TYPES_TRACEBACK_FILTERING=off "
            "(or spmd.traceback_filtering('off')) keeps them"]
    assert "asserts.py" in _frames(info.value.__cause__)  # remove_frames: the full traceback is the cause
    for mode in ("off", "tracebackhide"):
        with pytest.raises(spmd.SpmdTypeError) as info:
            _fail(mode)
        assert "asserts.py" in _frames(info.value) and not hasattr(info.value, "__notes__")


def test_nested_filtering_filters_once_and_restores_the_mode(local):
    from spmd_types._core.tracebacks import _MODE

    before = _MODE[0]
    with pytest.raises(spmd.SpmdTypeError) as info:
        with spmd.traceback_filtering("remove_frames"):
            with spmd.traceback_filtering("quiet_remove_frames"):
                assert _MODE[0] == "quiet_remove_frames"
                spmd.assert_type(_typed({"dp": R, "tp": V}), {"tp": R})
    assert len(info.value.__notes__) == 1 and info.value.__cause__ is None  # the inner mode decided
    assert _MODE[0] == before


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError) as info:
        spmd.traceback_filtering("loud")
    assert str(info.value) == ("traceback_filtering: mode must be one of off, auto, tracebackhide, "
                               "quiet_remove_frames, remove_frames; got 'loud'")


# ---------------------------------------------------------------------------
# G16: the published DTensor helpers


def test_spmd_type_to_dtensor_placement():
    assert spmd.spmd_type_to_dtensor_placement(R) == Replicate() == spmd.spmd_type_to_dtensor_placement(I)
    assert type(spmd.spmd_type_to_dtensor_placement(R)) is Replicate  # not our Reduced: what DTensor knows
    assert spmd.spmd_type_to_dtensor_placement(P) == Partial()
    assert spmd.spmd_type_to_dtensor_placement(S(1)) == Shard(1)
    with pytest.raises(ValueError) as info:
        spmd.spmd_type_to_dtensor_placement(V)
    assert str(info.value) == ("spmd_type_to_dtensor_placement: V has no DTensor placement (it says nothing of the "
                               "layout); use S(d) for a value sharded on tensor dim d")


def test_dtensor_placement_to_spmd_type():
    assert spmd.dtensor_placement_to_spmd_type(Replicate()) is I
    assert spmd.dtensor_placement_to_spmd_type(Replicate(), grad_placement=Partial()) is R
    assert spmd.dtensor_placement_to_spmd_type(spmd.Reduced()) is R
    assert spmd.dtensor_placement_to_spmd_type(Shard(0)) is S(0)
    assert spmd.dtensor_placement_to_spmd_type(Partial()) is P
    with pytest.raises(ValueError) as info:
        spmd.dtensor_placement_to_spmd_type(Partial("max"))
    assert str(info.value) == "dtensor_placement_to_spmd_type: only a sum is a P value, got Partial(max)"


# ---------------------------------------------------------------------------
# the shorthand ops, on simulated ranks


@pytest.fixture
def tp_ranks():
    with simulate((4,), ("tp",), ranks="local", device="cpu") as mesh, spmd.typecheck():
        yield mesh


def test_shard_and_unshard(tp_ranks):
    full = torch.arange(8.0)
    w = spmd.assert_type(per_rank(lambda r: full.clone()).requires_grad_(), {"tp": I})
    with CommCounter() as comms:
        s = spmd.shard(w, "tp", src=I, dst=S(0))
    assert comms.counts == {} and spmd.get_type(s) == {"tp": S(0)}
    assert [rank_values(s)[r].tolist() for r in range(4)] == [full.chunk(4)[r].tolist() for r in range(4)]
    with CommCounter() as comms:
        u = spmd.unshard(s, "tp", src=S(0), dst=I)
    assert comms.counts == {"all_gather": 1} and spmd.get_type(u) == {"tp": I}
    torch.testing.assert_close(rank_values(u)[3], full)
    with pytest.raises(ValueError) as info:
        spmd.shard(w, "tp", src=I, dst=V)
    assert str(info.value) == "spmd.shard: dst must be S(d), got V"
    with pytest.raises(ValueError) as info:
        spmd.unshard(s, "tp", src=V, dst=R)
    assert str(info.value) == "spmd.unshard: src must be S(d), got V"


def test_invariant_to_replicate(tp_ranks):
    w = spmd.assert_type(per_rank(lambda r: torch.ones(3)).requires_grad_(), {"tp": I})
    with CommCounter() as forward:
        r = spmd.invariant_to_replicate(w, "tp")
    assert forward.counts == {} and spmd.get_type(r) == {"tp": R}
    k = spmd.assert_type(per_rank(lambda q: torch.full((3,), float(q))), {"tp": V})
    loss = spmd.all_reduce((r * k).sum(), "tp", src=V, dst=I)
    with CommCounter() as backward:
        loss.backward()
    assert backward.counts == {"all_reduce": 1}  # the P gradient of r is summed onto the I weight
    assert rank_values(w.grad)[2].tolist() == [6.0, 6.0, 6.0]  # d/dw sum_q q * w = 0 + 1 + 2 + 3


# ---------------------------------------------------------------------------
# G20: is_type_checking and TYPE_CHECKING


def test_type_checking_flags():
    assert not spmd.is_type_checking() and not spmd.TYPE_CHECKING
    with spmd.typecheck():
        assert spmd.is_type_checking() and spmd.TYPE_CHECKING and repr(spmd.TYPE_CHECKING) == "TYPE_CHECKING(True)"
        with spmd.no_typecheck():
            assert not spmd.TYPE_CHECKING
    assert repr(spmd.TYPE_CHECKING) == "TYPE_CHECKING(False)"


def test_register_decomposition_under_global_spmd(glob):
    spmd.register_decomposition(_FusedRms, _rms)
    try:
        w = spmd.assert_type(torch.randn(6), {"dp": R, "tp": R})
        x = spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(0)})
        out = _FusedRms.apply(x, w)  # the norm is over dim 1: a shard of dim 0 goes through
        assert spmd.get_type(out) == {"dp": R, "tp": V} and spmd.get_partition_spec(out) == PS("tp", None)
        r = _FusedRms.apply(spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": R}), w)
        assert spmd.get_type(r) == {"dp": R, "tp": R} and spmd.get_partition_spec(r) == PS(None, None)
        with pytest.raises(spmd.SpmdTypeError) as info:  # sharding the normalized dim: each rank sees part of it
            _FusedRms.apply(spmd.assert_type(torch.randn(4, 6), {"dp": R, "tp": S(1)}), w)
        assert info.value.rule == ("Global SPMD: a reduction over a sharded dim adds up only this rank's shard; the "
                                   "global result needs the shards combined.")
    finally:
        spmd.unregister_autograd_function(_FusedRms)


# ---------------------------------------------------------------------------
# docs/published_api.md: its examples run, and print what the page shows

_PAGE = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "published_api.md").read_text()
_BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", _PAGE, flags=re.S | re.M)
_EXAMPLES = [(code, out if lang2 == "text" else "") for (lang, code), (lang2, out) in zip(_BLOCKS, _BLOCKS[1:] + [("", "")])
             if lang == "python"]


@pytest.mark.parametrize("code, output", _EXAMPLES, ids=[f"example{i}" for i in range(len(_EXAMPLES))])
def test_the_pages_examples_run(code, output):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "<docs/published_api.md>", "exec"), {"__name__": "__example__"})
    assert printed.getvalue() == output
