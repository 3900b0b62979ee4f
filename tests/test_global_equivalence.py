"""Global SPMD programs on simulated ranks (LocalTensorMode) equal their single-device versions.

Issue 4, item 6. Each program is written twice: the global SPMD version, typed
and run under ``spmd.typecheck(local=False)`` on per-rank shards, and the plain
single-device version on full tensors. Every output is reassembled by its own
partition spec and types (shards placed by each rank's mesh coordinate, P
summed over ranks, R/I copies checked equal) and compared with the
single-device result; so is the gradient of every input and parameter
(reassembled by the input's spec and its gradient types). The wrong versions
of the same programs (a plain matmul for the row-parallel linear, a softmax
over a sharded dim, ...) are rejected with SpmdTypeError.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _global_programs import DTYPE, Inp, check, reassemble, run_equivalence, shard
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
PS = spmd.PartitionSpec


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=DTYPE)


@pytest.fixture
def tp4():
    return fake_mesh((4,), ("tp",))


@pytest.fixture
def dp2tp2():
    return fake_mesh((2, 2), ("dp", "tp"))


def _i_loss(out, weight, partial_axes=(), r_axes=()):
    """A scalar loss sum(out * weight) that is I on every axis, ready for backward()."""
    loss = spmd.sum(out * weight, out_partial_axes=list(partial_axes) or None)
    for axis in partial_axes:
        loss = spmd.all_reduce(loss, axis, src=P, dst=I)
    for axis in r_axes:
        loss = spmd.convert(loss, axis, src=R, dst=I)
    return loss


# ---------------------------------------------------------------------------
# 1. tensor-parallel MLP: column-parallel, gelu, row-parallel with explicit partial, all_reduce


def _mlp_inputs(batch_types, batch_spec=None, w_extra=None, c_types=None):
    w_extra = w_extra or {}
    return {
        "x": Inp(randn(8, 16, seed=1), batch_types, batch_spec),
        "w1": Inp(randn(32, 16, seed=2), {"tp": S(0), **w_extra}),
        "b1": Inp(randn(32, seed=3), {"tp": S(0), **w_extra}),
        "w2": Inp(randn(16, 32, seed=4), {"tp": S(1), **w_extra}),
        "b2": Inp(randn(16, seed=5), {"tp": R, **w_extra}),
        "c": Inp(randn(8, 16, seed=6), c_types or batch_types, batch_spec, grad=False),  # the loss weights
    }


def _mlp_ref(x, w1, b1, w2, b2, c):
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2) + b2
    return y, (y * c).sum()


@pytest.mark.parametrize("dst", [R, I])
def test_tp_mlp_tp4(tp4, dst):
    def mlp(x, w1, b1, w2, b2, c):
        h = F.gelu(F.linear(x, w1, b1))
        assert spmd.get_partition_spec(h) == PS(None, "tp")
        y = spmd.linear(h, w2, out_partial_axes="tp")
        assert spmd.get_type(y) == {"tp": P}
        y = spmd.all_reduce(y, "tp", src=P, dst=dst)
        if dst is I:
            b2 = spmd.reinterpret(b2, "tp", src=R, dst=I)
        y = y + b2
        loss = _i_loss(y, c, r_axes=["tp"] if dst is R else [])
        return y, loss

    res = run_equivalence(tp4, _mlp_inputs({"tp": R}, c_types={"tp": dst}), mlp, _mlp_ref)
    assert res.out_types[0] == {"tp": dst}
    assert res.grad_types["w1"] == {"tp": S(0)} and res.grad_types["x"] == {"tp": P}
    check(res)


def test_tp_mlp_dp2_tp2(dp2tp2):
    """Batch S(0) on dp; weights R on dp (their gradients are pending sums over dp)."""

    def mlp(x, w1, b1, w2, b2, c):
        h = F.gelu(F.linear(x, w1, b1))
        assert spmd.get_partition_spec(h) == PS("dp", "tp")
        y = spmd.all_reduce(spmd.linear(h, w2, out_partial_axes="tp"), "tp", src=P, dst=R) + b2
        assert spmd.get_partition_spec(y) == PS("dp", None)
        loss = _i_loss(y, c, partial_axes=["dp"], r_axes=["tp"])
        return y, loss

    res = run_equivalence(dp2tp2, _mlp_inputs({"dp": S(0), "tp": R}), mlp, _mlp_ref)
    assert res.grad_types["w1"] == {"dp": P, "tp": S(0)}
    assert res.grad_types["x"] == {"dp": S(0), "tp": P}
    check(res)


def test_tp_mlp_dp2_tp2_invariant_params(dp2tp2):
    """Parameters I on dp (gradients already summed over dp), used through reinterpret(I, R)."""

    def mlp(x, w1, b1, w2, b2, c):
        w1, b1, w2, b2 = (spmd.reinterpret(p, "dp", src=I, dst=R) for p in (w1, b1, w2, b2))
        h = F.gelu(F.linear(x, w1, b1))
        y = spmd.all_reduce(spmd.linear(h, w2, out_partial_axes="tp"), "tp", src=P, dst=R) + b2
        loss = _i_loss(y, c, partial_axes=["dp"], r_axes=["tp"])
        return y, loss

    res = run_equivalence(dp2tp2, _mlp_inputs({"dp": S(0), "tp": R}, w_extra={"dp": I}), mlp, _mlp_ref,
                          backward_inside=False)
    assert res.grad_types["w2"] == {"dp": I, "tp": S(1)}
    check(res)


# ---------------------------------------------------------------------------
# 2. sequence-parallel block: [seq, batch, hidden] activations S(0) on tp


def _sp_inputs(ln_types, seq_extra=None):
    seq = {"tp": S(0), **(seq_extra or {})}
    return {
        "x": Inp(randn(8, 2, 16, seed=11), seq),
        "ln_w": Inp(1 + 0.1 * randn(16, seed=12), ln_types),
        "ln_b": Inp(0.1 * randn(16, seed=13), ln_types),
        "w1": Inp(randn(32, 16, seed=14), {"tp": S(0)}),
        "b1": Inp(randn(32, seed=15), {"tp": S(0)}),
        "w2": Inp(randn(16, 32, seed=16), {"tp": S(1)}),
        "b2": Inp(randn(16, seed=17), {"tp": R}),
        "c": Inp(randn(8, 2, 16, seed=18), seq, grad=False),
    }


def _sp_ref(x, ln_w, ln_b, w1, b1, w2, b2, c):
    h = F.layer_norm(x, (16,), ln_w, ln_b)
    out = x + F.linear(F.gelu(F.linear(h, w1, b1)), w2) + b2
    return h, out, (out * c).sum()


@pytest.mark.parametrize("ln", ["R", "I"])
def test_sequence_parallel_block(tp4, ln):
    def block(x, ln_w, ln_b, w1, b1, w2, b2, c):
        if ln == "I":  # Megatron's sequence-parallel layer-norm weights: gradients all-reduced in backward
            ln_w = spmd.reinterpret(ln_w, "tp", src=I, dst=R)
            ln_b = spmd.reinterpret(ln_b, "tp", src=I, dst=R)
        h = F.layer_norm(x, (16,), ln_w, ln_b)  # per token: fine on a sequence shard
        assert spmd.get_partition_spec(h) == PS("tp", None, None)
        hg = spmd.all_gather(h, "tp", src=S(0), dst=R)
        assert spmd.get_type(hg) == {"tp": R} and spmd.get_partition_spec(hg) == PS(None, None, None)
        a = F.gelu(F.linear(hg, w1, b1))  # column-parallel
        assert spmd.get_partition_spec(a) == PS(None, None, "tp")
        o = spmd.linear(a, w2, out_partial_axes="tp")  # row-parallel
        o = spmd.reduce_scatter(o, "tp", src=P, dst=S(0))
        assert spmd.get_partition_spec(o) == PS("tp", None, None)
        out = x + o + b2
        return h, out, _i_loss(out, c, partial_axes=["tp"])

    res = run_equivalence(tp4, _sp_inputs({"tp": R if ln == "R" else I}), block, _sp_ref)
    assert res.out_types[1] == {"tp": V} and res.out_specs[1] == PS("tp", None, None)
    assert res.grad_types["ln_w"] == {"tp": P if ln == "R" else I}
    check(res)


def test_sequence_parallel_block_dp2_tp2(dp2tp2):
    """The same block with the batch (dim 1) sharded on dp as well."""

    def block(x, ln_w, ln_b, w1, b1, w2, b2, c):
        h = F.layer_norm(x, (16,), ln_w, ln_b)
        hg = spmd.all_gather(h, "tp", src=S(0), dst=R)
        assert spmd.get_partition_spec(hg) == PS(None, "dp", None)
        o = spmd.linear(F.gelu(F.linear(hg, w1, b1)), w2, out_partial_axes="tp")
        out = x + spmd.reduce_scatter(o, "tp", src=P, dst=S(0)) + b2
        assert spmd.get_partition_spec(out) == PS("tp", "dp", None)
        return h, out, _i_loss(out, c, partial_axes=["dp", "tp"])

    res = run_equivalence(dp2tp2, _sp_inputs({"tp": R}, seq_extra={"dp": S(1)}), block, _sp_ref)
    assert res.grad_types["w1"] == {"dp": P, "tp": S(0)}
    check(res)


# ---------------------------------------------------------------------------
# 3. attention with heads sharded on tp; the output projection is row-parallel


def test_attention_heads_sharded(tp4):
    """q, k, v [B, H, S, D] with H S(1) on tp; sdpa; merge heads; row-parallel output projection."""
    b, h, s, d = 2, 8, 6, 4
    heads = {"tp": S(1)}
    inputs = {
        "q": Inp(randn(b, h, s, d, seed=21), heads),
        "k": Inp(randn(b, h, s, d, seed=22), heads),
        "v": Inp(randn(b, h, s, d, seed=23), heads),
        "wo": Inp(randn(16, h * d, seed=24) / 4, {"tp": S(1)}),
        "c": Inp(randn(b, s, 16, seed=25), {"tp": I}, grad=False),
    }

    def ref(q, k, v, wo, c):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = F.linear(o.transpose(1, 2).reshape(b, s, h * d), wo)
        return o, y, (y * c).sum()

    def attn(q, k, v, wo, c):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert spmd.get_partition_spec(o) == PS(None, "tp", None, None)
        merged = o.transpose(1, 2).reshape(b, s, -1)  # local sizes: -1 is this rank's heads * d
        assert spmd.get_partition_spec(merged) == PS(None, None, "tp")
        y = spmd.all_reduce(spmd.linear(merged, wo, out_partial_axes="tp"), "tp", src=P, dst=I)
        return o, y, (y * c).sum()

    check(run_equivalence(tp4, inputs, attn, ref))


@pytest.mark.parametrize("mesh_kind", ["tp4", "dp2tp2"])
def test_attention_block_with_projections(mesh_kind, request):
    """x R on tp -> column-parallel q/k/v projections -> split heads -> sdpa -> row-parallel out proj."""
    mesh = request.getfixturevalue(mesh_kind)
    b, s, e, h = 2, 6, 32, 8
    d = e // h
    batch = {"dp": S(0), "tp": R} if mesh_kind == "dp2tp2" else {"tp": R}
    inputs = {
        "x": Inp(randn(b, s, e, seed=31), batch),
        "wq": Inp(randn(e, e, seed=32) / 6, {"tp": S(0)}),
        "wk": Inp(randn(e, e, seed=33) / 6, {"tp": S(0)}),
        "wv": Inp(randn(e, e, seed=34) / 6, {"tp": S(0)}),
        "wo": Inp(randn(e, e, seed=35) / 6, {"tp": S(1)}),
        "bo": Inp(randn(e, seed=36), {"tp": R}),
        "c": Inp(randn(b, s, e, seed=37), batch, grad=False),
    }

    def ref(x, wq, wk, wv, wo, bo, c):
        q, k, v = (F.linear(x, w).view(b, s, h, d).transpose(1, 2) for w in (wq, wk, wv))
        o = F.scaled_dot_product_attention(q, k, v)
        y = F.linear(o.transpose(1, 2).reshape(b, s, e), wo) + bo
        return y, (y * c).sum()

    def attn(x, wq, wk, wv, wo, bo, c):
        lb = x.shape[0]  # the local batch (b / dp)
        q, k, v = (F.linear(x, w).view(lb, s, -1, d).transpose(1, 2) for w in (wq, wk, wv))
        assert spmd.get_partition_spec(q) == PS("dp" if mesh_kind == "dp2tp2" else None, "tp", None, None)
        o = F.scaled_dot_product_attention(q, k, v)
        merged = o.transpose(1, 2).reshape(lb, s, -1)
        y = spmd.all_reduce(spmd.linear(merged, wo, out_partial_axes="tp"), "tp", src=P, dst=R) + bo
        partial = ["dp"] if mesh_kind == "dp2tp2" else []
        return y, _i_loss(y, c, partial_axes=partial, r_axes=["tp"])

    check(run_equivalence(mesh, inputs, attn, ref))


# ---------------------------------------------------------------------------
# 4. cross-entropy with the batch sharded on dp: explicit pending sum, / global batch, all_reduce to I


def test_cross_entropy_batch_sharded_on_dp():
    mesh = fake_mesh((4,), ("dp",))
    n, k, c = 8, 12, 5
    inputs = {
        "x": Inp(randn(n, k, seed=41), {"dp": S(0)}),
        "w": Inp(randn(c, k, seed=42), {"dp": R}),
        "t": Inp(torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(43)), {"dp": S(0)}, grad=False),
    }

    def ref(x, w, t):
        per_item = F.cross_entropy(F.linear(x, w), t, reduction="none")
        return per_item, per_item.sum() / n

    def loss_fn(x, w, t):
        per_item = F.cross_entropy(F.linear(x, w), t, reduction="none")
        assert spmd.get_partition_spec(per_item) == PS("dp")
        total = spmd.sum(per_item, 0, out_partial_axes="dp") / n  # n: the global batch
        assert spmd.get_type(total) == {"dp": P}
        return per_item, spmd.all_reduce(total, "dp", src=P, dst=I)

    res = run_equivalence(mesh, inputs, loss_fn, ref)
    assert res.out_types[1] == {"dp": I} and res.grad_types["w"] == {"dp": P}
    check(res)


def test_training_step_dp2_tp2(dp2tp2):
    """TP MLP on tp, cross-entropy on a dp-sharded batch; weights I on dp (reinterpret to R for use)."""
    n, k, hid, c = 8, 12, 16, 6
    inputs = {
        "x": Inp(randn(n, k, seed=51), {"dp": S(0), "tp": R}),
        "w1": Inp(randn(hid, k, seed=52) / 3, {"dp": I, "tp": S(0)}),
        "w2": Inp(randn(c, hid, seed=53) / 3, {"dp": I, "tp": S(1)}),
        "t": Inp(torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(54)), {"dp": S(0), "tp": R},
                 grad=False),
    }

    def ref(x, w1, w2, t):
        logits = F.linear(F.relu(F.linear(x, w1)), w2)
        return logits, F.cross_entropy(logits, t)  # reduction="mean" on one device

    def step(x, w1, w2, t):
        w1, w2 = (spmd.reinterpret(w, "dp", src=I, dst=R) for w in (w1, w2))
        hidden = F.relu(F.linear(x, w1))
        logits = spmd.all_reduce(spmd.linear(hidden, w2, out_partial_axes="tp"), "tp", src=P, dst=I)
        per_item = F.cross_entropy(logits, spmd.reinterpret(t, "tp", src=R, dst=I), reduction="none")
        loss = spmd.all_reduce(spmd.sum(per_item, 0, out_partial_axes="dp") / n, "dp", src=P, dst=I)
        assert spmd.get_type(loss) == {"dp": I, "tp": I}
        return logits, loss

    res = run_equivalence(dp2tp2, inputs, step, ref, backward_inside=False)
    assert res.grad_types["w1"] == {"dp": I, "tp": S(0)}
    check(res)


# ---------------------------------------------------------------------------
# more layouts: a dim sharded on two axes, all_to_all between sequence and heads


def test_dim_sharded_on_two_axes(dp2tp2):
    """Tokens sharded on (dp, tp) (dp major): gather tp (the minor axis) then dp, or both at once."""
    inputs = {
        "x": Inp(randn(16, 8, seed=61), {}, PS(("dp", "tp"), None)),
        "g": Inp(1 + 0.1 * randn(8, seed=62), {}),
        "c": Inp(randn(16, 8, seed=63), {"dp": I, "tp": I}, grad=False),
    }

    def ref(x, g, c):
        h = F.layer_norm(x, (8,), g)
        return h, h, (h * c).sum() + (h * c).sum()

    def prog(x, g, c):
        h = F.layer_norm(x, (8,), g)
        assert spmd.get_partition_spec(h) == PS(("dp", "tp"), None)
        h1 = spmd.all_gather(h, "tp", src=S(0), dst=R)
        assert spmd.get_partition_spec(h1) == PS("dp", None)
        h1 = spmd.all_gather(h1, "dp", src=S(0), dst=I)
        h1 = spmd.convert(h1, "tp", src=R, dst=I)
        h2 = spmd.all_gather(h, ("dp", "tp"), src=S(0), dst=I)  # one collective on the flattened group
        assert spmd.get_partition_spec(h2) == PS(None, None) and spmd.get_type(h2) == {"dp": I, "tp": I}
        return h1, h2, (h1 * c).sum() + (h2 * c).sum()

    res = run_equivalence(dp2tp2, inputs, prog, ref)
    assert res.grad_types["g"] == {"dp": P, "tp": P}
    check(res)


def test_gathering_the_major_axis_first_is_rejected(dp2tp2):
    with LocalTensorMode(4) as lm, spmd.set_current_mesh(dp2tp2), spmd.typecheck(local=False):
        x = spmd.assert_type(lm.rank_map(lambda r: torch.randn(4, 8)), {}, partition_spec=PS(("dp", "tp"), None))
        with pytest.raises(spmd.SpmdTypeError, match="can only gather the minor-most mesh axes"):
            spmd.all_gather(x, "dp", src=S(0), dst=R)


def test_ulysses_attention_all_to_all(tp4):
    """Sequence-parallel q, k, v [B, S@tp, H, D] -> all_to_all to heads [B, S, H@tp, D] -> sdpa -> back."""
    b, s, h, d = 2, 8, 4, 4
    seq = {"tp": S(1)}
    inputs = {n: Inp(randn(b, s, h, d, seed=70 + i), seq) for i, n in enumerate("qkv")}
    inputs["c"] = Inp(randn(b, s, h, d, seed=74), seq, grad=False)

    def ref(q, k, v, c):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = o.transpose(1, 2)
        return o, (o * c).sum()

    def prog(q, k, v, c):
        q, k, v = (spmd.all_to_all(t, "tp", src=S(1), dst=S(2)).transpose(1, 2) for t in (q, k, v))
        assert spmd.get_partition_spec(q) == PS(None, "tp", None, None)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        o = spmd.all_to_all(o, "tp", src=S(2), dst=S(1))
        assert spmd.get_partition_spec(o) == PS(None, "tp", None, None)
        return o, _i_loss(o, c, partial_axes=["tp"])

    check(run_equivalence(tp4, inputs, prog, ref))


# ---------------------------------------------------------------------------
# the harness is not vacuous: a program that is well typed but computes something else fails the check


def test_harness_catches_a_wrong_result(tp4):
    def avg_instead_of_sum(x, w1, b1, w2, b2, c):
        y = spmd.linear(F.gelu(F.linear(x, w1, b1)), w2, out_partial_axes="tp")
        y = spmd.all_reduce(y, "tp", src=P, dst=I, op="avg") + spmd.reinterpret(b2, "tp", src=R, dst=I)
        return y, (y * c).sum()

    res = run_equivalence(tp4, _mlp_inputs({"tp": R}, c_types={"tp": I}), avg_instead_of_sum, _mlp_ref)
    with pytest.raises(AssertionError, match="output 0"):
        check(res)


def test_reassemble_places_shards_by_mesh_coordinate(dp2tp2):
    full = torch.arange(16 * 6, dtype=DTYPE).view(16, 6)
    for spec in [(("dp", "tp"), ()), (("tp", "dp"), ()), (("tp",), ("dp",)), (("dp",), ())]:
        types = {a: (V if any(a in e for e in spec) else R) for a in ("dp", "tp")}
        locs = {r: shard(full, spec, dp2tp2, r) for r in range(4)}
        assert torch.equal(reassemble(locs, types, spec, dp2tp2), full)
    # P: the sum over ranks; R: copies must agree
    locs = {r: torch.full((2,), float(r), dtype=DTYPE) for r in range(4)}
    assert torch.equal(reassemble(locs, {"dp": P, "tp": P}, ((),), dp2tp2), torch.full((2,), 6.0, dtype=DTYPE))
    with pytest.raises(AssertionError, match="disagree"):
        reassemble(locs, {"dp": R, "tp": P}, ((),), dp2tp2)


# ---------------------------------------------------------------------------
# a vocabulary-parallel cross-entropy: local SPMD inside spmd.local_map, in a global program


def _vocab_parallel_ce(n_classes, batch=None):
    batch = batch or {}  # the batch's types on the other axes, which stay global inside

    @spmd.local_map(in_types=[{"tp": S(1), **batch}, {"tp": R, **batch}], out_types={"tp": R, **batch}, axes=["tp"])
    def ce(logits, target):
        # logits: this rank's [N, C / tp] block; target: the global class ids, the same on every rank
        # the row maxima of every rank, [tp, N] -> [N] (concatenated on a new dim 0 rather than stacked, which
        # would lose the layout on dp: see test_stacking_collective_on_a_local_axis_keeps_the_global_layout)
        m = spmd.all_gather(logits.detach().amax(1).unsqueeze(0), "tp", src=S(0), dst=R).amax(0)
        shifted = logits - m.unsqueeze(1)
        sumexp = spmd.all_reduce(shifted.exp().sum(1), "tp", src=V, dst=R)
        onehot = (torch.arange(n_classes) == target.unsqueeze(1)).to(logits.dtype)  # [N, C], R
        onehot = spmd.convert(onehot, "tp", src=R, dst=S(1))  # this rank's classes
        picked = spmd.all_reduce((shifted * onehot).sum(1), "tp", src=V, dst=R)
        return sumexp.log() - picked

    return ce


@pytest.mark.parametrize("mesh_kind", ["tp4", "dp2tp2"])
def test_vocab_parallel_cross_entropy_in_local_map(mesh_kind, request):
    mesh = request.getfixturevalue(mesh_kind)
    n, k, c = 8, 6, 12
    batch = {"dp": S(0), "tp": R} if mesh_kind == "dp2tp2" else {"tp": R}
    inputs = {
        "x": Inp(randn(n, k, seed=81), batch),
        "w": Inp(randn(c, k, seed=82), {"tp": S(0)}),
        "t": Inp(torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(83)), batch, grad=False),
    }
    ce = _vocab_parallel_ce(c, {"dp": S(0)} if mesh_kind == "dp2tp2" else None)

    def ref(x, w, t):
        per_item = F.cross_entropy(F.linear(x, w), t, reduction="none")
        return per_item, per_item.mean()

    def prog(x, w, t):
        logits = F.linear(x, w)  # column-parallel: [N, C@tp]
        per_item = ce(logits, t)
        assert spmd.get_type(per_item)["tp"] is R
        if mesh_kind == "dp2tp2":
            assert spmd.get_partition_spec(per_item) == PS("dp")
            loss = spmd.all_reduce(spmd.sum(per_item, out_partial_axes="dp") / n, "dp", src=P, dst=I)
        else:
            loss = per_item.mean()
        return per_item, spmd.convert(loss, "tp", src=R, dst=I)

    check(run_equivalence(mesh, inputs, prog, ref))


# ---------------------------------------------------------------------------
# regressions: package bugs these programs found, as minimal reproductions (all fixed)


def test_local_map_output_under_local_tensor_mode(tp4):
    @spmd.local_map(in_types=[{"tp": R}], out_types={"tp": R})
    def double(x):
        return x * 2

    with LocalTensorMode(4) as lm, spmd.set_current_mesh(tp4), spmd.typecheck(local=False):
        y = double(spmd.assert_type(lm.rank_map(lambda r: torch.ones(2)), {"tp": R}))
        assert spmd.get_type(y) == {"tp": R}


@pytest.mark.parametrize("case", ["unsharded_first", "sharded_first"])
def test_broadcast_with_the_lower_rank_operand_first(tp4, case):
    with LocalTensorMode(4) as lm, spmd.set_current_mesh(tp4), spmd.typecheck(local=False):
        def mk(shape, types):
            return spmd.assert_type(lm.rank_map(lambda r: torch.randn(*shape)), types)

        if case == "unsharded_first":  # R[4] * [8@tp, 4] (the other order works)
            y = mk((4,), {"tp": R}) * mk((2, 4), {"tp": S(0)})
            assert spmd.get_partition_spec(y) == PS("tp", None)
        else:  # [16@tp] + [8, 16@tp]
            y = mk((4,), {"tp": S(0)}) + mk((8, 4), {"tp": S(1)})
            assert spmd.get_partition_spec(y) == PS(None, "tp")


def test_tp_mlp_bias_added_on_the_left_dp2_tp2(dp2tp2):
    """The dp x tp MLP written `b2 + y` instead of `y + b2`."""

    def mlp(x, w1, b1, w2, b2, c):
        y = b2 + spmd.all_reduce(spmd.linear(F.gelu(F.linear(x, w1, b1)), w2, out_partial_axes="tp"), "tp",
                                 src=P, dst=R)
        return y, _i_loss(y, c, partial_axes=["dp"], r_axes=["tp"])

    check(run_equivalence(dp2tp2, _mlp_inputs({"dp": S(0), "tp": R}), mlp, _mlp_ref))


def test_stacking_collective_on_a_local_axis_keeps_the_global_layout(dp2tp2):
    with LocalTensorMode(4) as lm, spmd.set_current_mesh(dp2tp2), spmd.typecheck(local=["tp"]):
        x = spmd.assert_type(lm.rank_map(lambda r: torch.randn(4)), {"dp": S(0), "tp": V})
        y = spmd.all_gather(x, "tp", src=V, dst=R)  # stacked: [2, 8@dp]
        z = y.amax(0)  # today: SpmdTypeError "input has no layout" (y's partition spec is None)
        assert spmd.get_partition_spec(y) == PS(None, "dp") and spmd.get_partition_spec(z) == PS("dp")


def test_class_sharded_cross_entropy_is_rejected_before_it_runs(tp4):
    with LocalTensorMode(4) as lm, spmd.set_current_mesh(tp4), spmd.typecheck(local=False):
        logits = spmd.assert_type(lm.rank_map(lambda r: torch.randn(8, 3)), {"tp": S(1)})  # 12 classes
        target = spmd.assert_type(lm.rank_map(lambda r: torch.arange(8) + 4), {"tp": R})  # ids 4..11
        with pytest.raises(spmd.SpmdTypeError, match="class-sharded cross-entropy"):
            F.cross_entropy(logits, target, reduction="none")


@pytest.mark.parametrize("how", ["matmul", "einsum", "sum"])
def test_row_parallel_written_as_matmul_einsum_or_sum(tp4, how):
    """The row-parallel contraction through spmd.matmul, spmd.einsum, or a product and spmd.sum."""

    def mlp(x, w1, b1, w2, b2, c):
        h = F.gelu(F.linear(x, w1, b1))  # [8, 32@tp]
        if how == "matmul":
            y = spmd.matmul(h, w2.t(), out_partial_axes="tp")
        elif how == "einsum":
            y = spmd.einsum("bk,nk->bn", h, w2, out_partial_axes="tp")
        else:
            y = spmd.sum(h.unsqueeze(1) * w2.unsqueeze(0), 2, out_partial_axes="tp")  # [8, 16, 32@tp] -> [8, 16]
        y = spmd.all_reduce(y, "tp", src=P, dst=R) + b2
        return y, _i_loss(y, c, r_axes=["tp"])

    check(run_equivalence(tp4, _mlp_inputs({"tp": R}), mlp, _mlp_ref))


def test_row_parallel_matmul_forward(tp4):
    def mlp(x, w1, b1, w2, b2, c):
        h = F.gelu(F.linear(x, w1, b1))
        y = spmd.all_reduce(spmd.matmul(h, w2.t(), out_partial_axes="tp"), "tp", src=P, dst=R) + b2
        return y, (y * c).sum()

    check(run_equivalence(tp4, _mlp_inputs({"tp": R}), mlp, _mlp_ref, backward=False))


@pytest.mark.parametrize("local", [True, False])
def test_matmul_backward_on_typed_local_tensors(tp4, local):
    with LocalTensorMode(4) as lm, spmd.set_current_mesh(tp4), spmd.typecheck(local=local):
        w = spmd.assert_type(lm.rank_map(lambda r: torch.randn(4, 2)).requires_grad_(), {"tp": I})
        x = spmd.assert_type(lm.rank_map(lambda r: torch.randn(3, 4)).requires_grad_(), {"tp": I})
        (x @ w).sum().backward()
        assert spmd.get_type(w.grad) == {"tp": I}
