"""torchtitan's upgrade to the newer published API, as call shapes of our own, checked on simulated ranks.

torchtitan's upgrade (its PR #4265, "upgrade spmd_types to 0.2.5") rewrites its models onto the newer calls:
autograd Functions typed by ``spmd_typecheck`` hooks with no decorator (the stamping shape with
``assert_type`` / ``assert_local_type_like`` on the inputs and the result, and ``spmd.rules.einsum(...,
out=result)``), whole types ``spmd.SpmdType(local_type, partition_spec)``, ``spmd.types.partition_spec_get_shard``
and ``spmd.reinterpret_mesh(x, target, inplace=True)``. The model below is written the same way (our own code):
a tensor-parallel MLP (column-parallel and row-parallel Functions with hand-written backwards and raw
collectives), an identity Function that injects an auxiliary loss, and a loss Function typed by an einsum rule.
Its loss and gradients on dp x tp simulated ranks equal one device's; checking off gives the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import spmd_types as spmd
from spmd_types.testing import per_rank, rank_values, simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
PS = spmd.PartitionSpec
H, F, T = 4, 6, 8  # hidden, ffn (tp-sharded), tokens (dp-sharded)


class ColumnParallel(torch.autograd.Function):
    """``x @ w.T`` with ``w`` sharded on its output features: the result is sharded on its last dim."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return x @ weight.t()

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_x = g @ weight
        dist.all_reduce(grad_x, group=ctx.group)  # each rank held a piece of the sum over the sharded features
        return grad_x, g.flatten(0, -2).t() @ x.flatten(0, -2), None

    @staticmethod
    def spmd_typecheck(result, *, x, weight, group):
        spmd.assert_type(weight, {group: spmd.S(0)})
        spmd.assert_type(x, {group: spmd.R})
        shard = spmd.types.partition_spec_get_shard(spmd.get_partition_spec(weight), group)  # S(0): out features
        spmd.assert_type_like(result, x, {group: spmd.S(result.dim() - 1 - shard.dim)})  # x's layout, tp on the last


class RowParallel(torch.autograd.Function):
    """``x @ w.T`` over sharded input features, summed over the group; its backward sends the gradient back as it
    is, which is right only for an I result (the gradient of I is I; that of R would be a pending sum)."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        y = x @ weight.t()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return g @ weight, g.flatten(0, -2).t() @ x.flatten(0, -2), None

    @staticmethod
    def spmd_typecheck(*, x, weight, group):
        y = spmd.rules.einsum("...k,nk->...n", x, weight)
        return spmd.rules.all_reduce(y, group, src=spmd.P, dst=spmd.I)


class InjectAuxLoss(torch.autograd.Function):
    """Identity forward; backward hands the auxiliary loss a gradient of one (its type declared by the hook)."""

    @staticmethod
    def forward(ctx, carrier, aux_loss):
        ctx.save_for_backward(aux_loss)
        return carrier

    @staticmethod
    def spmd_typecheck(result, *, carrier, aux_loss):
        spmd.rules.ignore(aux_loss)
        spmd.assert_type(result, spmd.get_local_type(carrier), partition_spec=spmd.get_partition_spec(carrier))

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class SquaredError(torch.autograd.Function):
    """``sum((y - target)^2)`` over the local tokens, typed by an einsum rule with ``out=``."""

    @staticmethod
    def forward(ctx, y, target):
        ctx.save_for_backward(y, target)
        return ((y - target) ** 2).sum()

    @staticmethod
    def backward(ctx, g):
        y, target = ctx.saved_tensors
        return 2 * (y - target) * g, None

    @staticmethod
    def spmd_typecheck(result, *, y, target):
        spmd.rules.einsum("tn,tn->", y, target, out=result)


def _step(x, w1, w2, target, dp, tp, checking):
    h = ColumnParallel.apply(x, w1, tp).relu()
    y = RowParallel.apply(h, w2, tp)
    aux = torch.zeros(())  # a step's auxiliary loss (a constant here: its injected gradient reaches no parameter)
    if checking:
        spmd.assert_type(aux, {dp: R, tp: I})
    y = InjectAuxLoss.apply(y, aux)
    loss = SquaredError.apply(y, target)  # {dp: P (a sum over the dp-sharded tokens), tp: I}
    return spmd.all_reduce(loss, dp, src=P, dst=I)


def _globals(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g), torch.randn(F, H, generator=g), torch.randn(H, F, generator=g),
            torch.randn(T, H, generator=g))


def _reference():
    x, w1, w2, target = _globals()
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    loss = (((x @ w1.t()).relu() @ w2.t() - target) ** 2).sum()
    loss.backward()
    return loss.detach(), w1.grad, w2.grad


def _run(checking: bool):
    x, w1, w2, target = _globals()
    with simulate((2, 2), ("dp", "tp"), ranks="local", device="cpu") as mesh:
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        coord = {int(mesh.mesh[i, j]): (i, j) for i in range(2) for j in range(2)}
        xs = per_rank(lambda r: x.chunk(2, 0)[coord[r][0]].clone())
        ts = per_rank(lambda r: target.chunk(2, 0)[coord[r][0]].clone())
        w1s = per_rank(lambda r: w1.chunk(2, 0)[coord[r][1]].clone()).requires_grad_(True)
        w2s = per_rank(lambda r: w2.chunk(2, 1)[coord[r][1]].clone()).requires_grad_(True)
        with spmd.typecheck(local=False) if checking else _nothing():
            spmd.assert_type(xs, spmd.SpmdType({tp: R}, PS(dp, None)))  # a whole type: the batch on dp
            spmd.assert_type(ts, spmd.SpmdType({tp: I}, PS(dp, None)))
            spmd.assert_type(w1s, spmd.SpmdType({dp: R}, PS(tp, None)))
            spmd.assert_type(w2s, {dp: R, tp: S(1)})
            loss = _step(xs, w1s, w2s, ts, dp, tp, checking)
            types = spmd.get_type(loss) if checking else None
            loss.backward()
        by = {coord[r]: v for r, v in rank_values(w1s.grad).items()}, {coord[r]: v for r, v in rank_values(w2s.grad).items()}
        # each dp rank holds its tokens' share of a weight's gradient (P on dp, pending DDP/FSDP's sum)
        g1 = torch.cat([by[0][0, j] + by[0][1, j] for j in (0, 1)], 0)
        g2 = torch.cat([by[1][0, j] + by[1][1, j] for j in (0, 1)], 1)
        return rank_values(loss)[0], g1, g2, types


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_the_upgraded_model_matches_one_device_and_checking_off():
    loss, g1, g2 = _reference()
    checked_loss, c1, c2, types = _run(checking=True)
    assert types == {"dp": I, "tp": I}
    torch.testing.assert_close((checked_loss, c1, c2), (loss, g1, g2))
    erased_loss, e1, e2, _ = _run(checking=False)
    torch.testing.assert_close((erased_loss, e1, e2), (checked_loss, c1, c2))


def test_reinterpret_mesh_in_place_between_presentations():
    with simulate((2, 2), ("dp", "tp")) as dense, spmd.typecheck():
        flat = spmd.MeshAxis.of(4, 1)
        tokens = spmd.assert_type(torch.randn(8), {"dp": V, "tp": V})
        with spmd.set_current_mesh({"dp_tp": flat}):
            same = spmd.reinterpret_mesh(tokens, spmd.current_mesh(), inplace=True)
            assert same is tokens and spmd.get_local_type(tokens) == {flat: V}
        assert spmd.get_type(tokens) == {"dp_tp": V} and dense is not None


def test_a_process_groups_registered_name_is_an_axis():
    """torchtitan's hooks key a type by ``group_name`` (the name the group is registered under)."""
    with simulate((2, 2), ("dp", "tp")) as mesh, spmd.typecheck():
        name = mesh.get_group("tp").group_name
        x = spmd.assert_type(torch.randn(4, 2), {name: S(0), "dp": R})
        assert spmd.get_type(x) == {"dp": R, "tp": S(0)}
        assert spmd.normalize_axis(name) == spmd.normalize_axis("tp")
