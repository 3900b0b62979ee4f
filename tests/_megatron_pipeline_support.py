"""Helpers for tests/test_megatron_pipeline.py: a 2-stage Megatron-core GPTModel on CPU, run by Megatron's own schedule.

Each stage is a GPTModel with ``pre_process`` / ``post_process`` set by its
pipeline rank (the local layer spec, as tests/_megatron_support.py builds dense
models). Megatron's non-interleaved 1F1B schedule
(``forward_backward_pipelining_without_interleaving``) runs on CPU with one
more accommodation than the dense model needs: the schedule counts tokens in
``torch.zeros([], device="cuda")``, so ``torch.zeros`` answers a CUDA device
with the CPU (``accommodate_schedule``); and ``batch_p2p_sync=False`` in the
config (its ``torch.cuda.synchronize`` guards an old NCCL race). A tied word
embedding at pp > 1 also needs ``Tensor.cuda`` to stay on the CPU
(``accommodate_tied_embedding``: Megatron moves the weight to the GPU before
the all-reduce that makes the two copies equal).

The gloo worker (``worker``) runs the 2-stage model at pp=2 x tp=2 on 4
processes, with and without sequence parallel, untyped (Megatron's own
communicator) and typed (``spmd_megatron.p2p_communicator``), and writes what it
saw to a JSON-lines file per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from _megatron_support import (
    SEQ,
    accommodate_cpu,
    build_gpt,
    gloo_worker,
    init_parallel,
    make_batch,
    plain,
    record_jobs,
    typed_inputs,
)

import spmd_types as spmd

PP, TP = 2, 2
MICRO_BATCHES = 2
BATCH = 2
GLOO_WORLD = 4
GLOO_CONFIGS = (False, True)  # sequence parallel, at pp=2 x tp=2


def accommodate_schedule(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``torch.zeros(..., device="cuda")`` (the schedule's token counter) made on the CPU."""
    zeros = torch.zeros

    def cpu_zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    setattr_(torch, "zeros", cpu_zeros)


def accommodate_tied_embedding(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``Tensor.cuda()`` stays on the CPU (Megatron moves the tied embedding there before its first all-reduce)."""
    setattr_(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


def pipeline_overrides(pp: int = PP) -> dict[str, Any]:
    return dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, batch_p2p_sync=False)


def build_stage(tp: int = TP, sp: bool = False, pp: int = PP, **model_kwargs: Any):
    """This rank's stage of a 2-layer GPTModel: pre_process on the first stage, post_process on the last."""
    from megatron.core import parallel_state as ps

    kwargs = {"pre_process": ps.is_pipeline_first_stage(), "post_process": ps.is_pipeline_last_stage(), **model_kwargs}
    return build_gpt(tp, sp, model_kwargs=kwargs, **pipeline_overrides(pp))


def activation_types(sp: bool) -> dict:
    """Megatron's hidden states between stages: I on tp, or the sequence shard S(0) under sequence parallel."""
    return {"dp": spmd.V, "tp": spmd.S(0) if sp else spmd.I}


def micro_batches(dp_rank: int = 0) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of one step: every stage reads the same ones (tokens on the first, labels on the last)."""
    return [make_batch(1000 + 10 * dp_rank + i) for i in range(MICRO_BATCHES)]


def loss_func(output: torch.Tensor):
    """Megatron's 2-tuple loss: (the loss to differentiate, what is reported)."""
    loss = output.sum()
    return loss, {"loss": loss.detach()}


def forward_step(seen: dict | None = None, typed: bool = False) -> Callable:
    """Megatron's forward_step_func: one micro-batch through this stage; ``seen`` records the input's type."""

    def step(data_iterator, model):
        batch = next(data_iterator)
        if typed:
            batch = typed_inputs(batch)
        if seen is not None:
            inner = getattr(model, "module", model)
            seen.setdefault("input", []).append(spmd.get_type(inner.decoder.input_tensor)
                                                if inner.decoder.input_tensor is not None else None)
        return model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"]), loss_func

    return step


def groups():
    """The process groups Megatron's schedule needs when it is given a communicator."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(["tp", "cp", "pp", "embd", "pos_embd", "dp_cp"])


def run_schedule(model, comm=None, step=None, batches=None, forward_only: bool = False):
    """Megatron's non-interleaved 1F1B schedule over this rank's stage; returns the reported losses."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    kwargs = {} if comm is None else {"p2p_communicator": comm, "pg_collection": groups()}
    return forward_backward_pipelining_without_interleaving(
        forward_step_func=step or forward_step(), data_iterator=iter(batches or micro_batches()), model=model,
        num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=BATCH, forward_only=forward_only, **kwargs)


def typed_schedule(model, sp: bool, seen: dict | None = None, types=None, mesh=None, batches=None):
    """run_schedule inside typecheck with the typed communicator, the parameters typed; returns (losses, comm)."""
    from spmd_types import megatron as spmd_megatron

    spmd_megatron.register()
    comm = spmd_megatron.p2p_communicator(model.config, types or spmd_megatron.PipelineTypes(activation_types(sp)))
    with spmd.set_current_mesh(mesh or spmd_megatron.mesh()), spmd.typecheck():
        spmd_megatron.type_parameters(model)
        with comm.iteration():
            losses = run_schedule(model, comm, forward_step(seen, typed=True), batches)
    return losses, comm


# ---------------------------------------------------------------------------
# the gloo worker


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: plain(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _losses(store: list) -> list[torch.Tensor]:
    return [plain(d["loss"]) for d in store]


def run_pipeline(sp: bool) -> dict[str, Any]:
    """One configuration: the 2-stage GPTModel untyped and typed, by Megatron's schedule, on this rank's stage."""
    from megatron.core import parallel_state as ps

    init_parallel(TP, **{"pipeline_model_parallel_size": PP})
    model = build_stage(TP, sp)
    losses_u = _losses(run_schedule(model))
    grads_u = _grads(model)
    model.zero_grad(set_to_none=True)
    seen: dict = {}
    store, comm = typed_schedule(model, sp, seen)
    losses_t, grads_t = _losses(store), _grads(model)
    assert grads_t.keys() == grads_u.keys(), (sorted(grads_t), sorted(grads_u))
    return {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "n_losses": len(losses_t),
        "loss_typed_vs_untyped": max((float((a - b).abs().max()) for a, b in zip(losses_t, losses_u)), default=0.0),
        "losses_equal": len(losses_t) == len(losses_u) and all(torch.equal(a, b) for a, b in zip(losses_t, losses_u)),
        "grads_equal": all(torch.equal(grads_t[n], grads_u[n]) for n in grads_u),
        "grad_typed_vs_untyped": max(float((grads_t[n] - grads_u[n]).abs().max()) for n in grads_u),
        "n_params": len(grads_t),
        "grad_types": sorted({str(spmd.get_type(p.grad)) for p in model.parameters()}),
        "input_types": [str(t) for t in seen.get("input", [])],
        "loss_nonzero": all(float(v.abs()) > 0 for v in losses_t),
        "grads_nonzero": sum(1 for g in grads_t.values() if float(g.abs().sum()) > 0),  # the gradients crossed
        "awaiting": len(comm._awaiting),
    }


def run_disagreeing_declarations(sp: bool) -> dict[str, Any]:
    """Stage 1 declares another activation type than stage 0: making the communicator fails on both."""
    from megatron.core import parallel_state as ps

    from spmd_types import megatron as spmd_megatron

    init_parallel(TP, **{"pipeline_model_parallel_size": PP})
    stage = ps.get_pipeline_model_parallel_rank()
    types = spmd_megatron.PipelineTypes({"dp": spmd.V, "tp": spmd.I if stage == 0 else spmd.S(0)})
    config = build_stage(TP, sp).config
    try:
        spmd_megatron.p2p_communicator(config, types)
    except spmd.SpmdTypeError as err:
        return {"rule": err.rule, "seen": [list(s) for s in err.seen], "fixes": list(err.fixes)}
    return {"rule": None}


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One gloo rank: every configuration, one JSON line each (or the error)."""
    jobs = [(f"pp{PP}_tp{TP}_sp{int(sp)}", lambda sp=sp: run_pipeline(sp)) for sp in GLOO_CONFIGS]
    jobs.append(("disagree", lambda: run_disagreeing_declarations(False)))
    with gloo_worker(rank, init_method, GLOO_WORLD, accommodate_cpu, accommodate_schedule):
        record_jobs(Path(out_dir) / f"rank{rank}.jsonl", jobs)
