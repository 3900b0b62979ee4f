"""torchtitan-style end to end: a 2-block Llama parallelized with DTensor, typechecked, against one device.

* Simulated ranks (LocalTensorMode): tensor + sequence parallel on tp=2 with
  ``parallelize_module``; and FSDP's weight gather written as
  ``spmd.all_gather(w, "dp", src=S(0), dst=R)`` on dp=2 (every weight the
  forward uses is ``Reduced()``; backward is one reduce-scatter per weight).
* A fake process group: ``parallelize_module`` on tp and ``fully_shard`` on dp
  of a (dp=2, tp=2) mesh typecheck, forward and backward.
* gloo (4 processes): the same TP + ``fully_shard`` model gives the
  single-device loss and gradients; FSDP's backward is reduce-scatters only.

``fully_shard`` does not run on LocalTensorMode: after backward it frees the
unsharded parameters with ``storage.resize_(0)``, and a LocalTensor (a wrapper
subclass) has no real storage ("Attempted to call resize_() on an invalid
python storage"), hence gloo for it.
"""

from __future__ import annotations

import copy
import json
import time

import _dtensor_llama as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.utils import parametrize

import spmd_types as spmd
from spmd_types.integrations.dtensor.propagation import plain_dtensor
from spmd_types.testing import CommCounter, per_rank, rank_values

TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def single_device():
    model = L.Llama()
    tokens, targets = L.batch()
    loss, grads = L.reference(copy.deepcopy(model), tokens, targets)
    return model, tokens, targets, loss, grads


def _full(t: torch.Tensor) -> torch.Tensor:
    values = rank_values(plain_dtensor(t).full_tensor() if isinstance(t, DTensor) else t)
    for v in values.values():
        assert torch.equal(v, values[0])
    return values[0]


def test_tensor_parallel_llama_on_simulated_ranks(single_device):
    model, tokens, targets, ref_loss, ref_grads = single_device
    mesh = fake_mesh((2,), ("tp",))
    with LocalTensorMode(2):
        m = L.apply_tp(copy.deepcopy(model), mesh)
        with spmd.typecheck(), CommCounter() as comms:
            loss = F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())
            fwd = comms.counts
            comms.reset()
            loss.backward()
        torch.testing.assert_close(_full(loss), ref_loss, **TOL)
        for name, p in m.named_parameters():
            torch.testing.assert_close(_full(p.grad), ref_grads[name], **TOL)
    # embedding (RS), per block 2 x (AG before attention/MLP, RS after wo/w2), output AG in + AG logits
    assert fwd == {"all_gather": 6, "reduce_scatter": 5}
    assert comms.counts == {"all_gather": 5, "reduce_scatter": 5}  # the logits gather's backward is a slice


def test_torchtitan_default_plan_with_local_outputs_on_simulated_ranks(single_device):
    """Issue 14 item 2: torchtitan's own plan keeps use_local_output=True, so the bodies and the residual stream
    are plain local tensors (RowwiseParallel's output an AsyncCollectiveTensor). Typed at the block boundaries and
    by the attention core's local_map, every DTensor.from_local checks its input; the step matches one device."""
    model, tokens, targets, ref_loss, ref_grads = single_device
    mesh = fake_mesh((2,), ("tp",))
    seen = []
    with LocalTensorMode(2):
        m = L.apply_tp(copy.deepcopy(model), mesh, local_output=True)
        m.layers["0"].feed_forward.w2.register_forward_hook(lambda mod, args, out: seen.append(type(out).__name__))
        with spmd.set_current_mesh(mesh), spmd.typecheck(), CommCounter() as comms:
            loss = F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())
            fwd = comms.counts
            comms.reset()
            loss.backward()
        torch.testing.assert_close(_full(loss), ref_loss, **TOL)
        for name, p in m.named_parameters():
            torch.testing.assert_close(_full(p.grad), ref_grads[name], **TOL)
    assert seen == ["AsyncCollectiveTensor"]
    assert fwd == {"all_gather": 6, "reduce_scatter": 5}  # the same communication as the DTensor-output plan
    assert comms.counts == {"all_gather": 5, "reduce_scatter": 5}


def test_torchtitan_default_plan_checks_the_typed_locals(single_device):
    model, tokens, _, _, _ = single_device
    mesh = fake_mesh((2,), ("tp",))
    m = L.apply_tp(copy.deepcopy(model), mesh, local_output=True)
    m.layers["0"].boundary = {"tp": spmd.R}  # wrong: the block input is this rank's sequence shard
    with spmd.set_current_mesh(mesh), spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as info:
        m(tokens)
    assert info.value.rule == (
        "DTensor.from_local: the tensor is R on axis 'tp', and the placement Shard(dim=1) means S(1).")
    assert info.value.fixes == ("spmd.convert(x, 'tp', src=spmd.R, dst=spmd.S(1))",)


def test_fsdp_gather_to_reduced_on_simulated_ranks(single_device):
    model, tokens, targets, ref_loss, ref_grads = single_device
    mesh = fake_mesh((2,), ("dp",))
    seen = []
    with LocalTensorMode(2):
        m = L.apply_reduced_gather(copy.deepcopy(model), mesh)
        m.output.register_forward_hook(lambda mod, args, out: seen.append(repr(mod.weight.placements)))
        shard = lambda t: DTensor.from_local(per_rank(lambda r: t.chunk(2)[r].clone()), mesh, [Shard(0)])  # noqa: E731
        with spmd.typecheck(), CommCounter() as comms, parametrize.cached():  # the hook reads the cached gather
            loss = F.cross_entropy(m(shard(tokens)).flatten(0, 1), shard(targets).flatten())
            fwd = comms.counts
            comms.reset()
            loss.backward()
        torch.testing.assert_close(_full(loss), ref_loss, **TOL)
        params = L.sharded_params(m)
        for name, p in params.items():
            assert repr(p.grad.placements) == "(Shard(dim=0),)", name
            torch.testing.assert_close(_full(p.grad), ref_grads[name], **TOL)
    assert seen[0] == "(Reduced(),)"
    assert len(params) == 21
    assert fwd == {"all_gather": 21}
    assert comms.counts == {"reduce_scatter": 21}  # one per weight, N bytes each; no all-reduce (2N)


def test_torchtitan_plan_with_fully_shard_typechecks_on_a_fake_process_group(single_device):
    model, tokens, targets, _, _ = single_device
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    m = L.apply_fsdp(L.apply_tp(copy.deepcopy(model), mesh["tp"]), mesh["dp"])
    with spmd.typecheck():
        loss = F.cross_entropy(m(tokens[:2]).flatten(0, 1), targets[:2].flatten())
        loss.backward()
    assert all(isinstance(p.grad, DTensor) for p in m.parameters())


def test_a_wrong_boundary_or_region_type_is_caught(single_device):
    model, tokens, _, _, _ = single_device
    mesh = fake_mesh((2,), ("tp",))
    m = L.apply_tp(copy.deepcopy(model), mesh)
    m.layers["1"].boundary = {"tp": spmd.R}
    with spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as info:
        m(tokens)
    assert info.value.rule == (
        "Type assertion failed: the DTensor is Shard(dim=1) (S(1)) on axis 'tp', and the assertion says R.")
    core = spmd.local_map(L._sdpa, in_types=[{"tp": spmd.S(1)}] * 3, out_types={"tp": spmd.S(2)})
    m.layers["1"].boundary = None
    q = m.layers["0"].attention.wq(plain_dtensor(m.tok_embeddings(tokens)).redistribute(
        mesh, [Replicate()])).view(L.BATCH, L.SEQ, -1, L.DIM // L.HEADS)
    with spmd.typecheck(), pytest.raises(spmd.SpmdTypeError) as info:
        core(q, q, q)
    assert info.value.rule == (
        "Type assertion failed: the DTensor is Shard(dim=2) (S(2)) on axis 'tp', and the assertion says S(1).")


# ---------------------------------------------------------------------------
# gloo: fully_shard for real


@pytest.fixture(scope="module")
def gloo_rows(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from _dtensor_gloo import WORLD, worker

    out = tmp_path_factory.mktemp("dtensor_gloo")
    start = time.perf_counter()
    mp.start_processes(worker, args=("file://" + str(out / "store"), str(out)), nprocs=WORLD, start_method="spawn")
    rows = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return rows, time.perf_counter() - start


def test_tp_and_fully_shard_on_gloo_match_one_device(gloo_rows):
    rows, _ = gloo_rows
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["params"] == 21 and len(row["checked"]) == 22  # the loss and every gradient
        # FSDP (c10d ops on dp): 3 units gathered once; backward reduce-scatters only.
        assert {k: v for k, v in row["forward"].items() if k.startswith("fsdp")} == {"fsdp all_gather": 3}
        assert {k: v for k, v in row["backward"].items() if k.startswith("fsdp")} == {"fsdp reduce_scatter": 3}
        # DTensor's tensor/sequence parallel (functional collectives on tp), as on simulated ranks, plus the
        # tp all-reduce of the 5 SequenceParallel norm weights' Partial gradients (FSDP needs them Replicate).
        assert {k: v for k, v in row["backward"].items() if k.startswith("dtensor") and "wrap" not in k} == {
            "dtensor all_gather": 5, "dtensor reduce_scatter": 5, "dtensor all_reduce": 5}


def test_the_loss_example_on_the_dtensor_page_prints_what_the_page_says(tmp_path, monkeypatch):
    """docs/dtensor.md: a loss over a sharded class dim passes local SPMD and is refused by global SPMD."""
    import contextlib
    import io
    import linecache
    import pathlib
    import re
    import runpy

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "dtensor.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", page, flags=re.S | re.M)
    pairs = [(code, out) for (lang, code), (lang2, out) in zip(blocks, blocks[1:]) if (lang, lang2) == ("python", "text")]
    assert len(pairs) == 1
    code, output = pairs[0]
    monkeypatch.setenv("SPMD_TYPES_ERRORS", "plain")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(code)
    linecache.clearcache()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path("model.py", run_name="__main__")
    assert printed.getvalue() == output
