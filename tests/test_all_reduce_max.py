"""``spmd.all_reduce(x, axis, op="max"|"min")``: V (or S(d)) in, R or I out, on simulated ranks.

Forward: the denotation is ``torch.amax`` / ``torch.amin`` of the per-rank
values stacked on dim 0. Backward: max is not linear, so instead of the
adjoint identity the gradient is compared with torch's own gradient of
``amax`` / ``amin`` on one device (the gradient goes to the ranks holding the
extreme, split evenly among ties). Communication: one all-reduce forward,
one backward (R: the pending gradient and the tie count together; I: the tie
count only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types._comm.collectives import EXTREME_ROWS
from spmd_types.testing import CommCounter, denote, per_rank, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
AR = "all_reduce"
ONE_DEVICE = {"max": torch.amax, "min": torch.amin}

MESHES = {
    "world4": ((4,), ("tp",), "tp"),
    "2x2-tp": ((2, 2), ("dp", "tp"), "tp"),
    "2x2-dp": ((2, 2), ("dp", "tp"), "dp"),
}


@pytest.fixture(params=list(MESHES), scope="module")
def world(request):
    shape, names, axis = MESHES[request.param]
    return fake_mesh(shape, names), axis


def _full(mesh, axis, t) -> dict:
    return {a: (t if a == axis else V) for a in mesh.mesh_dim_names}


def _one_device(x_den: torch.Tensor, op: str, stacked_dim: int) -> torch.Tensor:
    return ONE_DEVICE[op](x_den, dim=stacked_dim)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dst", [R, I], ids=["R", "I"])
def test_forward_backward_and_counts(world, op, dst):
    mesh, axis = world
    with LocalTensorMode(mesh.size()), spmd.set_current_mesh(mesh):
        x = random_value(mesh, _full(mesh, axis, V), (3, 4), seed=7)
        x.requires_grad_()
        with CommCounter() as comms:
            y = spmd.all_reduce(x, axis, src=V, dst=dst, op=op)
        assert comms.counts == {AR: 1}
        # The other axis (if any) is V and stacked outside: the axis's stack is dim 1 then.
        x_den = denote(x, mesh, _full(mesh, axis, V), first=axis)
        stacked = x_den.dim() - 3
        want = _one_device(x_den, op, stacked)
        torch.testing.assert_close(denote(y, mesh, _full(mesh, axis, dst), first=axis), want)
        g = random_value(mesh, _full(mesh, axis, spmd.backward_type(dst)), (3, 4), seed=8)
        with CommCounter() as comms:
            (gx,) = torch.autograd.grad(y, x, g)
        assert comms.counts == {AR: 1}
        ref_x = x_den.clone().requires_grad_()
        g_den = denote(g, mesh, _full(mesh, axis, spmd.backward_type(dst)), first=axis)
        (ref_g,) = torch.autograd.grad(_one_device(ref_x, op, stacked), ref_x, g_den)
        torch.testing.assert_close(denote(gx, mesh, _full(mesh, axis, V), first=axis), ref_g)


@pytest.mark.parametrize("dst", [R, I], ids=["R", "I"])
def test_ties_split_the_gradient_as_amax_does(dst):
    mesh = fake_mesh((4,), ("tp",))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        # column 0: ranks 1 and 3 tie at the max; column 1: all four tie; column 2: rank 0 alone.
        x = per_rank(lambda r: torch.tensor([float(r % 2), 2.0, 5.0 - r]))
        x.requires_grad_()
        y = spmd.all_reduce(x, "tp", src=V, dst=dst, op="max")
        g = per_rank(lambda r: torch.tensor([1.0, 1.0, 1.0]) * (4 if dst is I else 1))
        (gx,) = torch.autograd.grad(y, x, g)
        got = {r: v.tolist() for r, v in rank_values(gx).items()}
    # dst=R: the pending gradient sums to 4; dst=I: it is 4 on every rank. Either way 4 is split among ties.
    assert got == {0: [0.0, 1.0, 4.0], 1: [2.0, 1.0, 0.0], 2: [0.0, 1.0, 0.0], 3: [2.0, 1.0, 0.0]}


def test_typed_result_and_shard_input(mesh_dp_tp):
    mesh = mesh_dp_tp
    with LocalTensorMode(8), spmd.set_current_mesh(mesh), spmd.typecheck():
        x = spmd.assert_type(random_value(mesh, {"dp": R, "tp": V}, (2, 8)), {"dp": R, "tp": S(1)})
        y = spmd.all_reduce(x, "tp", src=S(1), dst=R, op="max")
        z = spmd.all_reduce(x, "tp", dst=I, op="min")  # src defaults to V for max/min
        assert spmd.get_type(y) == {"dp": R, "tp": R}
        assert spmd.get_type(z) == {"dp": R, "tp": I}
        plain = spmd.all_reduce(x.detach(), "tp", src=V, dst=R, op="max")
    with LocalTensorMode(8):
        for r, v in rank_values(plain).items():
            assert torch.equal(rank_values(y)[r], v)


def test_flattened_axes_and_integers(mesh_dp_tp):
    mesh = mesh_dp_tp
    with LocalTensorMode(8), spmd.set_current_mesh(mesh):
        x = per_rank(lambda r: torch.tensor([r, -r], dtype=torch.int64))
        with CommCounter() as comms:
            y = spmd.all_reduce(x, ("dp", "tp"), src=V, dst=R, op="max")
        assert comms.counts == {AR: 1}
        assert [v.tolist() for v in rank_values(y).values()] == [[7, 0]] * 8


def test_erased_outside_typecheck_same_values():
    mesh = fake_mesh((4,), ("tp",))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        x = per_rank(lambda r: torch.tensor([float(r), -float(r)]))
        y = spmd.all_reduce(x, "tp", src=V, dst=R, op="min")
        assert spmd.get_type(y) is None
        assert all(v.tolist() == [0.0, -3.0] for v in rank_values(y).values())


def test_the_table_is_v_to_r_and_i():
    assert [(row.src, row.dst, row.backward_comm) for row in EXTREME_ROWS] == [(V, R, AR), (V, I, AR)]


# ---------------------------------------------------------------------------
# rejections: before any communication, with pinned messages


@pytest.fixture
def tp4():
    m = fake_mesh((4,), ("tp",))
    with spmd.set_current_mesh(m):
        yield m


def _raises(exc, fn, *args, **kwargs) -> BaseException:
    with CommCounter() as comms:
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
    assert comms.total == 0, "an error must come before any communication"
    return info.value


def test_rejects_a_pending_sum(tp4):
    err = _raises(spmd.SpmdTypeError, spmd.all_reduce, torch.ones(4), "tp", src=P, dst=R, op="max")
    assert err.rule == (
        "spmd.all_reduce(op='max') cannot take src=P: a pending sum's value is the sum over ranks, and the max of "
        "the summands is not a function of that sum."
    )
    assert err.seen == (("op", "spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R, op='max')"),
                        ("allowed", "V -> R, V -> I"))
    assert list(err.fixes) == ["spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R) to finish the sum first",
                               "type x V where it is made, if each rank's own value is meant"]


@pytest.mark.parametrize("src,dst", [(R, R), (I, I), (V, V), (V, P), (V, S(0))])
def test_rejects_other_pairs(tp4, src, dst):
    err = _raises(spmd.SpmdTypeError, spmd.all_reduce, torch.ones(4), "tp", src=src, dst=dst, op="min")
    assert err.rule == (
        f"spmd.all_reduce(op='min') cannot take src={src} to dst={dst}: it takes a V (or S(d)) value to R or I."
    )
    assert err.seen[1] == ("allowed", "V -> R, V -> I")


def test_rejects_a_typed_input_that_is_not_v(tp4):
    with spmd.typecheck():
        x = spmd.assert_type(torch.ones(4), {"tp": R})
        err = _raises(spmd.SpmdTypeError, spmd.all_reduce, x, "tp", src=V, dst=R, op="max")
    assert err.rule == "spmd.all_reduce's src= must be the input's type on the axis: src=V, but the tensor is R on axis 'tp'."


def test_bad_op_complex_and_non_tensor(tp4):
    err = _raises(ValueError, spmd.all_reduce, torch.ones(4), "tp", op="prod")
    assert str(err) == "spmd.all_reduce: op must be 'sum', 'avg', 'max' or 'min', got 'prod'"
    err = _raises(TypeError, spmd.all_reduce, torch.ones(4, dtype=torch.complex64), "tp", op="max")
    assert str(err) == "spmd.all_reduce: op='max' needs an ordered dtype, got torch.complex64"
    err = _raises(TypeError, spmd.all_reduce, [1.0], "tp", op="max")
    assert str(err) == "spmd.all_reduce takes a tensor, got list"
    err = _raises(TypeError, spmd.all_reduce, torch.ones(4), "tp", src="V", op="max")
    assert str(err) == (
        "spmd.all_reduce: src must be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or spmd.S(d)), got 'V' of type str"
    )
    err = _raises(ValueError, spmd.all_reduce, torch.ones(4), "pp", op="max")
    assert str(err) == "spmd.all_reduce: unknown mesh axis 'pp'; the current mesh has axes 'tp'"


def test_double_backward_is_a_clear_error():
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2), spmd.set_current_mesh(mesh):
        x = per_rank(lambda r: torch.tensor([float(r), 1.0 - r])).requires_grad_()
        y = spmd.all_reduce(x, "tp", src=V, dst=I, op="max")
        g = per_rank(lambda r: torch.ones(2)).requires_grad_()
        (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
        with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
            gx.sum().backward()


# ---------------------------------------------------------------------------
# two real gloo processes: max / min forward and backward, and axis_index, against one device


def _gloo_worker(rank: int, init_method: str, out_dir: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            index = spmd.axis_index("tp")
            x = torch.tensor([1.0, 5.0, 2.0]) if rank == 0 else torch.tensor([4.0, 2.0, 2.0])
            x.requires_grad_()
            y = spmd.all_reduce(spmd.assert_type(x, {"tp": V}), "tp", dst=I, op="max")
            z = spmd.all_reduce(spmd.assert_type(x.detach(), {"tp": V}), "tp", dst=R, op="min")
            y.backward(torch.tensor([1.0, 10.0, 100.0]))
            row = {"index": int(index), "index_type": str(spmd.get_type(index)), "y": y.tolist(),
                   "y_type": str(spmd.get_type(y)), "z": z.tolist(), "grad": x.grad.tolist()}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(row))
        dist.barrier()  # both ranks done before either tears gloo down (a lone teardown aborted under load)
    finally:
        dist.destroy_process_group()


def test_on_two_gloo_processes(tmp_path):
    import json

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    mp.start_processes(_gloo_worker, args=("file://" + str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # one device: amax of [[1, 5, 2], [4, 2, 2]] over dim 0, and its gradient for the cotangent [1, 10, 100]
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[0]["index_type"] == "{'tp': V}"
    assert rows[0]["y"] == rows[1]["y"] == [4.0, 5.0, 2.0] and rows[0]["y_type"] == "{'tp': I}"
    assert rows[0]["z"] == rows[1]["z"] == [1.0, 2.0, 2.0]
    assert [r["grad"] for r in rows] == [[0.0, 10.0, 50.0], [1.0, 0.0, 50.0]]


def test_global_spmd_takes_shards_and_refuses_v_before_communicating(tp4):
    with LocalTensorMode(4), spmd.typecheck(local=False):
        x = spmd.assert_type(per_rank(lambda r: torch.tensor([[float(r), -float(r)]])), {"tp": S(0)})
        with CommCounter() as comms:
            y = spmd.all_reduce(x, "tp", src=S(0), dst=R, op="max")
        assert comms.counts == {AR: 1}
        assert spmd.get_type(y) == {"tp": R} and spmd.get_partition_spec(y) == spmd.PartitionSpec(None, None)
        assert all(v.tolist() == [[3.0, 0.0]] for v in rank_values(y).values())
        err = _raises(spmd.SpmdTypeError, spmd.all_reduce, x, "tp", src=V, dst=R, op="max")
    assert err.rule == (
        "spmd.all_reduce(op='max') with src=V has no global meaning: say which dim with S(d), or run it in local "
        "SPMD (spmd.local_map)."
    )
    assert err.fixes == ("spmd.all_reduce(x, 'tp', src=spmd.S(0), dst=spmd.R, op='max')",)


def test_strict_mode_refuses_a_plain_input(tp4):
    with spmd.typecheck(strict=True):
        err = _raises(spmd.SpmdTypeError, spmd.all_reduce, torch.ones(2), "tp", src=V, dst=R, op="max")
    assert err.rule == (
        "Strict typechecking: spmd.all_reduce got a plain (untyped) tensor, so its src=V cannot be checked; give it "
        "a type first."
    )
    assert err.fixes == ("spmd.assert_type(x, {'tp': spmd.V})",)
