"""spmd_types.testing.simulate: the fake process group, the mesh, the device, LocalTensorMode, and cleanup."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types._core.mesh import current_mesh
from spmd_types.testing import CommCounter, denote, per_rank, simulate


def _no_group():
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fake_meta_yields_the_current_mesh_and_cleans_up():
    _no_group()
    with simulate((2, 4), ("dp", "tp")) as mesh:
        assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.mesh.shape) == (2, 4)
        assert dist.get_world_size() == 8 and dist.get_backend() == "fake"
        assert current_mesh().axis_names == ("dp", "tp")
        w = torch.nn.Parameter(torch.empty(3, 5))
        assert w.device.type == "meta"
        with spmd.typecheck():
            spmd.assert_type(w, {"dp": spmd.R, "tp": spmd.V})
            x = spmd.assert_type(torch.empty(2, 5), {"dp": spmd.V, "tp": spmd.I})
            y = F.linear(spmd.convert(x, "tp", src=spmd.I, dst=spmd.R), w)
            z = spmd.all_reduce(y, "tp", src=spmd.V, dst=spmd.I)
            assert spmd.get_type(z) == {"dp": spmd.V, "tp": spmd.I} and z.device.type == "meta"
            z.sum().backward()
        assert spmd.get_type(w.grad) == {"dp": spmd.P, "tp": spmd.V}
    assert not dist.is_initialized()
    assert torch.empty(1).device.type == "cpu"
    assert current_mesh() is None


def test_a_type_error_at_scale_is_caught_on_meta():
    with simulate((64, 8), ("dp", "tp")), spmd.typecheck():
        w = spmd.assert_type(torch.nn.Parameter(torch.empty(1024, 8192)), {"dp": spmd.R, "tp": spmd.V})
        x = spmd.assert_type(torch.empty(4, 8192, requires_grad=True), {"dp": spmd.V, "tp": spmd.I})
        with pytest.raises(spmd.SpmdTypeError, match="Invariant"):
            F.linear(x, w)


def test_local_ranks_compute_every_rank():
    with simulate((2, 2), ("dp", "tp"), ranks="local", device="cpu") as mesh:
        x = per_rank(lambda r: torch.full((3,), float(r)))
        with CommCounter() as comms:
            y = spmd.all_reduce(x, "tp", src=spmd.P, dst=spmd.R)
        assert comms.counts == {"all_reduce": 1}
        torch.testing.assert_close(denote(y, mesh, {"dp": spmd.V, "tp": spmd.R}), torch.tensor([[1.0] * 3, [5.0] * 3]))
    assert not dist.is_initialized()


def test_reuses_a_fake_group_of_the_same_size_and_leaves_it():
    _no_group()
    dist.init_process_group("fake", rank=0, world_size=4, store=_store())
    group = dist.group.WORLD
    with simulate((4,), ("tp",)):
        assert dist.group.WORLD is group
    assert dist.is_initialized() and dist.group.WORLD is group
    with simulate((8,), ("tp",)):
        assert dist.get_world_size() == 8
    assert not dist.is_initialized()


def test_cleans_up_when_the_body_raises():
    _no_group()
    with pytest.raises(ZeroDivisionError), simulate((2,), ("tp",), ranks="local", device="cpu"):
        raise ZeroDivisionError("the body fails")
    assert not dist.is_initialized() and torch.empty(1).device.type == "cpu"


def _store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ranks": "real"}, "simulate: ranks must be 'fake' or 'local', got 'real'"),
        ({"device": "cuda"}, "simulate: device must be 'meta' or 'cpu', got 'cuda'"),
        ({"ranks": "local"}, "simulate: ranks='local' computes every rank's values, so it needs device='cpu'"),
        ({"names": ("dp",)}, "simulate: 2 mesh sizes but 1 axis names"),
    ],
)
def test_argument_errors(kwargs, message):
    args = {"mesh_shape": (2, 2), "names": ("dp", "tp"), **kwargs}
    with pytest.raises(ValueError) as err, simulate(**args):
        pass
    assert str(err.value) == message


def test_refuses_to_replace_a_real_process_group(tmp_path):
    _no_group()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        with pytest.raises(RuntimeError) as err, simulate((2,), ("tp",)):
            pass
        assert str(err.value) == (
            "simulate: a real process group ('gloo') is already initialized; "
            "simulate before init_process_group or after destroy_process_group"
        )
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# rank=: another rank's program (a pipeline stage's first rank, say)


def test_rank_runs_that_ranks_program():
    _no_group()
    with simulate((2, 2), ("pp", "tp"), rank=2, device="cpu") as mesh:
        assert dist.get_rank() == 2 and dist.get_world_size() == 4
        assert tuple(mesh.get_coordinate()) == (1, 0)  # pipeline stage 1, tp rank 0
        assert dist.get_process_group_ranks(mesh.get_group("pp")) == [0, 2]
        assert dist.get_process_group_ranks(mesh.get_group("tp")) == [2, 3]
        with spmd.typecheck():
            stage = spmd.axis_index("pp")
            assert spmd.get_type(stage) == {"pp": spmd.V, "tp": spmd.R}
        assert int(stage) == 1
    assert not dist.is_initialized()


def test_rank_replaces_a_fake_group_of_another_rank_and_reuses_its_own():
    _no_group()
    dist.init_process_group("fake", rank=0, world_size=4, store=_store())
    with simulate((4,), ("tp",), rank=3):  # the rank-0 group is not this program's: replaced
        assert dist.get_rank() == 3
    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=3, world_size=4, store=_store())
    group = dist.group.WORLD
    with simulate((4,), ("tp",), rank=3):
        assert dist.group.WORLD is group
    assert dist.is_initialized() and dist.get_rank() == 3
    _no_group()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 4}, "simulate: rank must be one of the mesh's 4 ranks (0 to 3), got 4"),
        ({"rank": -1}, "simulate: rank must be one of the mesh's 4 ranks (0 to 3), got -1"),
        ({"rank": "1"}, "simulate: rank must be one of the mesh's 4 ranks (0 to 3), got '1'"),
        ({"rank": 1, "ranks": "local", "device": "cpu"},
         "simulate: ranks='local' runs every rank at once, so it takes no rank= (got 1)"),
    ],
)
def test_rank_argument_errors(kwargs, message):
    _no_group()
    with pytest.raises(ValueError) as err, simulate((2, 2), ("dp", "tp"), **kwargs):
        pass
    assert str(err.value) == message
    assert not dist.is_initialized()


def test_local_ranks_read_their_own_rank_from_every_group():
    # torchtitan's embedding and loss slice by dist.get_rank(group), Megatron by group.rank(): under
    # ranks="local" each simulated rank reads its own index (torch's simulator alone answers 0 on 2.13).
    from spmd_types.testing import rank_values

    _no_group()
    with simulate((2, 2), ("dp", "tp"), ranks="local", device="cpu") as mesh:
        tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
        seen = per_rank(lambda r: torch.zeros(5, dtype=torch.long))
        seen[0] += dist.get_rank(tp)
        seen[1] += dist.get_rank(dp)
        seen[2] += tp.rank()
        seen[3] += dist.get_world_size(tp)
        seen[4] += dist.get_world_size()
        assert {r: v.tolist() for r, v in rank_values(seen).items()} == {
            0: [0, 0, 0, 2, 4], 1: [1, 0, 1, 2, 4], 2: [0, 1, 0, 2, 4], 3: [1, 1, 1, 2, 4]}
        assert dist.group.WORLD.rank() == 0  # the default group: this process's rank (groups are made by it)
        # min and max of per-rank ints run rank by rank (torchtitan's loss: min(vocab, start + chunk))
        start = 3 * dist.get_rank(tp)
        bounds = per_rank(lambda r: torch.zeros(4, dtype=torch.long))
        bounds[0] += min(4, start + 3)
        bounds[1] += max(0, start - 1)
        bounds[2] += min([5, start])
        bounds[3] += max(start, 1)
        assert [v.tolist() for v in rank_values(bounds).values()] == [[3, 0, 0, 1], [4, 2, 3, 3]] * 2
    _no_group()
    with simulate((2,), ("tp",), ranks="local", device="cpu") as mesh:  # a 1-D mesh's group is the default one
        got = rank_values(torch.zeros(1, dtype=torch.long) + dist.get_rank(mesh.get_group("tp")))
        assert {r: v.tolist() for r, v in got.items()} == {0: [0], 1: [1]}
        # slicing with per-rank bounds (Megatron's local experts: routing_map[:, first:last])
        first = 2 * dist.get_rank(mesh.get_group("tp"))
        got = rank_values(per_rank(lambda r: torch.arange(8).view(2, 4))[:, first:first + 2])
        assert {r: v.tolist() for r, v in got.items()} == {0: [[0, 1], [4, 5]], 1: [[2, 3], [6, 7]]}
    assert not hasattr(torch._C._SymNode, "statically_known_true")  # taken away after the simulation
    assert dist.get_rank.__module__ == "torch.distributed.distributed_c10d"  # put back on exit
    assert type(min).__name__ == type(max).__name__ == "builtin_function_or_method"  # the builtins back
    _no_group()
    with simulate((2,), ("tp",)) as mesh:  # one rank's program (ranks="fake"): that rank's answers
        assert dist.get_rank(mesh.get_group("tp")) == 0 and mesh.get_group("tp").rank() == 0
