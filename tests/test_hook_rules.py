"""Functions that type themselves (``spmd_typecheck`` / ``typecheck_forward``, no decorator) and ``spmd_types.rules``.

Hooks are called as the published API's docs write them: keyword-only forward arguments, the output type(s)
returned (or, with a leading positional parameter, the outputs typed in place), composed from ``rules``.
Values are checked on simulated ranks against the one-device computation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import spmd_types as spmd
from spmd_types import rules
from spmd_types._boundaries import hook_registration
from spmd_types._boundaries.autograd_functions import registration_of, unregister_autograd_function
from spmd_types.testing import per_rank, rank_values, simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
PS = spmd.PartitionSpec


class LinearAllReduce(torch.autograd.Function):
    """x @ w.T summed over the group, with no decorator: its hook types it."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        y = x @ weight.t()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, None

    @staticmethod
    def spmd_typecheck(*, x, weight, group):
        y = rules.einsum("mk,nk->mn", x, weight)
        return rules.all_reduce(y, group, src=P, dst=I)


class ScaleStamped(torch.autograd.Function):
    """The other hook shape: the outputs come first and the hook types them itself."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * k, x.sum(0)

    @staticmethod
    def backward(ctx, g, gs):
        return g * ctx.k + gs, None

    @staticmethod
    def spmd_typecheck(outputs, *, x):
        scaled, summed = outputs
        rules.output(scaled, rules.einsum("ab->ab", x))
        spmd.assert_type(summed, spmd.get_local_type(x))


class ForgetsWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None

    @staticmethod
    def spmd_typecheck(*, x, weight):
        return rules.einsum("a->a", x)


@pytest.fixture
def ranks():
    """tp=2 on simulated ranks, local SPMD."""
    with simulate((2,), ("tp",), ranks="local", device="cpu") as mesh, spmd.typecheck():
        yield mesh


@pytest.fixture
def global_ranks():
    """tp=2 on simulated ranks, global SPMD (sharded labels, contractions)."""
    with simulate((2,), ("tp",), ranks="local", device="cpu") as mesh, spmd.typecheck(local=False):
        yield mesh


def _one(t):
    return next(iter(rank_values(t).values()))


def test_a_hook_types_its_function_with_no_decorator(global_ranks):
    assert registration_of(LinearAllReduce).kind == "spmd_typecheck"
    tp = global_ranks.get_group("tp")
    gx, gw = torch.randn(3, 4), torch.randn(5, 4)
    x = spmd.assert_type(per_rank(lambda r: gx[:, 2 * r:2 * r + 2].clone()), {"tp": S(1)})
    w = spmd.assert_type(per_rank(lambda r: gw[:, 2 * r:2 * r + 2].clone()), {"tp": S(1)})
    y = LinearAllReduce.apply(x, w, tp)
    assert spmd.get_type(y) == {"tp": I}
    torch.testing.assert_close(_one(y), gx @ gw.t())
    with pytest.raises(spmd.SpmdTypeError) as info:
        LinearAllReduce.apply(x, spmd.assert_type(torch.randn(5, 2), {"tp": R}), tp)  # runs, then the hook refuses
    assert str(info.value) == "rules.einsum: label 'k' of 'mk,nk->mn' is sharded differently on operand 1 (dim 1)"


def test_the_stamping_shape_of_hook(ranks):
    x = spmd.assert_type(torch.randn(4, 3), {"tp": V})
    scaled, summed = ScaleStamped.apply(x, 2.0)
    assert spmd.get_type(scaled) == {"tp": V} and spmd.get_type(summed) == {"tp": V}


def test_a_hook_must_cover_every_tensor_argument(ranks):
    x = spmd.assert_type(torch.randn(4), {"tp": V})
    with pytest.raises(spmd.SpmdTypeError) as info:
        ForgetsWeight.apply(x, spmd.assert_type(torch.randn(4), {"tp": R}))
    assert str(info.value) == (
        "ForgetsWeight.spmd_typecheck: tensor argument 'weight' was not accounted for: pass it to the rules operation "
        "that consumes it, assert_type it, or declare rules.ignore(weight) if the forward value does not depend on it")


def test_a_hook_must_type_every_output(ranks):
    class Leaves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

        @staticmethod
        def spmd_typecheck(outputs, *, x):
            rules.ignore(x)

    class ReturnsNothing(Leaves):
        @staticmethod
        def spmd_typecheck(*, x):
            rules.ignore(x)

    x = spmd.assert_type(torch.randn(4), {"tp": V})
    with pytest.raises(spmd.SpmdTypeError) as info:
        Leaves.apply(x)
    assert str(info.value) == ("Leaves.spmd_typecheck: output 0 was left untyped: return its type from the hook, or "
                               "finish with rules.output(out, <NdimWithSpmdType>) or assert_type(out, ...)")
    with pytest.raises(spmd.SpmdTypeError) as info:
        ReturnsNothing.apply(x)
    assert str(info.value) == ("ReturnsNothing.spmd_typecheck: returned None; a keyword-only spmd_typecheck returns "
                               "the output type(s) (an NdimWithSpmdType, a typed tensor, or a tuple of them)")


def test_a_hook_names_forward_parameters(ranks):
    class Misnamed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g

        @staticmethod
        def spmd_typecheck(*, inp):
            return inp

    with pytest.raises(TypeError) as info:
        Misnamed.apply(spmd.assert_type(torch.randn(2), {"tp": V}))
    assert str(info.value) == "Misnamed.spmd_typecheck: 'inp' is not a parameter of Misnamed.forward (it has ['x'])"


def test_typecheck_forward_needs_no_decorator_either(ranks):
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

        @staticmethod
        def typecheck_forward(x):
            spmd.assert_type(x, {"tp": V})
            out = Double.apply(x)
            return spmd.assert_type(out, {"tp": V})

    assert registration_of(Double).kind == "typecheck_forward"
    assert spmd.get_type(Double.apply(spmd.assert_type(torch.randn(2), {"tp": V}))) == {"tp": V}


def test_existing_hooked_functions_are_found_when_checking_starts():
    """A Function made before the package could see it (torch's own, say) is registered by the outermost typecheck()."""
    unregister_autograd_function(LinearAllReduce)
    hook_registration._SEEN.discard(LinearAllReduce)
    assert registration_of(LinearAllReduce) is None
    with simulate((2,), ("tp",)), spmd.typecheck():
        assert registration_of(LinearAllReduce).kind == "spmd_typecheck"


# ---------------------------------------------------------------------------
# rules on their own (type level)


def test_einsum_rules(global_ranks):
    x = spmd.assert_type(torch.randn(4, 6), {"tp": S(1)})
    w = spmd.assert_type(torch.randn(3, 6), {"tp": S(1)})
    y = rules.einsum("mk,nk->mn", x, w)
    assert isinstance(y, rules.NdimWithSpmdType) and y.ndim == 2
    assert spmd.get_local_type(y) == {spmd.normalize_axis("tp"): P} and y.partition_spec is None
    kept = rules.einsum("mk->km", x)
    assert spmd.get_partition_spec(kept) == PS("tp", None) and spmd.get_local_type(kept)[spmd.normalize_axis("tp")] is V
    p = rules.reinterpret(rules.einsum("mk->mk", spmd.assert_type(torch.randn(2, 2), {"tp": S(0)})), "tp", src=V,
                          dst=P)
    r = spmd.assert_type(torch.randn(2, 2), {"tp": R})
    kept_v = rules.einsum("k->k", spmd.assert_type(torch.randn(4), {"tp": S(0)}))
    kept_v.partition_spec = None  # V with no layout (as in a local region): it cannot broadcast over a sharded label
    assert spmd.get_local_type(rules.einsum("ab,ab->ab", p, r, linear_in=(0,)))[spmd.normalize_axis("tp")] is P
    cases = [
        (lambda: rules.einsum("ab,ab->ab", p, r), "rules.einsum: 'ab,ab->ab': operand(s) [0] are P on axis tp; a P "
         "passes only through operands the op is linear in, all in one linear_in group"),
        (lambda: rules.einsum("ab,ab->ab", p, r, linear_in=((0, 1),)), "rules.einsum: 'ab,ab->ab': operands [0, 1] are "
         "jointly linear, so on axis tp all or none of them are P"),
        (lambda: rules.einsum("m_->m", x), "rules.einsum: operand 0 of 'm_->m' is sharded at dim 1, which the "
         "equation marks '_' (must not be sharded)"),
        (lambda: rules.einsum("mk,m->mk", x, kept_v), "rules.einsum: operand 1 "
         "of 'mk,m->mk' broadcasts over 'k', which is sharded on tp, so it must not be V there"),
        (lambda: rules.einsum("ab,ab->ab", r, spmd.assert_type(torch.randn(2, 2), {"tp": I})), "rules.einsum: "
         "'ab,ab->ab': I mixes with ['R'] on axis tp; convert first"),
    ]
    for call, text in cases:
        with pytest.raises(spmd.SpmdTypeError) as info:
            call()
        assert str(info.value) == text
    with pytest.raises(TypeError) as info:
        rules.einsum("ab->ab,ba", r)
    assert str(info.value) == "rules.einsum: 'ab->ab,ba' lists several outputs; write one rules.einsum per output"


def test_collective_rules(global_ranks):
    x = spmd.assert_type(torch.randn(4, 6), {"tp": S(0)})
    tp = spmd.normalize_axis("tp")
    g = rules.all_gather(x, "tp", src=S(0), dst=R)
    assert spmd.get_local_type(g) == {tp: R} and g.partition_spec is None
    stacked = rules.all_gather(rules.NdimWithSpmdType(1, {tp: V}), "tp", src=V, dst=I)  # V stacks: a new dim
    assert stacked.ndim == 2 and spmd.get_local_type(stacked) == {tp: I}
    p = rules.convert(g, "tp", src=R, dst=P)
    s = rules.reduce_scatter(p, "tp", src=P, dst=S(1))
    assert spmd.get_partition_spec(s) == PS(None, "tp")
    moved = rules.all_to_all(s, global_ranks.get_group("tp"), src=S(1), dst=S(0))
    assert spmd.get_partition_spec(moved) == PS("tp", None)
    with pytest.raises(spmd.SpmdTypeError) as info:
        rules.all_reduce(x, "tp", src=P, dst=R)
    assert str(info.value) == "rules.all_reduce: src=P, but the value is V on axis tp"
    with pytest.raises(spmd.SpmdTypeError) as info:
        rules.all_gather(x, "tp", src=S(0), dst=P)
    assert str(info.value) == "rules.all_gather: no src=S(0) -> dst=P (allowed: V -> R, V -> I)"


# ---------------------------------------------------------------------------
# rulecheck: a hook against its kernel


class SumsOverGroup(torch.autograd.Function):
    """x @ w.T with the contraction's sum finished by a raw all-reduce; the hook says so."""

    @staticmethod
    def forward(ctx, x, weight, group):
        y = x @ weight.t()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError

    @staticmethod
    def spmd_typecheck(*, x, weight, group):
        return rules.all_reduce(rules.einsum("mk,nk->mn", x, weight), group, src=P, dst=R)


class ForgetsTheSum(SumsOverGroup):
    """The same kernel with a hook that claims the local product is already the whole product."""

    @staticmethod
    def spmd_typecheck(*, x, weight, group):
        return rules.einsum("mk,nk->mn", x, weight)


def test_rulecheck_checks_a_hook_against_its_kernel():
    x, w = torch.randn(4, 6), torch.randn(2, 6)
    report = spmd.rulecheck(SumsOverGroup, (x, w, "tp"))  # spmd.rulecheck is callable, as the module is
    assert {"x": {"tp": S(1)}, "weight": {"tp": S(1)}} in report.checked
    assert {"x": {"tp": S(0)}, "weight": {"tp": R}} in [r.placement for r in report.rejected]
    assert all(isinstance(r.reason, str) and r.reason for r in report.rejected)
    from spmd_types.rulecheck import RuleCheckError, rulecheck

    assert rulecheck(SumsOverGroup, (x, w, "tp"), {"x": {"tp": S(1)}, "weight": {"tp": S(1)}}, mesh={"tp": 2}) is None
    with pytest.raises(RuleCheckError) as info:
        rulecheck(ForgetsTheSum, (x, w, "tp"), {"x": {"tp": R}, "weight": {"tp": R}}, mesh={"tp": 2})
    assert str(info.value).startswith(  # every rank holds 2 x (x @ w.T): R, but not the product
        "ForgetsTheSum output 0 under {'x': {'tp': R}, 'weight': {'tp': R}}: the hook's types reassemble to values "
        "that differ from the kernel on the global inputs (max abs diff ")
