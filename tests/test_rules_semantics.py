"""The typing rules beyond single rows: the seed's combination list, weak scalars and plain
tensors, linear ops on P, in-place ops and ``out=``, and the transformer ops the contract names.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from rules_support import IN_PLACE, NEEDS_R, NOT_LINEAR, P_PLUS, P_TIMES_NON_R, P_TIMES_P, rejects, tp_type, typed  # noqa: F401

import spmd_types as spmd
from spmd_types import I, P, R, V
from spmd_types._local.op_registry import ENTRIES

# ---------------------------------------------------------------------------
# the seed's combination list


def test_op_of_r_is_r(x):
    assert tp_type(torch.exp(x.r) + x.r * x.r) is R


def test_op_of_i_is_i(x):
    assert tp_type(torch.exp(x.i) + x.i * x.i) is I


def test_op_of_v_is_v(x):
    assert tp_type(torch.exp(x.v) + x.v * x.v) is V


def test_op_of_r_and_v_is_v(x):
    assert tp_type(x.r + x.v) is V
    assert tp_type(torch.maximum(x.v, x.r)) is V
    assert tp_type(x.r @ x.v) is V


def test_shard_is_varying(x):
    assert tp_type(x.s0 + x.r).is_varying
    assert tp_type(x.s0 * x.v).is_varying


def test_linear_op_of_p_is_p(x):
    assert tp_type(torch.neg(x.p)) is P
    assert tp_type(x.p.sum()) is P
    assert tp_type(x.p.t()) is P


def test_p_plus_p_is_p(x):
    assert tp_type(x.p + x.p) is P
    assert tp_type(x.p - x.p) is P
    assert tp_type(torch.add(x.p, x.p, alpha=2)) is P


@pytest.mark.parametrize("other", ["r_grad", "v", "p"])
def test_invariant_never_mixes(x, other):
    with pytest.raises(spmd.SpmdTypeError):
        x.i + getattr(x, other)
    with pytest.raises(spmd.SpmdTypeError):
        getattr(x, other) * x.i


def test_invariant_with_r_names_the_fix(x):
    with pytest.raises(spmd.SpmdTypeError) as err:
        x.i * x.r_grad
    assert "Invariant (I) values only combine with other I values" in err.value.rule
    assert any("src=spmd.I, dst=spmd.R" in f for f in err.value.fixes)


def test_p_times_p_rejected(x):
    with rejects(P_TIMES_P):
        x.p * x.p
    with rejects(P_TIMES_P):
        torch.mul(x.p, x.p)


def test_p_times_v_rejected(x):
    with rejects("multiplied by a Replicate"):
        x.p * x.v
    with rejects("multiplied by a Replicate"):
        x.v @ x.p


@pytest.mark.parametrize("op", [torch.exp, torch.tanh, torch.sigmoid, torch.abs, torch.relu, torch.rsqrt])
def test_p_through_nonlinear_rejected(x, op):
    with rejects("is not linear in input"):
        op(x.p)


def test_p_in_divisor_or_exponent_rejected(x):
    with rejects("not linear in other"):
        x.r / x.p
    with rejects("not linear in other"):
        torch.div(x.p, x.p)
    with rejects("not linear"):
        x.r ** x.p
    with rejects("not linear"):
        x.p ** 2


def test_p_times_r_and_p_over_r_accepted(x):
    assert tp_type(x.p * x.r) is P
    assert tp_type(x.r * x.p) is P
    assert tp_type(x.p / x.r) is P
    assert tp_type(torch.div(x.p, x.r)) is P


def test_p_plus_r_rejected(x):
    with rejects(P_PLUS):
        x.p + x.r
    with rejects(P_PLUS):
        x.v - x.p


# ---------------------------------------------------------------------------
# weak Python scalars and plain tensors


@pytest.mark.parametrize("name", ["r", "i", "v", "p"])
def test_scalar_times_keeps_type(x, name):
    t = getattr(x, name)
    want = spmd.get_type(t)["tp"]
    assert tp_type(t * 2) is want
    assert tp_type(2 * t) is want
    assert tp_type(t / 2) is want
    assert tp_type(-t) is want


def test_scalar_plus(x):
    assert tp_type(x.r + 1) is R
    assert tp_type(1 - x.v) is V
    assert tp_type(x.i + 1) is I
    with rejects("adds a constant to P"):
        x.p + 1
    with rejects("adds a constant to P"):
        1 - x.p


def test_adding_zero_to_p_is_p(x):
    assert tp_type(x.p + 0) is P
    assert tp_type(torch.where(x.mask, x.p, 0.0)) is P


def test_scalar_nonlinear(x):
    assert tp_type(x.r ** 2) is R
    assert tp_type(1 / x.r) is R
    with pytest.raises(spmd.SpmdTypeError):
        1 / x.p


def test_plain_tensor_is_weak(x):
    plain = torch.randn(4, 4)
    assert tp_type(x.r + plain) is R
    assert tp_type(plain * x.v) is V
    assert tp_type(x.p * plain) is P
    assert tp_type(plain @ x.p) is P
    assert tp_type(torch.cat([x.v, plain])) is V
    with rejects("adds a constant to P"):
        x.p + plain


def test_plain_only_stays_plain(x):
    out = torch.randn(2) + torch.randn(2)
    assert spmd.get_type(out) is None


def test_strict_rejects_plain_tensor(x):
    plain = torch.randn(4, 4)
    with spmd.typecheck(strict=True):
        with pytest.raises(spmd.SpmdTypeError) as err:
            x.r + plain
        assert "Strict typechecking" in err.value.rule
        assert "plain (untyped) tensor" in err.value.rule
        assert err.value.fixes == ("spmd.assert_type(plain, {'dp': spmd.R, 'tp': spmd.R})",)
        # Python scalars stay weak under strict checking
        assert tp_type(x.r + 1) is R
        assert tp_type(x.p * 2) is P


# ---------------------------------------------------------------------------
# linear ops on P


LINEAR_ON_P = {
    "getitem": lambda p: p[0],
    "getitem_int_list": lambda p: p[[0, 2]],
    "slice": lambda p: p[:, 1:3],
    "slice_step": lambda p: p[::2],
    "ellipsis_none": lambda p: p[..., None],
    "linear_w_R": None,  # below
    "to_dtype": lambda p: p.to(torch.float64),
    "to_kw": lambda p: p.to(dtype=torch.bfloat16),
    "float": lambda p: p.double().float(),
    "type_as": lambda p: p.type_as(torch.zeros(1, dtype=torch.float64)),
    "cat": lambda p: torch.cat([p, p], dim=1),
    "stack": lambda p: torch.stack([p, p]),
    "mean": lambda p: p.mean(),
    "mean_dim": lambda p: torch.mean(p, dim=-1, keepdim=True),
    "sum": lambda p: p.sum(),
    "sum_dim": lambda p: torch.sum(p, dim=(0, 1)),
    "view": lambda p: p.view(2, 8),
    "reshape": lambda p: p.reshape(-1),
    "permute": lambda p: p.permute(1, 0),
    "transpose": lambda p: p.transpose(0, 1),
    "T": lambda p: p.T,
    "contiguous": lambda p: p.t().contiguous(),
    "expand": lambda p: p[None].expand(3, 4, 4),
    "unsqueeze": lambda p: p.unsqueeze(0),
    "squeeze": lambda p: p[None].squeeze(0),
    "flatten": lambda p: p.flatten(),
    "split": lambda p: p.split(2),
    "chunk": lambda p: p.chunk(2, dim=1),
    "unbind": lambda p: p.unbind(0),
    "clone": lambda p: p.clone(),
    "cumsum": lambda p: p.cumsum(0),
    "repeat": lambda p: p.repeat(2, 1),
    "narrow": lambda p: p.narrow(0, 1, 2),
    "triu": lambda p: torch.triu(p),
    "neg": lambda p: -p,
    "pad_zero": lambda p: F.pad(p, (1, 1)),
    "masked_fill_zero": lambda p: p.masked_fill(torch.eye(4, dtype=torch.bool), 0),
}


@pytest.mark.parametrize("name", [k for k in LINEAR_ON_P if LINEAR_ON_P[k] is not None])
def test_linear_op_on_p(x, name):
    out = LINEAR_ON_P[name](x.p)
    outs = out if isinstance(out, (list, tuple)) else [out]
    assert outs and all(tp_type(o) is P for o in outs)


def test_f_linear_on_p(x):
    assert tp_type(F.linear(x.p, x.r)) is P
    assert tp_type(F.linear(x.r, x.p)) is P  # linear in the weight too
    assert tp_type(F.linear(x.p, x.r, x.p[0])) is P  # a P bias is a P term
    assert tp_type(F.linear(x.v, x.r, x.r[0])) is V
    with rejects(P_TIMES_P):
        F.linear(x.p, x.p)
    with rejects(P_TIMES_NON_R):
        F.linear(x.p, x.v)


# ---------------------------------------------------------------------------
# in-place ops and out=


def test_inplace_changing_type_rejected(x):
    # destinations that carry a gradient (without one, and unaliased, R may become V: tests/test_inplace_to_varying.py)
    with rejects("from R to V"):
        (x.r_grad * 1).add_(x.v)
    with rejects(P_TIMES_P):
        x.p.clone().mul_(x.p)
    with rejects("from R to P"):
        x.r.clone().mul_(x.p)
    r = x.r_grad * 1
    with rejects("from R to V"):
        r += x.v
    with rejects(P_PLUS):
        x.p.clone().add_(1)


def test_inplace_keeping_type_accepted(x):
    p = x.p.clone()
    out = p.add_(x.p)
    assert out is p and tp_type(p) is P
    v = x.v.clone()
    assert tp_type(v.add_(x.r)) is V
    p2 = x.p.clone()
    p2 *= x.r
    p2 += x.p
    p2 /= 2
    assert tp_type(p2) is P
    s0 = x.s0.clone()
    assert tp_type(s0.mul_(x.v)).is_varying
    r = x.r.clone()
    assert tp_type(r.zero_()) is R
    assert tp_type(x.p.clone().masked_fill_(x.mask, 0)) is P


def test_out_argument(x):
    with rejects("out= tensor from R to V"):
        torch.add(x.r, x.v, out=x.r_grad * 1)
    dest = x.v.clone()
    out = torch.add(x.r, x.v, out=dest)
    assert out is dest and tp_type(dest) is V
    with rejects("plain"):
        torch.mul(x.p, x.r, out=torch.empty(4, 4))
    assert tp_type(torch.matmul(x.p, x.r, out=x.p.clone())) is P


def test_setitem(x):
    p = x.p.clone()
    p[0] = x.p[1]
    p[1:3, 0] = 0.0  # zero is a valid pending sum
    assert tp_type(p) is P
    with rejects(P_PLUS):
        p[0] = x.r[0]
    with rejects(P_PLUS):
        p[0] = 1.0
    r = x.r_grad * 1
    r[x.idx] = x.r[:2]
    assert tp_type(r) is R
    with rejects("from R to V"):
        r[0] = x.v[0]
    v = x.v.clone()
    v[0] = x.r[0]  # R data written into V keeps V
    assert tp_type(v) is V
    with rejects("not linear in index"):
        p[x.idx_p] = x.p[:2]


# ---------------------------------------------------------------------------
# where, masked_fill and the transformer ops


def test_where(x):
    assert tp_type(torch.where(x.mask, x.p, x.p)) is P
    assert tp_type(torch.where(x.mask, x.r, x.v)) is V
    assert tp_type(torch.where(x.mask_v, x.r, x.r)) is V
    with rejects(P_PLUS):
        torch.where(x.mask, x.p, x.r)
    with rejects(NEEDS_R):
        torch.where(x.mask_v, x.p, x.p)
    with rejects(P_PLUS):
        torch.where(x.mask, x.p, 1.0)


def test_masked_fill(x):
    assert tp_type(x.p.masked_fill(x.mask, 0)) is P
    assert tp_type(torch.masked_fill(x.p, x.mask, 0.0)) is P
    assert tp_type(x.r.masked_fill(x.mask, -math.inf)) is R
    assert tp_type(x.v.masked_fill(x.mask, -math.inf)) is V
    with rejects(NOT_LINEAR + " input"):
        x.p.masked_fill(x.mask, -math.inf)
    with rejects(NOT_LINEAR):
        x.p.masked_fill(x.mask, 1)
    with rejects(NEEDS_R):
        x.p.masked_fill(x.mask_v, 0)


def _qkv(t):
    return t.view(1, 1, 4, 4)


def test_sdpa_linear_in_value_only(x):
    assert tp_type(F.scaled_dot_product_attention(_qkv(x.r), _qkv(x.r), _qkv(x.p))) is P
    assert tp_type(F.scaled_dot_product_attention(_qkv(x.v), _qkv(x.v), _qkv(x.v), is_causal=True)) is V
    for q, k in ((x.p, x.r), (x.r, x.p)):
        with rejects(NOT_LINEAR):
            F.scaled_dot_product_attention(_qkv(q), _qkv(k), _qkv(x.r))
    with rejects(NEEDS_R):
        F.scaled_dot_product_attention(_qkv(x.v), _qkv(x.r), _qkv(x.p))
    with rejects(NOT_LINEAR + " attn_mask"):  # the mask is not linear
        F.scaled_dot_product_attention(_qkv(x.r), _qkv(x.r), _qkv(x.p), attn_mask=_qkv(x.p))


def test_embedding_linear_in_weight(x):
    assert tp_type(F.embedding(x.idx, x.p)) is P
    assert tp_type(F.embedding(x.idx, x.r)) is R
    assert tp_type(F.embedding(x.idx_v, x.r)) is V
    with rejects("not linear in input"):
        F.embedding(x.idx_p, x.r)
    with rejects(NEEDS_R):
        F.embedding(x.idx_v, x.p)


def test_cross_entropy(x):
    assert tp_type(F.cross_entropy(x.v, x.target)) is V
    with rejects("F.cross_entropy is not linear in input"):
        F.cross_entropy(x.p, x.target)


NONLINEAR_NN = {
    "softmax": lambda t: F.softmax(t, -1),
    "tensor.softmax": lambda t: t.softmax(-1),
    "torch.softmax": lambda t: torch.softmax(t, -1),
    "log_softmax": lambda t: F.log_softmax(t, -1),
    "layer_norm": lambda t: F.layer_norm(t, (4,)),
    "rms_norm": lambda t: F.rms_norm(t, (4,)),
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "dropout": lambda t: F.dropout(t, 0.5),
}


@pytest.mark.parametrize("name", list(NONLINEAR_NN))
def test_nn_nonlinear_rejects_p(x, name):
    fn = NONLINEAR_NN[name]
    assert tp_type(fn(x.r)) is R
    assert tp_type(fn(x.v)) is V
    with rejects(NOT_LINEAR + " input"):
        fn(x.p)


def test_norm_weight_must_match(x):
    assert tp_type(F.layer_norm(x.r, (4,), weight=x.r[0])) is R
    with rejects("Invariant"):
        F.layer_norm(x.r_grad, (4,), weight=x.i[0])
    # the same weight over an input that carries no gradient: no backward reaches the mix (issue 9)
    assert tp_type(F.layer_norm(x.r, (4,), weight=x.i[0])) is I


# ---------------------------------------------------------------------------
# ops not in the table, factories, metadata, backward


def test_unknown_op_is_nonlinear(x):
    assert torch.cosh not in ENTRIES and torch.Tensor.cosh not in ENTRIES
    assert tp_type(torch.cosh(x.r)) is R
    assert tp_type(torch.cosh(x.v)) is V
    with pytest.raises(spmd.SpmdTypeError) as err:
        torch.cosh(x.p)
    assert "torch.cosh is not in the typing-rules table, so it is treated as non-linear" in err.value.rule
    with pytest.raises(spmd.SpmdTypeError) as err:
        x.p.cosh()
    assert "Tensor.cosh is not in the typing-rules table" in err.value.rule


def test_factories(x):
    assert tp_type(torch.zeros_like(x.p)) is P
    assert tp_type(torch.full_like(x.p, 0)) is P
    assert tp_type(torch.ones_like(x.p)) is R
    assert tp_type(torch.rand_like(x.p)) is R
    assert tp_type(torch.full_like(x.p, 3.0)) is R
    assert tp_type(x.p.new_ones(2)) is R
    assert tp_type(x.p.new_full((2,), 5.0)) is R
    assert tp_type(torch.ones_like(x.v)) is V
    assert tp_type(torch.ones_like(x.i)) is I
    # x.new_*(size): a new constant of its own shape, R on every axis whatever x is (the published API's meaning)
    for made in (x.p.new_zeros(2), x.v.new_zeros(()), x.i.new_empty(3), x.v.new_tensor([1.0, 2.0])):
        assert spmd.get_type(made) == {"dp": R, "tp": R}


def test_metadata_never_rejects(x):
    assert x.p.shape == (4, 4)
    assert x.p.size(0) == 4 and x.p.dim() == 2 and x.p.numel() == 16 and len(x.p) == 4
    assert x.p.dtype is torch.float32 and x.p.is_cpu and not x.p.requires_grad
    for value in (x.p.size(), x.p.numel(), x.p.is_contiguous(), x.p.stride()):
        assert not isinstance(value, torch.Tensor)


def test_grad_attributes_on_p(x):
    leaf = spmd.assert_type(torch.randn(4, requires_grad=True), {"dp": I, "tp": P})
    assert leaf.grad is None
    (leaf * 2).sum().backward()
    assert spmd.get_type(leaf.grad) == {"dp": I, "tp": R}  # backward_type of {dp: I, tp: P}
    leaf.grad = None
    leaf.requires_grad = True
    leaf.data = torch.zeros(4)
    assert leaf.grad is None and spmd.get_type(leaf) == {"dp": I, "tp": P}


def test_backward_from_r_scalar_rejected(x):
    w = typed(torch.randn(4, requires_grad=True), R)
    loss = (w * 2).sum()
    with rejects("backward() from a Replicate (R) value"):
        loss.backward()


def test_backward_from_invariant_scalar_accepted(x):
    w = spmd.assert_type(torch.randn(4, requires_grad=True), {"dp": I, "tp": I})
    (w * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((4,), 2.0))


def test_backward_with_explicit_gradient_accepted(x):
    w = typed(torch.randn(4, requires_grad=True), R)
    (w * 2).sum().backward(torch.ones(()))
    assert w.grad is not None


def test_unchecked_outside_typecheck(mesh):
    with spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            p = typed(torch.randn(4), P)
        out = p * p  # erased: no checking outside typecheck()
    assert out.shape == (4,)


def test_result_cache_tells_fill_values_apart(x):
    assert tp_type(F.pad(x.p, (1, 1))) is P
    with rejects(NOT_LINEAR + " input"):
        F.pad(x.p, (1, 1), value=1.0)


def test_keyword_spellings_of_linear_arguments(x):
    """Linear arguments passed by keyword (their names differ per op) are still terms, not constants."""
    idx = torch.zeros(1, 4, dtype=torch.long)
    assert tp_type(torch.addmv(x.p[0], mat=x.p, vec=x.r[0])) is P
    assert tp_type(x.p.scatter(0, idx, src=x.p[:1])) is P
    assert tp_type(x.p.scatter(0, idx, value=0.0)) is P
    assert tp_type(x.p.index_put((x.idx,), values=x.p[:2])) is P
    for bad in (
        lambda: torch.addmv(x.p[0], mat=x.r, vec=x.r[0]),
        lambda: torch.addr(x.p, vec1=x.r[0], vec2=x.r[0]),
        lambda: torch.baddbmm(x.p[None], batch1=x.r[None], batch2=x.r[None]),
        lambda: x.p.scatter_add(0, idx, src=x.r[:1]),
        lambda: x.p.scatter(0, idx, value=1.0),
        lambda: x.p.index_put((x.idx,), values=x.r[:2]),
    ):
        with rejects(P_PLUS):
            bad()
