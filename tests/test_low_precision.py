"""Low-precision communication on simulated ranks: ``op_dtype``, ``out_dtype``, ``backward_options``.

The meaning (meta-pytorch spmd-types 0.2.3's, which torchtitan calls): the input
is cast to ``op_dtype``, the op communicates and sums in ``op_dtype``, the
result is cast to ``out_dtype``; ``backward_options`` are the options of the
call the backward runs (the op's dual in seed 003's table), whose result comes
back in the input's dtype.

The data make every rounding visible and every sum exact: each fp32 value is
``k/8 + m * 2**-17`` (1 <= |k| <= 16, 1 <= |m| <= 7, the same sign), which bf16 and fp16 round to
``k/8`` exactly, and every sum of such values (up to 4 ranks) is exact in
bf16, fp16 and fp32. So results are compared with ``torch.equal`` against the
single-device meaning computed in the reduced precision, and a cast in the
wrong place (after the reduction instead of before, a backward summed in the
forward's dtype) changes the numbers. A dispatch mode records the dtype each
collective actually ran in.

For every row of the forward/backward table, each layout and each legal
combination of options: forward denotation, output dtype, the dtypes the
collectives ran in, the adjoint identity of the backward on the rounded
gradient, the gradient's dtype, and the communication counts (unchanged).
"""

from __future__ import annotations

import pytest
import torch
from _low_precision_gloo import CommDtypes
from conftest import fake_mesh
from test_collectives import CASES, EXPECTED_COMMS, _all_to_all_spec, _types
from torch.distributed._local_tensor import LocalTensorMode, maybe_disable_local_tensor_mode

import spmd_types as spmd
from spmd_types._core.types import base_type
from spmd_types._local.transitions import ROUTE, TRANSITIONS, find
from spmd_types.testing import CommCounter, denote, pair, per_rank, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
AR, AG, RS, A2A = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
N = 4  # simulated ranks


# ---------------------------------------------------------------------------
# data, and the dtypes each collective ran in


def grid_value(types_on_axis, shape: tuple[int, ...], seed: int, fine: bool = True, n: int = N) -> torch.Tensor:
    """Per-rank values ``k/8 (+ m * 2**-17)``; the same on every rank for R and I."""
    by_rank = {}
    with maybe_disable_local_tensor_mode():
        for r in range(n):
            g = torch.Generator().manual_seed(seed * 101 + (0 if types_on_axis in (R, I) else r))
            sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
            v = sign * torch.randint(1, 17, shape, generator=g) / 8
            if fine:  # away from zero, so the value stays in k/8's binade and rounds back to k/8
                v = v + sign * torch.randint(1, 8, shape, generator=g) * 2.0**-17
            by_rank[r] = v.float()
    return per_rank(lambda r: by_rank[r].clone())


@pytest.fixture(scope="module")
def mesh():
    return fake_mesh((N,), ("tp",))


# ---------------------------------------------------------------------------
# the rule, restated from the spec (not read from spmd_types/_comm/dtypes.py)


def _keeps_input(op: str, dst) -> bool:
    """With only out_dtype given, a reduction (and a slice) runs at the input's precision; a move at the narrower."""
    return op in (AR, RS) or (op == "convert" and base_type(dst) is V)


def expected_dtypes(op: str, dst, in_dtype: torch.dtype, opts: dict) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype the op runs in, the result's dtype)."""
    op_d, out_d = opts.get("op_dtype"), opts.get("out_dtype")
    if op_d is not None:
        return op_d, out_d or op_d
    if out_d is None:
        return in_dtype, in_dtype
    if _keeps_input(op, dst) or out_d.itemsize >= in_dtype.itemsize:
        return in_dtype, out_d
    return out_d, out_d


def backward_reduces(row) -> bool:
    return row.backward[0] in (AR, RS)


# Each combination: (input dtype, forward options, backward_options or None).
COMBOS = {
    "op-bf16/bw-f32": (F32, {"op_dtype": BF16}, {"op_dtype": F32}),  # FSDP: gather bf16, reduce fp32
    "op-bf16-out-f32/bw-bf16": (F32, {"op_dtype": BF16, "out_dtype": F32}, {"op_dtype": BF16}),
    "out-bf16/bw-f32": (F32, {"out_dtype": BF16}, {"op_dtype": F32}),
    "op-f16-out-bf16/bw-f32": (F32, {"op_dtype": F16, "out_dtype": BF16}, {"op_dtype": F32}),
    "in-bf16/bw-f32": (BF16, {}, {"op_dtype": F32}),
    "op-f64-out-f32": (F32, {"op_dtype": F64, "out_dtype": F32}, None),  # not reduced precision: no bw needed
    "op-bf16/no-bw": (F32, {"op_dtype": BF16}, None),  # legal only where the backward does not reduce
}


def _sweep() -> list:
    out = []
    for case in CASES:
        row = case.values[0]
        for name, (_, _, bw) in COMBOS.items():
            if bw is None and name == "op-bf16/no-bw" and backward_reduces(row):
                continue  # an error: test_missing_backward_op_dtype_every_row
            out.append(pytest.param(*case.values, name, id=f"{case.id}-{name}"))
    return out


def _apply(row, layout: str, x: torch.Tensor, axis, **opts) -> torch.Tensor:
    src, dst = _types(row, layout)
    fn = getattr(spmd, row.op)
    if row.op == "all_to_all" and layout == "stack":
        return fn(x, axis, src=V, dst=V, split_dim=0, concat_dim=1, **opts)  # the published meaning: unbind 0, stack on 1
    return fn(x, axis, src=src, dst=dst, **opts)


def _options(opts: dict, bw: dict | None) -> dict:
    return {**opts, **({} if bw is None else {"backward_options": bw})}


def _backward_dtypes(row, g_dtype: torch.dtype, x_dtype: torch.dtype, bw: dict | None):
    """(the dtype the backward's op runs in, the gradient's dtype): its options, out_dtype defaulting to x's."""
    bop, _, bdst = row.backward
    bw = bw or {}
    return expected_dtypes(bop, bdst, g_dtype, {"op_dtype": bw.get("op_dtype"), "out_dtype": bw.get("out_dtype", x_dtype)})


# ---------------------------------------------------------------------------
# every row x layout x option combination


@pytest.mark.parametrize("row,layout,combo", _sweep())
def test_row_in_low_precision(mesh, row, layout, combo):
    """Forward meaning in op_dtype then out_dtype; backward adjoint on the rounded gradient; dtypes; comm counts."""
    in_dtype, opts, bw = COMBOS[combo]
    src, dst = _types(row, layout)
    op_d, out_d = expected_dtypes(row.op, dst, in_dtype, opts)
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(src, (N, 2 * N), seed=3).to(in_dtype).requires_grad_()
        with CommCounter() as fwd_comms, CommDtypes() as fwd_dtypes:
            y = _apply(row, layout, x, "tp", **_options(opts, bw))
        assert y.dtype == out_d
        assert fwd_dtypes.dtypes <= {op_d}, f"the forward communicated in {fwd_dtypes.seen}, not {op_d}"
        _check_forward(mesh, row, layout, x.detach().to(op_d), y.detach(), src, dst, op_d, out_d)

        g = grid_value(spmd.backward_type(dst), tuple(y.shape), seed=4).to(y.dtype)
        with CommCounter() as bwd_comms, CommDtypes() as bwd_dtypes:
            (gx,) = torch.autograd.grad(y, x, g)
        b_op, b_out = _backward_dtypes(row, y.dtype, in_dtype, bw)
        assert b_out == in_dtype and gx.dtype == in_dtype
        assert bwd_dtypes.dtypes <= {b_op}, f"the backward communicated in {bwd_dtypes.seen}, not {b_op}"
        assert (fwd_comms.counts, bwd_comms.counts) == EXPECTED_COMMS[(row.op, row.src, row.dst)]
        # <A x_op, round(g)> = <x_op, A^T round(g)>: exact, since every sum here is exact. A is the op with no
        # options (tests/test_collectives.py checks it), run on the input already in op_dtype.
        a_x_op = _apply(row, layout, x.detach().to(op_d), "tp")
        lhs = pair(a_x_op, g.to(b_op), mesh, {"tp": dst})
        rhs = pair(x.detach().to(op_d), gx, mesh, {"tp": src})
        assert torch.equal(lhs, rhs), (lhs, rhs)


def _check_forward(mesh, row, layout, x_op, y, src, dst, op_d, out_d) -> None:
    if row.op == "reinterpret":  # same local data, cast
        for r, v in rank_values(y).items():
            assert torch.equal(v, rank_values(x_op)[r].to(out_d))
        return
    want = denote(x_op.double(), mesh, {"tp": src})  # a P input's meaning: the exact sum of its rounded parts
    if row.op == "all_to_all" and layout == "stack":
        want = _all_to_all_spec(want, split_dim=0, concat_dim=1)
    want = want.to(op_d).to(out_d)  # the op's result is in op_dtype, then cast to out_dtype
    got = denote(y.double(), mesh, {"tp": dst})
    assert torch.equal(got, want.double())


def test_the_sweep_covers_every_row():
    covered = {(c.values[0].op, c.values[0].src, c.values[0].dst) for c in _sweep()}
    assert covered == {(t.op, t.src, t.dst) for t in TRANSITIONS}


# ---------------------------------------------------------------------------
# where the rounding happens, shown on one reduction


def test_all_reduce_sums_in_op_dtype_then_casts(mesh):
    """op_dtype=bf16, out_dtype=fp32: each part rounds to bf16 before the sum; the sum is exact; then fp32."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(P, (8,), seed=5)
        y = spmd.all_reduce(x, "tp", src=P, dst=I, op_dtype=BF16, out_dtype=F32)
        in_fp32 = spmd.all_reduce(x, "tp", src=P, dst=I)
        low = denote(x.to(BF16).double(), mesh, {"tp": P})
        full = denote(x.double(), mesh, {"tp": P})
        assert y.dtype == F32
        assert torch.equal(denote(y, mesh, {"tp": I}).double(), low)
        assert torch.equal(denote(in_fp32, mesh, {"tp": I}).double(), full)
        assert not torch.equal(low, full)  # the data make the two differ everywhere
        assert bool((low != full).all())


def test_backward_op_dtype_rounds_the_gradient_before_the_reduce_scatter(mesh):
    """all_gather(op_dtype=bf16) backward: fp32 reduce-scatter of the bf16 gradient, or bf16 when asked."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(S(0), (2, 3), seed=6).requires_grad_()
        g = grid_value(P, (2 * N, 3), seed=7)  # fp32, finer than bf16
        y = spmd.all_gather(x, "tp", src=S(0), dst=R, op_dtype=BF16, out_dtype=F32,
                            backward_options={"op_dtype": F32})
        (g32,) = torch.autograd.grad(y, x, g)
        y = spmd.all_gather(x, "tp", src=S(0), dst=R, op_dtype=BF16, out_dtype=F32,
                            backward_options={"op_dtype": BF16})
        with CommDtypes() as seen:
            (g16,) = torch.autograd.grad(y, x, g)
        assert seen.seen == [("reduce_scatter_tensor", BF16)]
        exact = denote(g.double(), mesh, {"tp": P})  # the gradient's meaning: the sum over ranks
        rounded = denote(g.to(BF16).double(), mesh, {"tp": P})
        assert torch.equal(denote(g32.double(), mesh, {"tp": S(0)}), exact)
        assert torch.equal(denote(g16.double(), mesh, {"tp": S(0)}), rounded.to(BF16).double())
        assert g32.dtype == g16.dtype == F32


def test_backward_out_dtype_rounds_the_gradient_autograd_hands_back_in_x_dtype(mesh):
    """backward_options out_dtype: the backward's result is cast to it; autograd then gives x its own dtype."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(P, (4,), seed=8).requires_grad_()
        g = grid_value(V, (), seed=9)  # one fp32 value per rank, with bits below bf16's
        y = spmd.reduce_scatter(x, "tp", src=P, dst=V, backward_options={"out_dtype": BF16})
        (gx,) = torch.autograd.grad(y, x, g)
        want = denote(g.double(), mesh, {"tp": V})  # all_gather(V, R): every rank gets the stack
        assert gx.dtype == F32
        assert torch.equal(denote(gx.double(), mesh, {"tp": R}), want.to(BF16).double())
        assert not torch.equal(want.to(BF16).double(), want)


# ---------------------------------------------------------------------------
# out_dtype alone: which dtype the collective runs in


@pytest.mark.parametrize("op,src,dst,kwargs,in_dtype,out_dtype,runs_in", [
    (AR, P, R, {}, F32, BF16, F32),  # a reduction sums at the input's precision, then rounds once
    (RS, P, S(0), {}, F32, BF16, F32),
    (AG, S(0), I, {}, F32, BF16, BF16),  # a move runs in the narrower dtype: less traffic, the same numbers
    (AG, S(0), I, {}, BF16, F32, BF16),  # upcast after the gather
    (A2A, S(0), S(1), {}, F32, F16, F16),
    (AR, P, I, {"op_dtype": F64}, F32, F32, F64),  # op_dtype wider than the input: sums in fp64
])
def test_out_dtype_alone_picks_the_op_dtype(mesh, op, src, dst, kwargs, in_dtype, out_dtype, runs_in):
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(src, (N, N), seed=10).to(in_dtype)
        with CommDtypes() as seen:
            y = getattr(spmd, op)(x, "tp", src=src, dst=dst, out_dtype=out_dtype, **kwargs)
        assert seen.dtypes == {runs_in} and y.dtype == out_dtype


# ---------------------------------------------------------------------------
# the other forms: src=V shorthand, op="avg", max/min, uneven sizes, redistribute, typed, double backward


def test_src_v_shorthand_and_avg(mesh):
    """all_reduce(src=V, op="avg", op_dtype=bf16): the reinterpret half casts nothing; the average is in bf16."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(V, (6,), seed=11).requires_grad_()
        with CommCounter() as comms, CommDtypes() as seen:
            y = spmd.all_reduce(x, "tp", src=V, dst=R, op="avg", op_dtype=BF16, backward_options={"op_dtype": F32})
            (gx,) = torch.autograd.grad(y, x, grid_value(P, (6,), seed=12))
        assert comms.counts == {AR: 2} and seen.dtypes == {BF16, F32}
        assert [d for _, d in seen.seen] == [BF16, F32]
        want = denote(x.detach().to(BF16).double(), mesh, {"tp": P}) / N
        assert torch.equal(denote(y.double(), mesh, {"tp": R}), want)
        assert y.dtype == BF16 and gx.dtype == F32


def test_uneven_all_gather_in_bf16(mesh):
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        sizes = [1, 3, 2, 2]
        full = grid_value(R, (8, 2), seed=13)
        x = spmd.convert(full, "tp", src=R, dst=S(0), sizes=sizes).detach().requires_grad_()
        with CommDtypes() as seen:
            y = spmd.all_gather(x, "tp", src=S(0), dst=I, sizes=sizes, op_dtype=BF16)
        assert seen.dtypes == {BF16} and y.dtype == BF16
        assert torch.equal(denote(y, mesh, {"tp": I}), rank_values(full)[0].to(BF16))
        (gx,) = torch.autograd.grad(y, x, y.detach())
        assert gx.dtype == F32


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dst", [R, I])
def test_all_reduce_max_min_in_low_precision(mesh, op, dst):
    """The extreme in op_dtype (ties as bf16 sees them), the gradient summed in the backward's op_dtype."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(V, (16,), seed=14).requires_grad_()
        with CommDtypes() as seen:
            y = spmd.all_reduce(x, "tp", src=V, dst=dst, op=op, op_dtype=BF16, out_dtype=F32,
                                backward_options={"op_dtype": F32})
        assert seen.dtypes == {BF16} and y.dtype == F32
        stacked = denote(x.detach().to(BF16), mesh, {"tp": V})
        extreme = stacked.amax(0) if op == "max" else stacked.amin(0)
        assert torch.equal(denote(y, mesh, {"tp": I}), extreme.float())
        g = grid_value(spmd.backward_type(dst), (16,), seed=15)
        with CommDtypes() as seen:
            (gx,) = torch.autograd.grad(y, x, g)
        assert seen.dtypes == {F32} and gx.dtype == F32
        # The one-device meaning: amax/amin's gradient of the stacked bf16 values, ties split evenly.
        leaf = stacked.double().requires_grad_()
        ref = leaf.amax(0) if op == "max" else leaf.amin(0)
        g_meaning = denote(g.double(), mesh, {"tp": spmd.backward_type(dst)})
        (want,) = torch.autograd.grad(ref, leaf, g_meaning)
        assert torch.equal(denote(gx.double(), mesh, {"tp": V}), want)


@pytest.mark.parametrize("src,dst", list(ROUTE))
def test_redistribute_takes_torchtitans_call_shape(mesh, src, dst):
    """``redistribute(x, pg, src=, dst=, backward_options={"op_dtype": x.dtype})`` on a bf16 value, every route."""
    if (src, dst) == (V, V):
        src, dst = S(0), S(1)
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        shape = (N, 2 * N) if dst is V else (2 * N, 2 * N)
        x = grid_value(src, shape, seed=16, fine=False).to(BF16).requires_grad_()
        with CommCounter() as comms:
            y = spmd.redistribute(x, mesh.get_group("tp"), src=src, dst=dst, backward_options={"op_dtype": x.dtype})
            (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert y.dtype == gx.dtype == BF16
        routed = find(ROUTE[(base_type(src), base_type(dst))], base_type(src), base_type(dst))
        fwd, bwd = EXPECTED_COMMS[(routed.op, routed.src, routed.dst)]
        want = dict(fwd)
        for k, v in bwd.items():
            want[k] = want.get(k, 0) + v
        assert comms.counts == want


def test_typed_and_erased_give_the_same_numbers_and_types(mesh):
    """Under typecheck() the same call gives the same values, dtype and gradient, and the dst type."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(S(0), (2, 3), seed=17)
        opts = {"op_dtype": BF16, "backward_options": {"op_dtype": F32}}
        xe = x.clone().requires_grad_()
        ye = spmd.all_gather(xe, "tp", src=S(0), dst=R, **opts)
        spmd.convert(ye.sum(), "tp", src=R, dst=I).backward()
        with spmd.typecheck():
            xt = spmd.assert_type(x.clone().requires_grad_(), {"tp": S(0)})
            yt = spmd.all_gather(xt, "tp", src=S(0), dst=R, **opts)
            assert spmd.get_type(yt) == {"tp": R} and yt.dtype == BF16
            spmd.convert(yt.sum(), "tp", src=R, dst=I).backward()
        assert spmd.get_type(xt.grad) == {"tp": S(0)} and xt.grad.dtype == F32
        for r, v in rank_values(ye).items():
            assert torch.equal(rank_values(yt)[r], v)
            assert torch.equal(rank_values(xt.grad)[r], rank_values(xe.grad)[r])


def test_double_backward_runs_with_the_nested_options(mesh):
    """backward_options={'backward_options': ...} are the options of the backward's backward (the forward op)."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(S(0), (2, 3), seed=18).requires_grad_()
        y = spmd.all_gather(x, "tp", src=S(0), dst=R, op_dtype=BF16,
                            backward_options={"op_dtype": F32, "backward_options": {"op_dtype": F16}})
        g = grid_value(P, tuple(y.shape), seed=19).to(BF16).requires_grad_()
        (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
        h = grid_value(S(0), (2, 3), seed=20)
        with CommDtypes() as seen:
            (gg,) = torch.autograd.grad(gx, g, h)
        assert seen.seen == [("all_gather_into_tensor", F16)] and gg.dtype == BF16
        direct = spmd.all_gather(h.to(F16), "tp", src=S(0), dst=R)
        assert torch.equal(denote(gg.double(), mesh, {"tp": R}), denote(direct.double(), mesh, {"tp": R}))


def test_integer_data_may_travel_in_a_narrower_integer_dtype(mesh):
    """Token counts: no gradient, so an integer op_dtype is fine."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        counts = per_rank(lambda r: torch.arange(N, dtype=torch.int64) + 10 * r)
        with CommDtypes() as seen:
            out = spmd.all_to_all(counts, "tp", src=V, dst=V, split_dim=0, concat_dim=0, op_dtype=torch.int32,
                                  out_dtype=torch.int64)
        assert seen.dtypes == {torch.int32} and out.dtype == torch.int64
        assert rank_values(out)[1].tolist() == [1, 11, 21, 31]


def test_dtensor_fsdp_gather_in_bf16_reduce_scatter_in_fp32():
    """A DTensor input takes the options too: Shard(0) -> Reduced() in bf16, the gradient reduce-scattered in fp32."""
    mesh = fake_mesh((N,), ("dp",))
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        local = grid_value(S(0), (2, 3), seed=25)
        w = spmd.to_dtensor(local, mesh, [spmd.type_to_placement(S(0))]).detach().requires_grad_()
        with CommDtypes() as seen:
            full = spmd.all_gather(w, "dp", src=S(0), dst=R, op_dtype=BF16, backward_options={"op_dtype": F32})
            assert full.dtype == BF16 and repr(full.placements) == "(Reduced(),)"
            g = grid_value(P, (2 * N, 3), seed=26).to(BF16)
            full.backward(spmd.to_dtensor(g, mesh, [spmd.type_to_placement(P)]))
        assert seen.seen == [("all_gather_into_tensor", BF16), ("reduce_scatter_tensor", F32)]
        assert w.grad.dtype == F32
        plain = local.clone().requires_grad_()
        (want,) = torch.autograd.grad(
            spmd.all_gather(plain, "dp", src=S(0), dst=R, op_dtype=BF16, backward_options={"op_dtype": F32}), plain, g)
        for r, v in rank_values(want).items():
            assert torch.equal(rank_values(w.grad._local_tensor)[r], v)
