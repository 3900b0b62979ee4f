"""torchtitan 0.3.0 as its users run it on torch 2.14: FSDP applied, under FSDP + TP + SP, HSDP, CP and EP.

torch 2.14's FSDP2 reads the spmd types torchtitan gives its parameters
(``fully_shard(..., dp_mesh_dims=)``), so torchtitan's own ``apply_fsdp_to_decoder``
runs here, unshimmed. Checked: every decoder model torchtitan ships with spmd
annotations typechecks one trainer step under each layout torchtitan
typechecks (a fake process group: rank 0's program); on real gloo processes a
representative set gives the same loss and gradients with checking on as off,
bit for bit, and the one-device values within the tolerances below; what cannot
run on CPU, and why; planted sharding mistakes that only FSDP, HSDP or CP
expose, each caught at the torchtitan line. The harness: ``_torchtitan_fsdp.py``
(matrix and gloo worker), ``_torchtitan_fsdp_mistakes.py``, ``_torchtitan_models.py``.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

pytest.importorskip("torchtitan")

import _fsdp_spmd  # noqa: E402
import _torchtitan_fsdp as F  # noqa: E402
import _torchtitan_fsdp_mistakes as M  # noqa: E402
import _torchtitan_mistakes as tm  # noqa: E402
import _torchtitan_support as tt  # noqa: E402
import torch  # noqa: E402
from _torchtitan_shims import fsdp_reads_spmd_types, load  # noqa: E402
from conftest import fake_mesh  # noqa: E402

import spmd_types as spmd  # noqa: E402

on_214 = pytest.mark.skipif(not fsdp_reads_spmd_types(), reason="torch 2.13's FSDP2 does not read spmd types "
                            "(test_torch_213_fsdp_refuses_typed_plain_parameters); torchtitan runs it without FSDP")

# float32 models on gloo against the same model on one device (reduction order differs: the FSDP reduce-scatter,
# the TP all-reduces, the CP all-gather of k/v and the experts' token exchange)
LOSS_ATOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 2e-4, 1e-3


# ---------------------------------------------------------------------------
# what cannot run here, and why


def test_torch_213_fsdp_refuses_typed_plain_parameters():
    if fsdp_reads_spmd_types():
        pytest.skip("torch 2.14 reads the types (test_fsdp_spmd.py)")
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    mesh = fake_mesh((2, 2), ("dp_shard", "tp"))
    mlp = _fsdp_spmd.MLP(2, 0)
    with spmd.set_current_mesh(mesh):
        _fsdp_spmd.type_parameters(mlp)
        with pytest.raises(ValueError) as info:
            fully_shard(mlp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    assert str(info.value) == ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
                               "(e.g. via distribute_module). Got plain tensor for parameter 'w1'.")


@on_214
def test_fsdp_cannot_run_on_simulated_ranks():
    # torch's simulator alone: FSDP2 frees and refills its unsharded parameters by resizing storage, which
    # LocalTensor's storage refuses. Plain torch, no spmd type involved; simulate(ranks="local") and
    # check_equivalence teach the simulator FSDP's storage and shard picking (test_equivalence_fsdp.py).
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with LocalTensorMode(2):
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
            lin = torch.nn.Linear(4, 4, bias=False)
            fully_shard(lin, mesh=mesh)
            out = lin(torch.ones(2, 4))
            with pytest.raises(RuntimeError) as info:
                out.sum().backward()
    finally:
        dist.destroy_process_group()
    assert str(info.value) == "Attempted to call resize_() on an invalid python storage."


def test_qwen3_5_needs_flash_linear_attention():
    # Qwen3.5's Gated DeltaNet layers (three in four) run flash-linear-attention's Triton kernels, GPU only; the
    # package is imported with the model, so without a GPU stack the model cannot even be built
    load()
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("torchtitan.models.qwen3_5")
    assert info.value.name == "fla"


@on_214
@pytest.mark.parametrize("sp, have", [(True, "V"), (False, "I")], ids=["SP", "no SP"])
def test_muse_glimmer_text_model_under_tp_fails_its_own_assertion(sp, have):
    # torchtitan's bug, which checking finds: the text-only debug model's embedding emits sequence-parallel
    # activations under SP and I ones without (its sharding config says so), and its forward then asserts them R
    # on tp (a comment there says the assertion is wrong under PP; it is wrong under TP). The matrix runs
    # muse_glimmer without TP.
    c = tt.Case("muse_glimmer fsdp4 x tp2", "muse_glimmer", world=8, tp=2, sp=sp)
    with pytest.raises(spmd.SpmdTypeError) as info:
        tt.run(c, "fake")
    assert str(info.value).splitlines()[0] == (f"Type assertion failed: the tensor is {have} on axis 'tp', and the "
                                               "assertion says R.")
    assert tm.torchtitan_frames(info.value)[-1] == "models/muse_glimmer/model.py:525"


@on_214
def test_kimi_k2_7_refuses_context_parallelism():
    c = F.matrix_case("kimi_k2_7 fsdp2 x cp2 x tp2")
    with pytest.raises(NotImplementedError) as info:
        tt.run(c, "fake")
    assert str(info.value) == ("Context Parallel is not yet supported for Kimi K2.5: vision scatter needs the full "
                               "sequence before CP would shard it.")
    assert tm.torchtitan_frames(info.value)[-1] == "models/kimi_k2_7/parallelize.py:62"


# ---------------------------------------------------------------------------
# every model under every layout typechecks with FSDP applied (a fake process group: rank 0's program)

# The normal-size set: each model under FSDP + TP + SP, and llama3 and qwen3-MoE under the other layouts; the
# rest of the matrix is marked slow (pytest -m slow).
FAST = {f"{m} fsdp4 x tp2" for m in ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_k2_7")} | {
    "muse_glimmer fsdp8",
    "llama3 hsdp2x2 x tp2", "llama3 fsdp2 x cp2 x tp2", "qwen3_moe fsdp4 x tp2 x ep2"}


def _marked(names):
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in names]


def _unless_slow(request) -> None:
    """The nightly size runs only when asked for (``-m slow``), as the fuzzer's does."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("nightly size: select with -m slow")


@on_214
@pytest.mark.parametrize("name", _marked([c.name for c in F.MATRIX if F.refusal(c) is None]))
def test_step_typechecks_with_fsdp_applied(name, request):
    from torch.distributed.fsdp import FSDPModule

    if name not in FAST:
        _unless_slow(request)
    c = F.matrix_case(name)
    seen = {}

    def record(b):
        seen["fsdp"] = sum(isinstance(m, FSDPModule) for m in b.model.modules())

    step = tt.run(c, "fake", inspect=record)  # raises on any type error; every parameter gets a gradient
    assert seen["fsdp"] >= 2, "torchtitan's fully_shard was not applied"
    assert torch.isfinite(step.loss[0]).all()
    assert step.grads and all(torch.isfinite(g[0]).all() for g in step.grads.values())


# ---------------------------------------------------------------------------
# numerics on gloo: checking on == checking off, bit for bit; == one device within tolerance

# One launch per set (8 processes each): the normal-size set, and the rest of the representative cases (slow).
GLOO_FAST = ("llama3 fsdp4 x tp2",)
GLOO_SLOW = ("llama3 hsdp2x2 x tp2", "llama3 fsdp2 x cp2 x tp2", "qwen3_moe fsdp4 x tp2 x ep2", "deepseek_v3 fsdp4 x tp2 x ep2",
             "kimi_k2_7 fsdp4 x tp2", "muse_glimmer fsdp4 x cp2")


@pytest.fixture(scope="module", params=[pytest.param(GLOO_FAST, id="fast"),
                                        pytest.param(GLOO_SLOW, id="slow", marks=pytest.mark.slow)])
def gloo_results(request, tmp_path_factory):
    import torch.distributed as dist

    if not fsdp_reads_spmd_types():
        pytest.skip("torch 2.13's FSDP2 does not read spmd types")
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if request.param is GLOO_SLOW:
        _unless_slow(request)
    return F.launch(list(request.param), str(tmp_path_factory.mktemp("titan_gloo")))


def test_gloo_checking_on_equals_checking_off_and_one_device(gloo_results, record_property):
    for result in gloo_results:
        c = F.matrix_case(result["name"])
        typed, erased = result["typed"], result["erased"]
        # checking changes nothing: every rank's loss and every (reassembled) gradient, bit for bit
        assert torch.equal(typed["losses"], erased["losses"]), c.name
        assert typed["grads"].keys() == erased["grads"].keys()
        changed = [n for n in typed["grads"] if not torch.equal(typed["grads"][n], erased["grads"][n])]
        assert not changed, f"{c.name}: checking changed the gradients of {changed}"
        # one device, from the same initial weights: the whole batch, no parallelism
        ref = tt.run_one_device(c, typed["weights"])
        assert typed["grads"].keys() == ref.grads.keys(), c.name
        torch.testing.assert_close(typed["global_loss"], ref.loss[0], atol=LOSS_ATOL, rtol=0, msg=c.name)
        worst = 0.0
        for n, g in typed["grads"].items():
            torch.testing.assert_close(g, ref.grads[n][0], atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                       msg=lambda m, n=n, case=c.name: f"{case}: gradient of {n}: {m}")
            worst = max(worst, float((g - ref.grads[n][0]).abs().max()))
        loss_error = float((typed["global_loss"] - ref.loss[0]).abs())
        record_property(c.name, {"loss error": loss_error, "largest gradient error": worst})
        print(f"{c.name}: vs one device, loss error {loss_error:.2e}, largest gradient error {worst:.2e}")


# ---------------------------------------------------------------------------
# mistakes only FSDP, HSDP or CP expose


@on_214
@pytest.mark.parametrize("name", [m.name for m in M.MISTAKES])
def test_planted_mistake_is_caught_at_the_torchtitan_line(name):
    m = M.mistake(name)
    exc = M.plant(m)
    assert exc is not None, f"{m.name}: ran through"
    kind, first_line = m.error
    assert isinstance(exc, kind), f"{m.name}: expected {kind.__name__}, got {exc!r}"
    assert str(exc).splitlines()[0] == first_line
    frames = tm.torchtitan_frames(exc)
    for line in m.lines:
        assert line in frames, f"{m.name}: the error does not point at {line}; torchtitan frames {frames}"


@on_214
@pytest.mark.parametrize("name", [m.name for m in M.MISTAKES])
def test_planted_mistake_is_harmless_without_the_parallelism_that_exposes_it(name):
    m = M.mistake(name)
    assert M.plant(m, m.hidden_in) is None
