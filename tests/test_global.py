"""Global SPMD: partition specs on typed tensors, shard propagation per op family, explicit partial, local_map."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types._checker.tensor import _CACHES
from spmd_types._global.shard_rules import SHARD_ROWS

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S


@pytest.fixture
def glob(mesh_dp_tp):
    for cache in _CACHES:
        cache.clear()
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=False):
        yield


def sharded(shape, dim, axis="tp"):
    return spmd.assert_type(torch.randn(*shape), {axis: S(dim)})


def replicated(*shape):
    return spmd.assert_type(torch.randn(*shape), {})


def spec(t):
    """The internal spec: one tuple of axis names per dim."""
    return t._spmd_spec


def test_assert_type_places_shards_and_repr_shows_global_sizes(glob):
    x = spmd.assert_type(torch.randn(2, 16), {"tp": S(1)})
    assert repr(x) == "f32[2,64@tp] {dp: R, tp: S(1)}"
    assert spmd.get_partition_spec(x) == spmd.PartitionSpec(None, "tp")
    y = spmd.assert_type(torch.randn(2, 16), {}, partition_spec=spmd.PartitionSpec(("dp", "tp"), None))
    assert repr(y) == "f32[16@dp,tp,16] {dp: V, tp: V}"
    assert spmd.get_type(y) == {"dp": V, "tp": V}


def test_unplaced_varying_is_an_error_in_global_spmd(glob):
    with pytest.raises(spmd.SpmdTypeError, match="the tensor is V on axis 'tp', which is checked in global SPMD"):
        spmd.assert_type(torch.randn(3), {"tp": V})


def test_placing_a_replicated_axis_is_an_error(glob):
    with pytest.raises(ValueError, match="axis 'tp' shards a dim in the partition spec but its type is R"):
        spmd.assert_type(torch.randn(3), {"tp": R}, partition_spec=spmd.PartitionSpec("tp"))


def test_asserting_another_spec_fails_with_a_redistribute_fix(glob):
    x = sharded((4, 4), 0)
    with pytest.raises(spmd.SpmdTypeError, match="the tensor is S\\(0\\) on axis 'tp', and the assertion says S\\(1\\)"):
        spmd.assert_type(x, {"tp": S(1)})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.assert_type(x, {}, partition_spec=spmd.PartitionSpec(None, "tp"))
    assert info.value.rule == "Type assertion failed: the tensor's partition spec differs from the asserted one."
    assert info.value.fixes == ("spmd.redistribute(x, PartitionSpec('tp', None), PartitionSpec(None, 'tp'))",)


# Per shard-propagation row: an accepted call with its expected spec, and a rejected call
# with a piece of its message. Keyed by the row's kind and first name.
def _acc_rej():
    def col(x):
        return x
    return {
        "add": (lambda: sharded((4, 8), 1) * 2 + sharded((4, 8), 1), ((), ("tp",)),
                lambda: sharded((4, 8), 1) + replicated(4, 8), "sharded the same way on every dim"),
        "sum": (lambda: sharded((4, 8), 0).sum(1), (("tp",),),
                lambda: sharded((4, 8), 1).sum(1) + 1.0, "sums over a sharded dim"),
        "mean": (lambda: sharded((4, 8), 0).amax(-1), (("tp",),),
                 lambda: sharded((4, 8), 0).mean(0), "a reduction over a sharded dim"),
        "softmax": (lambda: torch.softmax(sharded((4, 8), 0), -1), (("tp",), ()),
                    lambda: torch.softmax(sharded((4, 8), 1), -1), "mixes values along dim 1"),
        "topk": (lambda: torch.topk(sharded((4, 8), 0), 2, dim=1).values, (("tp",), ()),
                 lambda: torch.topk(sharded((4, 8), 1), 2, dim=1), "mixes values along dim 1"),
        "F.normalize": (lambda: F.normalize(sharded((4, 8), 0), dim=1), (("tp",), ()),
                        lambda: F.normalize(sharded((4, 8), 1), dim=1), "mixes values along dim 1"),
        "F.layer_norm": (lambda: F.layer_norm(sharded((4, 8), 0), (8,)), (("tp",), ()),
                         lambda: F.layer_norm(sharded((4, 8), 1), (8,)), "normalizes over dim 1"),
        "matmul": (lambda: replicated(4, 8) @ sharded((8, 6), 1), ((), ("tp",)),
                   lambda: (sharded((4, 8), 1) @ sharded((8, 6), 0)) * 2, "sums over a sharded dim"),
        "Tensor.__rmatmul__": (lambda: sharded((8, 6), 1).__rmatmul__(replicated(4, 8)), ((), ("tp",)),
                               lambda: sharded((8, 6), 0).__rmatmul__(sharded((4, 8), 1)) * 2,
                               "sums over a sharded dim"),
        "torch.einsum": (lambda: torch.einsum("bk,nk->bn", replicated(4, 8), sharded((6, 8), 0)), ((), ("tp",)),
                         lambda: torch.einsum("bk,kn->bn", sharded((4, 8), 0), sharded((8, 6), 1)),
                         "a mesh axis can shard only one dim"),
        "F.linear": (lambda: F.linear(replicated(4, 8), sharded((6, 8), 0), sharded((6,), 0)), ((), ("tp",)),
                     lambda: F.linear(replicated(4, 8), sharded((6, 8), 0), replicated(6)), "the bias must be sharded"),
        "view_as_complex": (lambda: torch.view_as_complex(sharded((4, 3, 2), 0)), (("tp",), ()),
                            lambda: torch.view_as_complex(sharded((4, 2), 1).contiguous()),
                            "view_as_complex reads the last dim as (real, imaginary) pairs"),
        "gather": (lambda: torch.gather(sharded((4, 8), 0), 1, spmd.assert_type(torch.zeros(4, 2, dtype=torch.long),
                                                                                 {"tp": S(0)})), (("tp",), ()),
                   lambda: torch.gather(sharded((4, 8), 1), 1, torch.zeros(4, 2, dtype=torch.long)),
                   "gather reads any position along its dim"),
        "scatter": (lambda: torch.scatter(sharded((4, 8), 0), 1, spmd.assert_type(torch.zeros(4, 2, dtype=torch.long),
                                                                                   {"tp": S(0)}), 1.0), (("tp",), ()),
                    lambda: torch.scatter(sharded((4, 8), 0), 1, torch.zeros(4, 2, dtype=torch.long), 1.0),
                    "scatter pairs each index"),
        "view": (lambda: sharded((4, 6), 0).view(24), (("tp",),),
                 lambda: sharded((4, 6), 1).view(24), "major (first) dim"),
        "permute": (lambda: sharded((2, 3, 4), 0).permute(2, 0, 1), ((), ("tp",), ()),
                    lambda: sharded((2, 3, 4), 0).permute(2, 0, 1).mean(1), "a reduction over a sharded dim"),
        "transpose": (lambda: sharded((2, 3), 0).t(), ((), ("tp",)),
                      lambda: torch.softmax(sharded((2, 3), 0).transpose(0, 1), 1), "mixes values along dim 1"),
        "cat": (lambda: torch.cat([sharded((2, 3), 0), sharded((2, 3), 0)], 1), (("tp",), ()),
                lambda: torch.cat([sharded((2, 3), 0), sharded((2, 3), 0)], 0), "concatenating along a sharded dim"),
        "stack": (lambda: torch.stack([sharded((2, 3), 0), sharded((2, 3), 0)]), ((), ("tp",), ()),
                  lambda: torch.stack([sharded((2, 3), 0), sharded((2, 3), 1)]), "needs every input sharded the same"),
        "split": (lambda: sharded((2, 6), 0).split(3, dim=1)[0], (("tp",), ()),
                  lambda: sharded((2, 6), 1).split(3, dim=1), "splitting along a sharded dim"),
        "select": (lambda: sharded((2, 6), 0).select(1, 2), (("tp",),),
                   lambda: sharded((2, 6), 0).select(0, 1), "selecting along a sharded dim"),
        "Tensor.__getitem__": (lambda: sharded((2, 6), 0)[:, 1:3], (("tp",), ()),
                               lambda: sharded((2, 6), 0)[1:], "indexing a sharded dim"),
        "unsqueeze": (lambda: sharded((2, 6), 0).unsqueeze(0), ((), ("tp",), ()),
                      lambda: sharded((2, 6), 0).unsqueeze(0).mean(1), "a reduction over a sharded dim"),
        "squeeze": (lambda: sharded((2, 1), 0).squeeze(1), (("tp",),),
                    lambda: sharded((1, 3), 0).squeeze(0), "squeezing a sharded dim"),
        "expand": (lambda: sharded((2, 1), 0).expand(2, 5), (("tp",), ()),
                   lambda: sharded((1, 3), 0).expand(4, 3), "growing a sharded dim"),
        "F.embedding": (lambda: F.embedding(spmd.assert_type(torch.zeros(4, dtype=torch.long), {"tp": S(0)}),
                                            replicated(10, 8)), (("tp",), ()),
                        lambda: F.embedding(torch.zeros(4, dtype=torch.long), sharded((10, 8), 0)),
                        "a vocabulary-sharded embedding"),
        "F.scaled_dot_product_attention": (
            lambda: F.scaled_dot_product_attention(sharded((2, 4, 5, 8), 1), sharded((2, 4, 5, 8), 1),
                                                   sharded((2, 4, 5, 8), 1)), ((), ("tp",), (), ()),
            lambda: F.scaled_dot_product_attention(sharded((2, 4, 5, 8), 2), sharded((2, 4, 5, 8), 2),
                                                   sharded((2, 4, 5, 8), 2)), "the whole key sequence"),
        "F.cross_entropy": (
            lambda: F.cross_entropy(sharded((4, 10), 0), spmd.assert_type(torch.zeros(4, dtype=torch.long),
                                                                          {"tp": S(0)}), reduction="none"),
            (("tp",),),
            lambda: F.cross_entropy(sharded((4, 10), 1), torch.zeros(4, dtype=torch.long)),
            "a class-sharded cross-entropy"),
    }


RECIPES = _acc_rej()


def _key(row):
    name = row.names[0].lstrip("?")
    short = name.split(".", 1)[1] if name.startswith(("torch.", "Tensor.")) and not name.startswith("Tensor.__") else name
    return short if short in RECIPES else name


def test_every_shard_row_has_a_recipe():
    keys = {_key(row) for row in SHARD_ROWS}
    assert keys - set(RECIPES) == set(), "rows without an accepted/rejected recipe"
    assert set(RECIPES) - keys == set(), "recipes for rows that do not exist"


@pytest.mark.parametrize("row", SHARD_ROWS, ids=lambda r: r.names[0].lstrip("?"))
def test_shard_row_accepts_and_rejects(glob, row):
    accept, want, reject, message = RECIPES[_key(row)]
    assert spec(accept()) == want
    with pytest.raises(spmd.SpmdTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        reject()


def test_op_without_shard_rule_is_rejected_only_when_sharded(glob):
    assert spec(torch.tril(replicated(3, 3))) == ((), ())
    with pytest.raises(spmd.SpmdTypeError, match="torch.tril has no shard propagation rule, and an operand is sharded"):
        torch.tril(sharded((3, 3), 0))


def test_explicit_partial_makes_p_on_the_named_axes(glob):
    h = sharded((4, 8), 1)
    w = sharded((6, 8), 1)
    y = spmd.linear(h, w, out_partial_axes="tp")
    assert spmd.get_type(y)["tp"] is P and spec(y) == ((), ())
    total = spmd.sum(sharded((4, 8), 1), 1, out_partial_axes="tp")
    assert spmd.get_type(total)["tp"] is P
    z = spmd.einsum("bk,nk->bn", h, w, out_partial_axes=["tp"])
    assert spmd.get_type(z)["tp"] is P
    m = spmd.matmul(h, sharded((8, 6), 0), out_partial_axes="tp")
    assert spmd.get_type(m)["tp"] is P


def test_explicit_partial_over_the_wrong_axis_is_still_rejected(glob):
    h = sharded((4, 8), 1)
    w = sharded((6, 8), 1)
    with pytest.raises(spmd.SpmdTypeError, match="contracted index 'k' .* is sharded on 'tp'"):
        spmd.linear(h, w, out_partial_axes="dp")


def test_row_parallel_plain_linear_is_a_pending_sum_to_claim(glob):
    h, w = sharded((4, 8), 1), sharded((6, 8), 1)
    y = F.linear(h, w)  # global SPMD: the pending sum it is, unclaimed
    with pytest.raises(spmd.SpmdTypeError) as info:
        y + 1.0
    assert info.value.fixes == ("spmd.assert_type(y, {'tp': spmd.P}) right after it",
                                "spmd.sum / spmd.linear / spmd.matmul / spmd.einsum(..., out_partial_axes='tp')")


def test_local_row_parallel_needs_reinterpret_and_explicit_partial_is_the_same(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck():
        h = spmd.assert_type(torch.randn(4, 8), {"tp": V})
        w = spmd.assert_type(torch.randn(6, 8), {"tp": V})
        local = spmd.reinterpret(F.linear(h, w), "tp", src=V, dst=P)
        explicit = spmd.linear(h, w, out_partial_axes="tp")
        assert spmd.get_type(local) == spmd.get_type(explicit)
    assert torch.equal(local, explicit)  # outside typecheck: a plain comparison


def test_per_axis_local_and_global(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp), spmd.typecheck(local=["dp"]):
        x = spmd.assert_type(torch.randn(4, 8), {"dp": V, "tp": S(1)})  # dp stays local: V needs no placement
        y = torch.softmax(x, 0)  # dp is local, tp is global and dim 0 is whole
        assert spmd.get_type(y) == {"dp": V, "tp": V} and spec(y) == ((), ("tp",))
        with pytest.raises(spmd.SpmdTypeError, match="mixes values along dim 1"):
            torch.softmax(x, 1)


def test_local_map_forgets_specs_and_checks_outputs(glob):
    @spmd.local_map(in_types=[{"tp": S(1)}, {"tp": S(1)}], out_types={"tp": P})
    def row_parallel(h, w):
        y = F.linear(h, w)  # local SPMD inside: a local matmul is fine
        return spmd.reinterpret(y, "tp", src=V, dst=P)

    y = row_parallel(sharded((4, 8), 1), sharded((6, 8), 1))
    assert spmd.get_type(y)["tp"] is P and spec(y) == ((), ())

    @spmd.local_map(in_types=[{"tp": S(1)}], out_types={"tp": R})
    def forgot_the_reduction(h):
        return h * 2

    with pytest.raises(spmd.SpmdTypeError) as info:
        forgot_the_reduction(sharded((4, 8), 1))
    assert info.value.rule.startswith("local_map: output 0 of ")
    assert "is V on axis 'tp', and out_types declares R." in info.value.rule


def test_local_map_outputs_get_the_declared_layout(glob):
    @spmd.local_map(in_types=[{"tp": S(0)}], out_types={"tp": S(1)})
    def transpose_local(x):
        return x.t().contiguous()

    y = transpose_local(sharded((2, 3), 0))
    assert spec(y) == ((), ("tp",))


def test_local_map_is_erased_outside_typecheck(mesh_dp_tp):
    calls = []

    @spmd.local_map(in_types=[{"tp": S(0)}], out_types={"tp": S(0)})
    def f(x):
        calls.append(type(x))
        return x

    with spmd.set_current_mesh(mesh_dp_tp):
        out = f(torch.randn(2))
    assert calls == [torch.Tensor] and type(out) is torch.Tensor


class RowParallel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 8))

    @spmd.local_map(in_types=[{"tp": S(1)}], out_types={"tp": P})
    def forward(self, h):
        return spmd.reinterpret(F.linear(h, self.weight), "tp", src=V, dst=P)


def test_local_map_on_a_module_forward(glob):
    block = RowParallel()
    spmd.assert_type(block.weight, {"tp": S(1)})
    y = block(sharded((4, 8), 1))
    assert spmd.get_type(y)["tp"] is P and spec(y) == ((), ())
    with pytest.raises(spmd.SpmdTypeError, match="the tensor is R on axis 'tp', and the assertion says S\\(1\\)"):
        block(replicated(4, 8))


def test_assert_type_on_a_module_in_global_spmd(glob):
    lin = torch.nn.Linear(4, 4)
    spmd.assert_type(lin, {"tp": R})  # dp left out: replicated in global SPMD, as for a tensor
    assert spmd.get_type(lin.weight) == {"dp": R, "tp": R}


def test_a_short_partition_spec_is_padded_with_none_as_in_jax(glob, mesh_dp_tp):
    """Issue 14 item 4, choice 27: PartitionSpec("dp") on a 2-d tensor is PartitionSpec("dp", None)."""
    PS = spmd.PartitionSpec
    short = spmd.assert_type(torch.randn(2, 4), {}, PS("dp"))
    full = spmd.assert_type(torch.randn(2, 4), {}, PS("dp", None))
    assert spmd.get_partition_spec(short) == spmd.get_partition_spec(full) == PS("dp", None)
    assert spmd.get_type(short) == spmd.get_type(full) == {"dp": V, "tp": R}
    assert repr(short) == "f32[4@dp,4] {dp: V, tp: R}"
    moved = spmd.redistribute(short, PS("dp"), PS(None, "dp"))
    assert spmd.get_partition_spec(moved) == PS(None, "dp")
    one = spmd.plan_redistribute((8, 16), PS("dp"), PS(None, ("dp", "tp")))
    two = spmd.plan_redistribute((8, 16), PS("dp", None), PS(None, ("dp", "tp")))
    assert list(one) == list(two)
    with pytest.raises(ValueError, match=r"partition spec \('dp', None, 'tp'\) has 3 entries for a 2-d tensor"):
        spmd.assert_type(torch.randn(2, 4), {}, PS("dp", None, "tp"))
