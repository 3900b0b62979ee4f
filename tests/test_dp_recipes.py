"""Data parallel three ways on 4 real gloo processes (issue 9, item 1), against one device.

The recipes live in ``_gloo_programs.py`` (``DP_PROGRAMS``): parameters R on dp
with a typed all-reduce of each gradient (and its ZeRO variant with a
reduce-scatter), torch DistributedDataParallel through ``spmd.register_ddp``,
and FSDP-style dp shards gathered to R. Each runs two SGD steps, typed and
erased; losses, every gradient and the final parameters must equal plain SGD
on one device with the full batch. One spawn runs them all.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _gloo_programs import DP_PROGRAMS, MODES, WORLD, dp_worker
from conftest import fake_mesh
from test_gloo import _failures, _read_results
from torch.multiprocessing.spawn import ProcessException

import spmd_types as spmd

DEADLINE_S = 240


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out_dir = tmp_path_factory.mktemp("gloo_dp")
    start = time.perf_counter()
    ctx = mp.start_processes(dp_worker, args=("file://" + str(out_dir / "filestore"), str(out_dir)),
                             nprocs=WORLD, join=False, start_method="spawn")
    crash = None
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                crash = f"the workers did not finish within {DEADLINE_S} s"
                break
    except ProcessException as err:
        crash = f"a worker failed: {err}"
    return _read_results(out_dir), crash, time.perf_counter() - start


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", DP_PROGRAMS)
def test_dp_recipe_matches_single_device(dp_results, program, mode):
    """Two SGD steps: losses, gradients and final parameters equal one device's, on every rank."""
    results, crash, _ = dp_results
    failures = _failures(results, crash, f"{program}-{mode}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def test_dp_workers_exit_cleanly(dp_results):
    _, crash, seconds = dp_results
    assert crash is None, crash
    assert seconds < DEADLINE_S


# ---------------------------------------------------------------------------
# spmd.register_ddp in one process (a fake process group: its all-reduce leaves each value as is)


@pytest.fixture(params=[False, True], ids=["copied-grads", "bucket-view-grads"])
def ddp_on_fake(request):
    """A DDP model on a fake dp group, with gradients copied out of DDP's buckets or views into them."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ddp = DistributedDataParallel(model, process_group=mesh.get_group("dp"), gradient_as_bucket_view=request.param)
    return mesh, model, ddp


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def test_register_ddp_types_gradients_r_and_averages(ddp_on_fake):
    mesh, model, ddp = ddp_on_fake
    x = torch.randn(3, 4)
    model(x).pow(2).sum().backward()  # the plain gradient, for comparison
    plain = {n: g.clone() for n, g in _grads(model).items()}
    model.zero_grad(set_to_none=True)
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd.assert_type(model, {"dp": spmd.R, "tp": spmd.I})
        assert spmd.register_ddp(ddp, "dp") is ddp
        ddp(spmd.assert_type(x, {"dp": spmd.V, "tp": spmd.I})).pow(2).sum().backward()
    for n, g in _grads(model).items():
        assert spmd.get_type(g) == {"dp": spmd.R, "tp": spmd.I}
        # The fake group's all-reduce returns each rank's own value; op="avg" divides it by dp's size.
        torch.testing.assert_close(g.as_subclass(torch.Tensor), plain[n] / 2)


def test_register_ddp_no_sync_leaves_p_and_a_step_is_rejected(ddp_on_fake):
    mesh, model, ddp = ddp_on_fake
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd.assert_type(model, {"dp": spmd.R, "tp": spmd.I})
        spmd.register_ddp(ddp, "dp")
        x = spmd.assert_type(torch.randn(3, 4), {"dp": spmd.V, "tp": spmd.I})
        with ddp.no_sync():
            ddp(x).sum().backward()
        assert spmd.get_type(model.weight.grad) == {"dp": spmd.P, "tp": spmd.I}
        with pytest.raises(spmd.SpmdTypeError, match=r"^A pending sum \(P\) can only be added to another pending"):
            with torch.no_grad():
                model.weight -= 0.1 * model.weight.grad
        with pytest.raises(spmd.SpmdTypeError, match=r"^The gradient of parameter 'weight' f32\[4,4\] is a pending sum"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        ddp(x).sum().backward()  # a synced backward after no_sync: the accumulated gradient is all-reduced
        assert spmd.get_type(model.weight.grad) == {"dp": spmd.R, "tp": spmd.I}


def test_register_ddp_sum_keeps_the_sum(ddp_on_fake):
    mesh, model, ddp = ddp_on_fake
    x = torch.randn(3, 4)
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd.assert_type(model, {"dp": spmd.R, "tp": spmd.I})
        spmd.register_ddp(ddp, mesh.get_group("dp"), op="sum")
        ddp(spmd.assert_type(x, {"dp": spmd.V, "tp": spmd.I})).sum().backward()
    torch.testing.assert_close(model.bias.grad.as_subclass(torch.Tensor), torch.full((4,), 3.0))


def test_register_ddp_rejections(ddp_on_fake):
    mesh, model, ddp = ddp_on_fake
    with spmd.set_current_mesh(mesh):
        with pytest.raises(TypeError) as err:
            spmd.register_ddp(model, "dp")
        assert str(err.value) == (
            "spmd.register_ddp takes a torch.nn.parallel.DistributedDataParallel model, got Linear"
        )
        with pytest.raises(ValueError) as err:
            spmd.register_ddp(ddp, "dp", op="max")
        assert str(err.value) == "spmd.register_ddp: op must be 'avg' or 'sum', got 'max'"
        with pytest.raises(ValueError) as err:
            spmd.register_ddp(ddp, "tp")
        assert str(err.value) == (
            "spmd.register_ddp: this DDP model all-reduces over another process group than axis 'tp'; "
            "build it with DistributedDataParallel(model, process_group=<the 'tp' group>)"
        )
        with pytest.raises(ValueError) as err:
            spmd.register_ddp(ddp, "pp")
        assert str(err.value) == "spmd.register_ddp: unknown mesh axis 'pp'; the current mesh has axes 'dp', 'tp'"
        with spmd.typecheck():
            spmd.assert_type(model, {"dp": spmd.I, "tp": spmd.I})
        with pytest.raises(TypeError) as err:
            spmd.register_ddp(ddp, "dp")
        assert str(err.value) == (
            "spmd.register_ddp: parameter 'weight' is I on axis 'dp', not R. DDP all-reduces every gradient "
            "over 'dp', which is right only for a replicated (R) parameter, whose gradient is a pending sum (P); "
            "type it with spmd.assert_type(model, {'dp': spmd.R, ...})"
        )


def test_register_ddp_checks_parameters_typed_after_it(ddp_on_fake):
    """A parameter typed I after registration is caught when the hook runs, before it communicates."""
    mesh, model, ddp = ddp_on_fake
    with spmd.set_current_mesh(mesh):
        spmd.register_ddp(ddp, "dp")
        with spmd.typecheck():
            spmd.assert_type(model, {"dp": spmd.I, "tp": spmd.I})
            x = spmd.assert_type(torch.randn(3, 4), {"dp": spmd.I, "tp": spmd.I})
            with pytest.raises(TypeError, match=r"^spmd.register_ddp: parameter '(weight|bias)' is I on axis 'dp'"):
                ddp(x).sum().backward()


def test_recipe_a_without_the_gradient_all_reduce_is_rejected_at_the_step():
    """docs/data_parallel.md (a): forget ``p.grad = all_reduce(p.grad, ...)`` and the optimizer step names p."""
    from _gloo_programs import _dp_model

    mesh = fake_mesh((4,), ("dp",))
    model = _dp_model()
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd.assert_type(model, {"dp": spmd.R})
        x = spmd.assert_type(torch.randn(2, 8), {"dp": spmd.S(0)})
        spmd.all_reduce(model(x).pow(2).mean(), "dp", src=spmd.V, dst=spmd.I, op="avg").backward()
        assert {spmd.get_type(p.grad)["dp"] for p in model.parameters()} == {spmd.P}
        with pytest.raises(spmd.SpmdTypeError, match=r"^The gradient of parameter '0\.weight' f32\[16,8\] is a pending"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()
