"""Worker code for tests/test_gloo.py: three parallel programs on a real (dp=2, tp=2) gloo mesh.

Each program runs twice on every rank, typed (inside ``spmd.typecheck()``, with
``assert_type`` on parameters and inputs) and erased (the same code with no
checking), and checks its loss, every parameter gradient and the input's
gradient (which catches a missing copy_to region), each reassembled from the
shards with raw ``torch.distributed`` calls (never through spmd, so the check
does not trust the code under test), against the same model run on one device
with the full batch and full weights.

The programs:

* ``megatron_mlp``: a Megatron tensor-parallel MLP (column-parallel fc1,
  row-parallel fc2) on tp, data parallel on dp. Parameters are I on dp and
  ``convert(w, "dp", src=I, dst=R)`` in forward, so backward all-reduces each
  gradient over dp (DDP inside the graph) and gradients come back I on dp.
* ``sequence_parallel``: activations sharded on the sequence dim over tp,
  LayerNorm with weights I on tp converted I -> R, ``all_gather`` S(0) -> R
  before the column-parallel linear, ``reduce_scatter`` P -> S(0) after the
  row-parallel one, and a residual connection.
* ``fsdp_tp``: the MLP of ``megatron_mlp`` with every parameter also sharded on
  dp (S(0)) and gathered with ``all_gather(src=S(0), dst=R)`` in forward, whose
  backward reduce-scatters the gradient back into dp shards.

Every rank appends one JSON line per program to ``rank<r>.jsonl`` as it
finishes, so a hang still leaves the results so far.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import spmd_types as spmd

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V

PROGRAMS = ("megatron_mlp", "sequence_parallel", "fsdp_tp")
MODES = ("erased", "typed")
WORLD = 4
HIDDEN, FFN, BATCH, SEQ = 8, 16, 8, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}

# A layout lists how a full tensor is cut into this rank's local piece: (axis, tensor dim)
# steps applied in order, so [("tp", 0), ("dp", 0)] is the dp half of the tp half of dim 0.
Layout = list


# ---------------------------------------------------------------------------
# tensors: full ones from a seed, local pieces, and reassembly


def _full_tensors(seed: int, batch_shape: tuple[int, ...], layer_norm: bool = False) -> dict[str, torch.Tensor]:
    """The full input ``x`` and full MLP (and LayerNorm) weights; the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(seed)
    full = {
        "x": torch.randn(*batch_shape, HIDDEN, generator=g),
        "w1": torch.randn(FFN, HIDDEN, generator=g) / HIDDEN**0.5,
        "b1": torch.randn(FFN, generator=g) * 0.1,
        "w2": torch.randn(HIDDEN, FFN, generator=g) / FFN**0.5,
        "b2": torch.randn(HIDDEN, generator=g) * 0.1,
    }
    if layer_norm:
        full["ln_w"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        full["ln_b"] = 0.1 * torch.randn(HIDDEN, generator=g)
    return full


def _shard(t: torch.Tensor, layout: Layout, mesh) -> torch.Tensor:
    """This rank's local piece of the full tensor ``t``."""
    for axis, dim in layout:
        t = t.chunk(mesh.size(mesh.mesh_dim_names.index(axis)), dim)[mesh.get_local_rank(axis)]
    return t.contiguous()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain-tensor copy (typed gradients are LTensors; raw torch.distributed gets plain tensors)."""
    return torch.Tensor._make_subclass(torch.Tensor, t.detach()).clone()


def _unshard(t: torch.Tensor, layout: Layout, mesh) -> torch.Tensor:
    """The full tensor from every rank's piece, undoing ``layout`` innermost step first (raw all_gather)."""
    for axis, dim in reversed(layout):
        group = mesh.get_group(axis)
        parts = [torch.empty_like(t) for _ in range(group.size())]
        dist.all_gather(parts, t.contiguous(), group=group)
        t = torch.cat(parts, dim)
    return t


def _local_leaves(full: dict, layouts: dict, mesh) -> tuple[torch.Tensor, dict[str, torch.nn.Parameter]]:
    """This rank's input (a leaf that requires grad, so its gradient is checked too) and parameters."""
    x = _shard(full["x"], layouts["x"], mesh).requires_grad_()
    return x, {k: torch.nn.Parameter(_shard(v, layouts[k], mesh)) for k, v in full.items() if k != "x"}


def _checking(typed: bool):
    return spmd.typecheck() if typed else contextlib.nullcontext()


# ---------------------------------------------------------------------------
# the models: one tensor-parallel MLP, its single-device reference, the loss


def _tp_mlp(x: torch.Tensor, w: dict) -> torch.Tensor:
    """Megatron MLP on tp: ``x`` I on tp, fc1 column-parallel, fc2 row-parallel; the output is I on tp."""
    x = spmd.convert(x, "tp", src=I, dst=R)  # copy_to_tensor_model_parallel_region: backward all-reduces
    h = F.gelu(F.linear(x, w["w1"], w["b1"]))  # this rank's FFN columns: V on tp
    y = spmd.reinterpret(F.linear(h, w["w2"]), "tp", src=V, dst=P)  # partial products of the full matmul
    y = spmd.all_reduce(y, "tp", src=P, dst=I)  # reduce_from_tensor_model_parallel_region
    return y + w["b2"]


def _mlp_reference(x: torch.Tensor, w: dict) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w["w1"], w["b1"])), w["w2"], w["b2"])


def _global_mean_loss(out: torch.Tensor, count: int, axes) -> torch.Tensor:
    """sum(out ** 2) / ``count`` over the whole mesh: each rank's local sum, summed over ``axes`` to an I value.

    dst=I, not R: backward() from an R value is rejected (its seed 1 on every rank
    would mean the mesh size), and all_reduce(dst=I) backward needs no communication.
    """
    return spmd.all_reduce(out.pow(2).sum() / count, axes, src=V, dst=I)


def _reference(loss_fn: Callable, full: dict) -> tuple[torch.Tensor, dict]:
    """Loss and gradients (the input's included) of the single-device model on the full batch and weights."""
    w = {k: v.clone().requires_grad_() for k, v in full.items()}
    loss = loss_fn(w["x"], w)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in w.items()}


# ---------------------------------------------------------------------------
# (a) Megatron tensor-parallel MLP, data parallel on dp


MLP_TP_LAYOUT = {"x": [("dp", 0)], "w1": [("tp", 0)], "b1": [("tp", 0)], "w2": [("tp", 1)], "b2": []}


def _tp_types(layout: Layout) -> dict:
    """Types on tp: S(d) where the tp step cuts dim d, else I (the same on every tp rank)."""
    dims = [d for a, d in layout if a == "tp"]
    return {"tp": S(dims[0])} if dims else {"tp": I}


def megatron_mlp(mesh, typed: bool):
    """Loss, local parameters, layouts and the reference of program (a)."""
    full = _full_tensors(1, (BATCH,))
    x, params = _local_leaves(full, MLP_TP_LAYOUT, mesh)
    with _checking(typed):
        for k, p in params.items():
            spmd.assert_type(p, {"dp": I, **_tp_types(MLP_TP_LAYOUT[k])})
        spmd.assert_type(x, {"dp": S(0), "tp": I})
        # I on dp, R where used: convert's backward all-reduces each gradient over dp, as DDP would.
        w = {k: spmd.convert(p, "dp", src=I, dst=R) for k, p in params.items()}
        loss = _global_mean_loss(_tp_mlp(x, w), BATCH, "dp")
        loss.backward()
    ref = _reference(lambda xx, ww: _mlp_reference(xx, ww).pow(2).sum() / BATCH, full)
    return loss, {"x": x, **params}, MLP_TP_LAYOUT, ref


# ---------------------------------------------------------------------------
# (b) sequence parallel: [seq, batch, hidden] sharded on seq over tp, batch over dp


SP_LAYOUT = {
    "x": [("dp", 1), ("tp", 0)], "w1": [("tp", 0)], "b1": [("tp", 0)], "w2": [("tp", 1)], "b2": [], "ln_w": [], "ln_b": [],
}
SP_BATCH = 4


def _sp_block(x: torch.Tensor, w: dict) -> torch.Tensor:
    """LayerNorm -> all_gather -> column/row-parallel MLP -> reduce_scatter, plus the residual; S(0) on tp."""
    ln_w, ln_b, b2 = (spmd.convert(w[k], "tp", src=I, dst=R) for k in ("ln_w", "ln_b", "b2"))
    h = F.layer_norm(x, (HIDDEN,), ln_w, ln_b)  # per token, on this rank's tokens
    h = spmd.all_gather(h, "tp", src=S(0), dst=R)  # every token: backward reduce-scatters
    z = F.linear(F.gelu(F.linear(h, w["w1"], w["b1"])), w["w2"])
    z = spmd.reinterpret(z, "tp", src=V, dst=P)
    z = spmd.reduce_scatter(z, "tp", src=P, dst=S(0))  # summed, and back to this rank's tokens
    return x + z + b2


def _sp_reference(x: torch.Tensor, w: dict) -> torch.Tensor:
    h = F.layer_norm(x, (HIDDEN,), w["ln_w"], w["ln_b"])
    return x + _mlp_reference(h, w)


def sequence_parallel(mesh, typed: bool):
    """Loss, local parameters, layouts and the reference of program (b)."""
    full = _full_tensors(2, (SEQ, SP_BATCH), layer_norm=True)
    x, params = _local_leaves(full, SP_LAYOUT, mesh)
    count = SEQ * SP_BATCH
    with _checking(typed):
        for k, p in params.items():
            spmd.assert_type(p, {"dp": I, **_tp_types(SP_LAYOUT[k])})
        spmd.assert_type(x, {"dp": S(1), "tp": S(0)})
        w = {k: spmd.convert(p, "dp", src=I, dst=R) for k, p in params.items()}
        loss = _global_mean_loss(_sp_block(x, w), count, ("dp", "tp"))
        loss.backward()
    ref = _reference(lambda xx, ww: _sp_reference(xx, ww).pow(2).sum() / count, full)
    return loss, {"x": x, **params}, SP_LAYOUT, ref


# ---------------------------------------------------------------------------
# (c) FSDP on dp x tensor parallel on tp


FSDP_LAYOUT = {k: v if k == "x" else v + [("dp", 0)] for k, v in MLP_TP_LAYOUT.items()}


def fsdp_tp(mesh, typed: bool):
    """Loss, local parameters, layouts and the reference of program (c)."""
    full = _full_tensors(3, (BATCH,))
    x, params = _local_leaves(full, FSDP_LAYOUT, mesh)
    with _checking(typed):
        for k, p in params.items():
            spmd.assert_type(p, {"dp": S(0), **_tp_types(MLP_TP_LAYOUT[k])})
        spmd.assert_type(x, {"dp": S(0), "tp": I})
        # Gather each dp shard just in time; backward reduce-scatters the gradient into dp shards.
        w = {k: spmd.all_gather(p, "dp", src=S(0), dst=R) for k, p in params.items()}
        loss = _global_mean_loss(_tp_mlp(x, w), BATCH, "dp")
        loss.backward()
    ref = _reference(lambda xx, ww: _mlp_reference(xx, ww).pow(2).sum() / BATCH, full)
    return loss, {"x": x, **params}, FSDP_LAYOUT, ref


# ---------------------------------------------------------------------------
# running and checking one program


def _check_types(params: dict, typed: bool) -> None:
    """Typed: each gradient has its parameter's backward type (I -> I, S(d) -> S(d)); erased: nothing is typed."""
    for k, p in params.items():
        want = {a: spmd.backward_type(t) for a, t in spmd.get_type(p).items()} if typed else None
        if spmd.get_type(p.grad) != want:
            raise AssertionError(f"grad of {k}: type {spmd.get_type(p.grad)}, expected {want}")


def run_program(name: str, typed: bool, mesh) -> list[str]:
    """Run one program and compare with the reference; returns what was checked, raises on a mismatch."""
    with spmd.set_current_mesh(mesh):
        loss, params, layouts, (ref_loss, ref_grads) = globals()[name](mesh, typed)
        missing = [k for k, p in params.items() if p.grad is None]
        if missing:
            raise AssertionError(f"no gradient for {missing}")
        _check_types(params, typed)
    # Reassemble every gradient on every rank first (collectives), then compare (no collectives),
    # so a mismatch on one rank cannot leave the others waiting in an all_gather.
    grads = {k: _unshard(_plain(p.grad), layouts[k], mesh) for k, p in params.items()}
    torch.testing.assert_close(_plain(loss), ref_loss, **TOL, msg=lambda m: f"loss: {m}")
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k], **TOL, msg=lambda m, k=k: f"grad of {k}: {m}")
    return ["loss"] + sorted(grads)


def _agree(failed: bool) -> bool:
    """True unless some ranks failed and others did not (their collectives may then be out of step)."""
    flag = torch.tensor([float(failed)])
    dist.all_reduce(flag)
    return flag.item() in (0.0, float(WORLD))


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One rank of the dp=2 x tp=2 mesh: run every program typed and erased, a JSON line per result."""
    _run_worker(rank, init_method, out_dir, (2, 2), ("dp", "tp"), PROGRAMS, run_program)


def _run_worker(rank: int, init_method: str, out_dir: str, shape: tuple, names: tuple, programs, runner) -> None:
    """Run ``programs`` typed and erased on a mesh of ``shape``, appending a JSON line per result to rank<r>.jsonl."""
    torch.set_num_threads(1)  # 4 processes on 2 cores
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    with open(path, "w") as out:
        def record(**row) -> None:
            out.write(json.dumps(row) + "\n")
            out.flush()

        try:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                                    timeout=datetime.timedelta(seconds=60))
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            for name in programs:
                for mode in MODES:
                    start, error, checked = time.perf_counter(), None, []
                    try:
                        checked = runner(name, mode == "typed", mesh)
                    except Exception:
                        error = traceback.format_exc()
                    record(key=f"{name}-{mode}", error=error, checked=checked, seconds=time.perf_counter() - start)
                    if not _agree(error is not None):
                        record(key="__worker__", error=f"ranks disagree after {name}-{mode}; stopped", checked=[])
                        return
            dist.barrier()  # every rank done before gloo is torn down
            dist.destroy_process_group()
        except Exception:
            record(key="__worker__", error=traceback.format_exc(), checked=[], seconds=0.0)


# ---------------------------------------------------------------------------
# Data parallel three ways (issue 9): a dp=4 mesh, two SGD steps each, against one device.
#
# * ``dp_allreduce``: parameters R on dp; after backward each gradient (P) is all-reduced to R.
# * ``dp_zero``: parameters R on dp; each gradient is reduce-scattered to a dp shard (S(0)), the
#   shard is updated, and the updated shards are all-gathered back into the parameter (ZeRO-2).
# * ``dp_ddp``: torch DistributedDataParallel with ``spmd.register_ddp``: gradients come out R.
#   Then a backward under ``no_sync()`` leaves P gradients, and a step using them is rejected.
# * ``dp_fsdp``: every parameter a dp shard (S(0)), gathered to R for the forward; backward
#   reduce-scatters each gradient into its shard.
#
# The loss is averaged over dp with ``all_reduce(..., op="avg")`` (DDP: the hook averages).

DP_PROGRAMS = ("dp_allreduce", "dp_zero", "dp_ddp", "dp_fsdp")
DP_STEPS, DP_LR, DP_BATCH = 2, 0.1, 8


def _dp_model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN), torch.nn.Tanh(), torch.nn.Linear(FFN, HIDDEN))


def _dp_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return [torch.randn(DP_BATCH, HIDDEN, generator=g) for _ in range(DP_STEPS)]


def _dp_reference() -> dict:
    """Losses, gradients per step and final parameters of plain SGD on one device with the full batch."""
    model = _dp_model()
    out: dict = {"losses": [], "grads": [], "params": {}}
    for x in _dp_batches():
        loss = model(x).pow(2).mean()
        loss.backward()
        out["losses"].append(loss.detach())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= DP_LR * p.grad
                p.grad = None
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _dp_local_batch(x: torch.Tensor, mesh, typed: bool) -> torch.Tensor:
    x = _shard(x, [("dp", 0)], mesh)
    return spmd.assert_type(x, {"dp": S(0)}) if typed else x


def _expect_types(grads: dict, want: dict | None) -> None:
    for n, g in grads.items():
        if spmd.get_type(g) != want:
            raise AssertionError(f"grad of {n}: type {spmd.get_type(g)}, expected {want}")


def _dp_record(out: dict, loss: torch.Tensor, grads: dict, layout: Layout, mesh) -> None:
    out["losses"].append(_plain(loss))
    out["grads"].append({n: _unshard(_plain(g), layout, mesh) for n, g in grads.items()})


def dp_allreduce(mesh, typed: bool) -> dict:
    """(a) Parameters R on dp; ``p.grad = all_reduce(p.grad, src=P, dst=R)`` after backward."""
    model, out = _dp_model(), {"losses": [], "grads": []}
    with _checking(typed):
        spmd.assert_type(model, {"dp": R})
        opt = torch.optim.SGD(model.parameters(), lr=DP_LR)
        for x in _dp_batches():
            x = _dp_local_batch(x, mesh, typed)
            loss = spmd.all_reduce(model(x).pow(2).mean(), "dp", src=V, dst=I, op="avg")
            loss.backward()
            for p in model.parameters():
                p.grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R)
            grads = {n: p.grad for n, p in model.named_parameters()}
            _expect_types(grads, {"dp": R} if typed else None)
            _dp_record(out, loss, grads, [], mesh)
            opt.step()
            opt.zero_grad()
    out["params"] = {n: _plain(p) for n, p in model.named_parameters()}
    return out


def dp_zero(mesh, typed: bool) -> dict:
    """(a, ZeRO) Parameters R on dp; gradients reduce-scattered to S(0), shards updated, then all-gathered."""
    model, out = _dp_model(), {"losses": [], "grads": []}
    with _checking(typed):
        spmd.assert_type(model, {"dp": R})
        for x in _dp_batches():
            x = _dp_local_batch(x, mesh, typed)
            loss = spmd.all_reduce(model(x).pow(2).mean(), "dp", src=V, dst=I, op="avg")
            loss.backward()
            grads = {n: spmd.reduce_scatter(p.grad, "dp", src=P, dst=S(0)) for n, p in model.named_parameters()}
            _expect_types(grads, {"dp": S(0)} if typed else None)
            _dp_record(out, loss, grads, [("dp", 0)], mesh)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    shard = spmd.convert(p, "dp", src=R, dst=S(0)) - DP_LR * grads[n]  # this rank's rows only
                    p.copy_(spmd.all_gather(shard, "dp", src=S(0), dst=R))
                    p.grad = None
    out["params"] = {n: _plain(p) for n, p in model.named_parameters()}
    return out


def _dp_no_sync_is_caught(ddp, model, opt, x: torch.Tensor) -> None:
    """A backward under no_sync() leaves P gradients (no hook ran); a step that uses them is rejected."""
    with ddp.no_sync():
        ddp(x).pow(2).mean().backward()
    _expect_types({n: p.grad for n, p in model.named_parameters()}, {"dp": P})
    def by_hand() -> None:
        p = next(model.parameters())
        with torch.no_grad():
            p -= DP_LR * p.grad

    for step, text in ((by_hand, "A pending sum (P) can only be added to another pending sum"),
                       (opt.step, "The gradient of parameter '0.weight' f32[16,8] is a pending sum (P) on 'dp'")):
        try:
            step()
        except spmd.SpmdTypeError as err:
            if text not in str(err):
                raise
        else:
            raise AssertionError(f"{step.__name__}: a step with the unsynced (P) gradient was accepted")
    for q in model.parameters():
        q.grad = None


def dp_ddp(mesh, typed: bool) -> dict:
    """(b) DistributedDataParallel with spmd.register_ddp: the hook averages and types the gradients R."""
    from torch.nn.parallel import DistributedDataParallel

    model, out = _dp_model(), {"losses": [], "grads": []}
    with _checking(typed):
        spmd.assert_type(model, {"dp": R})
        ddp = spmd.register_ddp(DistributedDataParallel(model, process_group=mesh.get_group("dp")), "dp")
        opt = torch.optim.SGD(model.parameters(), lr=DP_LR)
        for x in _dp_batches():
            x = _dp_local_batch(x, mesh, typed)
            local = ddp(x).pow(2).mean()  # this rank's loss: V on dp
            local.backward()  # the hook all-reduces (avg): the gradient of the dp-averaged loss
            loss = spmd.all_reduce(local.detach(), "dp", src=V, dst=I, op="avg")
            grads = {n: p.grad for n, p in model.named_parameters()}
            _expect_types(grads, {"dp": R} if typed else None)
            _dp_record(out, loss, grads, [], mesh)
            opt.step()
            opt.zero_grad()
        if typed:
            _dp_no_sync_is_caught(ddp, model, opt, x)
    out["params"] = {n: _plain(p) for n, p in model.named_parameters()}
    return out


def dp_fsdp(mesh, typed: bool) -> dict:
    """(c) Parameters are dp shards S(0), all-gathered to R for the forward; backward reduce-scatters."""
    model, out = _dp_model(), {"losses": [], "grads": []}
    shards = {n: torch.nn.Parameter(_shard(p.detach(), [("dp", 0)], mesh)) for n, p in model.named_parameters()}
    with _checking(typed):
        for s in shards.values():
            spmd.assert_type(s, {"dp": S(0)})
        opt = torch.optim.SGD(shards.values(), lr=DP_LR)
        for x in _dp_batches():
            x = _dp_local_batch(x, mesh, typed)
            full = {n: spmd.all_gather(s, "dp", src=S(0), dst=R) for n, s in shards.items()}
            y = torch.func.functional_call(model, full, (x,))
            loss = spmd.all_reduce(y.pow(2).mean(), "dp", src=V, dst=I, op="avg")
            loss.backward()
            grads = {n: s.grad for n, s in shards.items()}
            _expect_types(grads, {"dp": S(0)} if typed else None)
            _dp_record(out, loss, grads, [("dp", 0)], mesh)
            opt.step()
            opt.zero_grad()
    out["params"] = {n: _unshard(_plain(s), [("dp", 0)], mesh) for n, s in shards.items()}
    return out


def run_dp_program(name: str, typed: bool, mesh) -> list[str]:
    """Run one data-parallel recipe and compare losses, gradients and final parameters with one device."""
    with spmd.set_current_mesh(mesh):
        got = globals()[name](mesh, typed)
    ref = _dp_reference()
    for step, (loss, ref_loss) in enumerate(zip(got["losses"], ref["losses"])):
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m, s=step: f"loss, step {s}: {m}")
    for step, (grads, ref_grads) in enumerate(zip(got["grads"], ref["grads"])):
        for k, g in grads.items():
            torch.testing.assert_close(g, ref_grads[k], **TOL, msg=lambda m, k=k, s=step: f"grad {k}, step {s}: {m}")
    for k, p in got["params"].items():
        torch.testing.assert_close(p, ref["params"][k], **TOL, msg=lambda m, k=k: f"param {k}: {m}")
    if len(got["losses"]) != DP_STEPS or len(got["grads"]) != DP_STEPS:
        raise AssertionError(f"ran {len(got['losses'])} steps, expected {DP_STEPS}")
    return ["loss", "grads", "params"]


def dp_worker(rank: int, init_method: str, out_dir: str) -> None:
    """One rank of a dp=4 mesh: every data-parallel recipe typed and erased, a JSON line per result."""
    _run_worker(rank, init_method, out_dir, (WORLD,), ("dp",), DP_PROGRAMS, run_dp_program)
