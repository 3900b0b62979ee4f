"""Writing values into a buffer of zeros: the buffer takes the values' type (issue 16, item 1; choice 30).

Found on unmodified Megatron-core 0.16.1 (``moe_utils.unpermute``): ``torch.zeros(...).scatter_add_(0, idx, x)``
was refused with ``x`` typed P ("adds a constant to P") and with ``x`` typed V ("writes a typed result
into a plain tensor"), although adding into zeros is exactly the sum. Every op of the rows that write
values into a tensor (the ``zero_buffer`` rows of the rules table), in every form (in place, out of
place, ``torch.`` function), is typed here with accepted and rejected cases, and every accepted case
runs on simulated ranks against one device, forward and gradient. The last section runs Megatron's own
``permute`` and ``unpermute``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import fake_mesh
from rules_support import IN_PLACE, NOT_LINEAR, P_PLUS, rejects, tp_type
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types import I, P, R, V
from spmd_types._core.types import backward_type
from spmd_types.testing import denote, per_rank, random_value

N = 2
INTO_PLAIN = "writes a typed result into a plain (untyped) tensor"


# ---------------------------------------------------------------------------
# the ops: write ``v`` (4 x 4, or any shape with 4 rows) into ``buf`` along dim 0


def _rows(v: torch.Tensor) -> torch.Tensor:
    """Row indices with a repeat (row 0 gets two rows of v) and a row never written (row 1)."""
    return torch.tensor([0, 2, 0, 3])


def _grid(v: torch.Tensor) -> torch.Tensor:
    """A scatter index of v's shape whose entries repeat within columns."""
    return torch.arange(v.numel()).view(v.shape) % 3


def _perm(v: torch.Tensor) -> torch.Tensor:
    return torch.tensor([3, 0, 2, 1])


def _perm_grid(v: torch.Tensor) -> torch.Tensor:
    """A scatter index that writes every row once per column (no two values land on one entry)."""
    return torch.stack([torch.roll(torch.arange(4), k) for k in range(v.shape[1])], 1)


def _mask(v: torch.Tensor) -> torch.Tensor:
    return torch.arange(16).view(4, 4) % 3 != 1


def _set(b: torch.Tensor, index: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b[index] = v
    return b


ACCUMULATE = {
    "Tensor.scatter_add_": lambda b, v: b.scatter_add_(0, _grid(v), v),
    "Tensor.scatter_add": lambda b, v: b.scatter_add(0, _grid(v), v),
    "torch.scatter_add": lambda b, v: torch.scatter_add(b, 0, _grid(v), v),
    "Tensor.index_add_": lambda b, v: b.index_add_(0, _rows(v), v),
    "Tensor.index_add": lambda b, v: b.index_add(0, _rows(v), v, alpha=2),
    "torch.index_add": lambda b, v: torch.index_add(b, 0, _rows(v), v),
    "Tensor.index_put_": lambda b, v: b.index_put_((_rows(v),), v, accumulate=True),
    "Tensor.index_put": lambda b, v: b.index_put((_rows(v),), v, accumulate=True),
    "torch.index_put": lambda b, v: torch.index_put(b, (_rows(v),), v, accumulate=True),
    "torch.index_put_": lambda b, v: torch.index_put_(b, (_rows(v),), v, accumulate=True),
    "Tensor.scatter_reduce_": lambda b, v: b.scatter_reduce_(0, _grid(v), v, "sum"),
    "Tensor.scatter_reduce": lambda b, v: b.scatter_reduce(0, _grid(v), v, reduce="sum", include_self=False),
    "torch.scatter_reduce": lambda b, v: torch.scatter_reduce(b, 0, _grid(v), v, "sum"),
}
# Writing without adding: into zeros, the values alone again.
OVERWRITE = {
    "Tensor.index_copy_": lambda b, v: b.index_copy_(0, _perm(v), v),
    "torch.index_copy": lambda b, v: torch.index_copy(b, 0, _perm(v), v),
    "Tensor.scatter_": lambda b, v: b.scatter_(0, _perm_grid(v), v),
    "torch.scatter": lambda b, v: torch.scatter(b, 0, _perm_grid(v), src=v),
    "Tensor.index_put_(accumulate=False)": lambda b, v: b.index_put_((_perm(v),), v),
    "Tensor.masked_scatter_": lambda b, v: b.masked_scatter_(_mask(v), v),
    "Tensor.masked_scatter": lambda b, v: b.masked_scatter(_mask(v), v),
    "Tensor.__setitem__": lambda b, v: _set(b, _perm(v), v),
}
OPS = {**ACCUMULATE, **OVERWRITE}
IN_PLACE_OPS = [k for k in OPS if k.split("(")[0].endswith("_") or k == "Tensor.__setitem__"]
OUT_OF_PLACE_OPS = [k for k in OPS if k not in IN_PLACE_OPS]


def _types(t) -> dict:
    return {"dp": R, "tp": t}


# ---------------------------------------------------------------------------
# typing, on the (dp=2, tp=4) fake mesh: accepted


@pytest.mark.parametrize("values", ["p", "v", "r", "i"])
@pytest.mark.parametrize("op", list(OPS))
def test_a_plain_buffer_of_zeros_takes_the_values_type(x, op, values):
    src = getattr(x, values)
    buf = torch.zeros(4, 4)
    out = OPS[op](buf, src)
    assert tp_type(out) is spmd.get_type(src)["tp"]
    if op in IN_PLACE_OPS:
        assert out is buf and tp_type(buf) is spmd.get_type(src)["tp"]  # the buffer itself is now typed


# (buffer, values) -> the result: the ordinary rule refuses each of these, and the zeros make them the values alone
TYPED_ZEROS = [("v", "p", P), ("r", "p", P), ("p", "v", V), ("p", "r", R), ("v", "i", I), ("i", "p", P)]


@pytest.mark.parametrize(("buffer", "values", "want"), TYPED_ZEROS)
@pytest.mark.parametrize("op", OUT_OF_PLACE_OPS)
def test_a_typed_buffer_of_zeros_takes_the_values_type_out_of_place(x, op, buffer, values, want):
    buf = torch.zeros_like(getattr(x, buffer))
    assert tp_type(buf) is spmd.get_type(getattr(x, buffer))["tp"]
    assert tp_type(OPS[op](buf, getattr(x, values))) is want


def test_new_zeros_and_zero_make_buffers_of_zeros_too(x):
    assert tp_type(x.v.new_zeros(4, 4).index_add(0, _rows(x.p), x.p)) is P
    assert tp_type(x.r.clone().zero_().scatter_add(0, _grid(x.p), x.p)) is P
    assert tp_type(torch.full((4, 4), 0.0).index_add_(0, _rows(x.p), x.p)) is P


def test_where_the_ordinary_rule_accepts_its_type_stands(x):
    """A V buffer of zeros with R values is V by the ordinary rule (sound, if less precise): the values are not read."""
    assert tp_type(torch.zeros_like(x.v).index_add(0, _rows(x.r), x.r)) is V
    assert tp_type(torch.zeros_like(x.p).index_add(0, _rows(x.p), x.p)) is P


def test_a_typed_index_must_still_be_r_beside_p_values(x):
    assert tp_type(torch.zeros(4).index_add(0, x.idx, x.p[:2, 0])) is P


def test_the_buffer_of_zeros_is_accepted_under_strict_mode(mesh):
    with spmd.set_current_mesh(mesh), spmd.typecheck(strict=True):
        p = spmd.assert_type(torch.randn(4, 4), _types(P))
        buf = torch.zeros(4, 4)
        buf.scatter_add_(0, spmd.assert_type(_grid(p), _types(R)), p)
        assert tp_type(buf) is P
        with rejects("Strict typechecking"):
            torch.ones(4, 4).scatter_add(0, spmd.assert_type(_grid(p), _types(R)), p)


# ---------------------------------------------------------------------------
# typing: rejected


@pytest.mark.parametrize("op", list(OPS))
def test_a_buffer_that_is_not_all_zeros_keeps_the_ordinary_rule(x, op):
    buf = torch.zeros(4, 4)
    buf[1, 2] = 1.0
    with rejects(P_PLUS):
        OPS[op](buf, x.p)
    typed = spmd.assert_type(torch.zeros(4, 4), _types(V))
    typed[1, 2] = 1.0  # a V buffer that holds one non-zero: P values would be added to a per-rank value
    with rejects(P_PLUS):
        OPS[op](typed, x.p)


@pytest.mark.parametrize("op", IN_PLACE_OPS)
def test_typed_values_written_in_place_into_a_plain_buffer_that_is_not_zeros(x, op):
    buf = torch.ones(4, 4)
    with rejects(INTO_PLAIN):
        OPS[op](buf, x.v)
    assert spmd.get_type(buf) is None


@pytest.mark.parametrize("op", list(OPS))
def test_a_buffer_of_zeros_that_carries_a_gradient_keeps_the_ordinary_rule(x, op):
    """Reading its type as the values' would give its gradient the values' backward type."""
    buf = torch.zeros(4, 4, requires_grad=True) * 1.0  # not a leaf, so it may be written in place
    with rejects(P_PLUS):
        OPS[op](buf, x.p)


@pytest.mark.parametrize("op", IN_PLACE_OPS)
def test_a_plain_buffer_sharing_its_storage_is_not_typed_in_place(x, op):
    """A view, the tensor viewed, or an alias typed before would keep its own type and hold the new values."""
    whole = torch.zeros(8, 4)
    with rejects(P_PLUS):
        OPS[op](whole[:4], x.p)
    with rejects(INTO_PLAIN):
        OPS[op](whole[4:], x.v)
    viewed = torch.zeros(4, 4)
    flat = viewed.view(16)
    with rejects(P_PLUS):
        OPS[op](viewed, x.p)
    assert spmd.get_type(flat) is None
    buf = torch.zeros(4, 4)
    typed_alias = spmd.assert_type(buf.view(4, 4), _types(R))  # a typed view of it
    with rejects(INTO_PLAIN):
        OPS[op](buf, x.v)
    assert spmd.get_type(buf) is None and tp_type(typed_alias) is R


@pytest.mark.parametrize("op", IN_PLACE_OPS)
def test_a_view_taken_and_dropped_before_the_write_does_not_count(x, op):
    buf = torch.zeros(4, 4)
    flat = buf.view(16)
    del flat
    assert tp_type(OPS[op](buf, x.v)) is V


@pytest.mark.parametrize("op", IN_PLACE_OPS)
def test_a_typed_buffer_of_zeros_keeps_its_type_in_place(x, op):
    """An in-place op never changes its tensor's type (choice 7); the fix is the out-of-place form."""
    with rejects(IN_PLACE) as err:
        OPS[op](torch.zeros_like(x.v), x.p)
    assert list(err.value.fixes) == ["the out-of-place form, assigning the result (e.g. `x = x + y` for `x += y`)"]


@pytest.mark.parametrize("reduce", ["amax", "amin", "prod", "mean"])
def test_scatter_reduce_other_than_sum_is_not_linear(x, reduce):
    """amax of values and zeros is not their sum (it clips at zero); mean rounds for integer dtypes."""
    with rejects(NOT_LINEAR + " src"):
        torch.zeros(4, 4).scatter_reduce(0, _grid(x.p), x.p, reduce)
    with rejects(NOT_LINEAR + " src"):
        torch.zeros(4, 4).scatter_reduce(0, _grid(x.p), x.p, reduce, include_self=False)
    assert tp_type(torch.zeros(4, 4).scatter_reduce(0, _grid(x.v), x.v, reduce)) is V


def test_scatter_multiply_is_not_linear(x):
    """scatter's deprecated reduce='multiply' multiplies the destination by the values (accepted before as linear)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the reduce argument of scatter is deprecated
        with rejects(NOT_LINEAR + " input"):
            x.p.scatter(0, _grid(x.p), x.p, reduce="multiply")
        assert tp_type(x.p.scatter(0, _grid(x.p), x.p, reduce="add")) is P
        assert tp_type(x.v.scatter(0, _grid(x.p), x.r, reduce="multiply")) is V


def test_the_result_cache_tells_reduce_modes_apart(x):
    assert tp_type(x.p.scatter_reduce(0, _grid(x.p), x.p, "sum")) is P
    with rejects(NOT_LINEAR):
        x.p.scatter_reduce(0, _grid(x.p), x.p, "amax")


def test_a_call_seen_before_still_checks_its_buffer(x):
    """The relaxed type is kept per call signature, but every call's buffer is checked again."""
    for _ in range(2):
        assert tp_type(torch.zeros(4, 4).index_add(0, _rows(x.p), x.p)) is P
        assert tp_type(torch.zeros(4, 4).index_add_(0, _rows(x.p), x.p)) is P
    with rejects(P_PLUS):
        torch.ones(4, 4).index_add(0, _rows(x.p), x.p)
    with rejects(P_PLUS):
        torch.zeros(4, 4, requires_grad=True).index_add(0, _rows(x.p), x.p)
    viewed = torch.zeros(4, 4)
    flat = viewed.view(16)
    with rejects(P_PLUS):
        viewed.index_add_(0, _rows(x.p), x.p)
    assert spmd.get_type(flat) is None and spmd.get_type(viewed) is None
    assert tp_type(torch.zeros(4, 4).index_add_(0, _rows(x.p), x.p)) is P


def test_an_answer_that_relied_on_values_without_gradient_is_kept_per_gradient_bits(x, monkeypatch):
    """I values that need no gradient read as R beside an R index (choice 13); differentiable ones stay I. Each
    answer is kept under the signature extended by the operands' gradient bits, as the result cache keeps its
    own: seen again, neither is inferred again, and neither is read as the other."""
    from spmd_types._checker import zero_buffers

    relaxed = []
    infer = zero_buffers.infer
    monkeypatch.setattr(zero_buffers, "infer", lambda *a, **k: relaxed.append(1) or infer(*a, **k))
    idx = x.idx[None].expand(4, 2).reshape(-1)[:4]
    for _ in range(2):
        assert tp_type(torch.zeros(4, 4).index_add_(0, idx, x.i.detach())) is R
        assert tp_type(torch.zeros(4, 4).index_add_(0, idx, x.i)) is I
    assert len(relaxed) <= 2  # the first round's (none if an earlier test already kept them)
    relaxed.clear()
    assert tp_type(torch.zeros(4, 4).index_add_(0, idx, x.i.detach())) is R
    assert not relaxed


# ---------------------------------------------------------------------------
# semantics: simulated ranks against one device, forward and gradient


@pytest.fixture
def tp2():
    return fake_mesh((N,), ("tp",))


def _run(op, mesh, t, make_buffer, seed: int = 0):
    """Run ``op(make_buffer(), values typed t)`` on N simulated ranks and on one device; compare both ways."""
    back = backward_type(t)
    with LocalTensorMode(N), spmd.set_current_mesh(mesh), spmd.typecheck():
        leaf = random_value(mesh, {"tp": t}, (4, 4), seed).double().requires_grad_()
        out = op(make_buffer(), spmd.assert_type(leaf, {"tp": t}))
        got_type = spmd.get_type(out)["tp"]
        cot = random_value(mesh, {"tp": back}, (4, 4), seed + 1).double()
        torch.autograd.backward([out], [cot])
    x0 = denote(leaf.detach(), mesh, {"tp": t}).requires_grad_()
    g0 = denote(cot, mesh, {"tp": back})
    zeros = torch.zeros(4, 4, dtype=torch.float64)
    ref = torch.stack([op(zeros.clone(), x0[r]) for r in range(N)]) if t is V else op(zeros.clone(), x0)
    ref.backward(g0)
    torch.testing.assert_close(denote(out, mesh, {"tp": got_type}), ref.detach())
    torch.testing.assert_close(denote(leaf.grad, mesh, {"tp": back}), x0.grad)
    return got_type


@pytest.mark.parametrize("t", [P, V, R, I], ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_into_plain_zeros_on_ranks_equals_one_device(tp2, op, t):
    assert _run(OPS[op], tp2, t, lambda: torch.zeros(4, 4, dtype=torch.float64)) is t


@pytest.mark.parametrize(("buffer", "values"), [(V, P), (R, P), (P, V), (P, R), (V, I), (I, P)], ids=str)
@pytest.mark.parametrize("op", OUT_OF_PLACE_OPS)
def test_into_typed_zeros_on_ranks_equals_one_device(tp2, op, buffer, values):
    def make_buffer():
        return spmd.assert_type(torch.zeros(4, 4, dtype=torch.float64), {"tp": buffer})

    assert _run(OPS[op], tp2, values, make_buffer) is values


def test_a_buffer_zero_on_some_ranks_only_is_not_zeros(tp2):
    with LocalTensorMode(N), spmd.set_current_mesh(tp2), spmd.typecheck():
        p = spmd.assert_type(random_value(tp2, {"tp": P}, (4, 4)), {"tp": P})
        buf = per_rank(lambda r: torch.zeros(4, 4) if r == 0 else torch.eye(4))
        with rejects(P_PLUS):
            buf.index_add_(0, _rows(p), p)
        assert spmd.get_type(buf) is None


# ---------------------------------------------------------------------------
# Megatron-core 0.16.1's MoE permute / unpermute, unmodified, on typed inputs


def _megatron_round_trip(moe_utils, tokens, routing_map, probs):
    permuted, _, sorted_indices = moe_utils.permute(tokens, routing_map)
    expert_out = permuted * 3.0  # a linear expert keeps the pending sum
    return moe_utils.unpermute(expert_out, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map)


@pytest.mark.parametrize("deterministic", [False, True], ids=["scatter_add_", "index_add_"])
@pytest.mark.parametrize("t", [P, V], ids=str)
def test_megatron_unpermute_of_typed_tokens(tp2, t, deterministic):
    """P tokens (before tensor parallelism's reduce) and V tokens (each rank its own) come back P and V."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    tokens_n, experts = 6, 3
    routing0 = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0], [0, 0, 1], [0, 1, 0]], dtype=torch.bool)
    probs0 = torch.rand(tokens_n, experts, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with LocalTensorMode(N), spmd.set_current_mesh(tp2), spmd.typecheck():
            leaf = random_value(tp2, {"tp": t}, (tokens_n, 4), seed=5).double().requires_grad_()
            probs_leaf = per_rank(lambda r: probs0.clone()).requires_grad_()
            routing = spmd.assert_type(per_rank(lambda r: routing0.clone()), {"tp": R})
            out = _megatron_round_trip(moe_utils, spmd.assert_type(leaf, {"tp": t}), routing,
                                       spmd.assert_type(probs_leaf, {"tp": R}))
            assert spmd.get_type(out) == {"tp": t}
            cot = random_value(tp2, {"tp": backward_type(t)}, (tokens_n, 4), seed=6).double()
            torch.autograd.backward([out], [cot])
        x0 = denote(leaf.detach(), tp2, {"tp": t}).requires_grad_()
        p0 = probs0.clone().requires_grad_()
        rows = [x0[r] for r in range(N)] if t is V else [x0]
        ref = torch.stack([_megatron_round_trip(moe_utils, x, routing0, p0) for x in rows])
        ref = ref if t is V else ref[0]
        ref.backward(denote(cot, tp2, {"tp": backward_type(t)}))
    finally:
        torch.use_deterministic_algorithms(was)
    torch.testing.assert_close(denote(out, tp2, {"tp": t}), ref.detach())
    torch.testing.assert_close(denote(leaf.grad, tp2, {"tp": backward_type(t)}), x0.grad)
    # the router's probabilities are R: their gradient is P (a list of per-rank gradients for V tokens, summed)
    torch.testing.assert_close(denote(probs_leaf.grad, tp2, {"tp": P}), p0.grad)

