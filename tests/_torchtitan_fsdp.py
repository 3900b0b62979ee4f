"""torchtitan 0.3.0 as its users run it on torch 2.14: FSDP applied, under the layouts torchtitan typechecks.

The matrix (:data:`MATRIX`): every decoder model of ``_torchtitan_models`` under
FSDP + TP (dp_shard=4 x tp=2), HSDP (dp_replicate=2 x dp_shard=2 x tp=2),
CP=2 with FSDP and TP (dp_shard=2 x cp=2 x tp=2, torchtitan's own CP test
layout) and, for the MoE models, EP=2 (dp_shard=4 x tp=2 x ep=2), each on 8
ranks, with sequence parallelism (torchtitan's default) wherever TP is on; a
model whose own annotations refuse TP runs them without it (:data:`WITHOUT_TP`).
``fully_shard(..., dp_mesh_dims=)`` is torchtitan's own call, reading our
types. On a fake process group a case typechecks (rank 0's program); on gloo
(:func:`worker`, several cases per launch) it also gives loss and gradients,
with checking on and off, for the test to compare with each other and with the
same model on one device.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import _torchtitan_support as tt
import torch
from _torchtitan_models import DECODERS, MOE

# name -> Case fields (the model is filled in per case)
LAYOUTS = {
    "fsdp4 x tp2": {"world": 8, "tp": 2},
    "hsdp2x2 x tp2": {"world": 8, "tp": 2, "dp_replicate": 2},
    "fsdp2 x cp2 x tp2": {"world": 8, "tp": 2, "cp": 2},
    "fsdp4 x tp2 x ep2": {"world": 8, "tp": 2, "ep": 2},
}
# torchtitan itself refuses these (parallelize_fn raises NotImplementedError before anything runs)
REFUSED = {("kimi_k2_7", "fsdp2 x cp2 x tp2"): "Context Parallel is not yet supported for Kimi K2.5"}
# muse_glimmer's text model asserts its embedding output R on tp (models/muse_glimmer/model.py:525), which it is
# not under TP (sequence-sharded with SP, I without: test_muse_glimmer_text_model_under_tp_fails_its_own_assertion);
# it runs the same layouts with the tp ranks given to dp_shard
WITHOUT_TP = ("muse_glimmer",)
LAYOUTS_WITHOUT_TP = {
    "fsdp8": {"world": 8, "tp": 1},
    "hsdp2x4": {"world": 8, "tp": 1, "dp_replicate": 2},
    "fsdp4 x cp2": {"world": 8, "tp": 1, "cp": 2},
}


def _cases() -> tuple[tt.Case, ...]:
    out = []
    for model in DECODERS:
        for layout, fields in (LAYOUTS_WITHOUT_TP if model in WITHOUT_TP else LAYOUTS).items():
            if fields.get("ep", 1) > 1 and model not in MOE:
                continue
            out.append(tt.Case(f"{model} {layout}", model, **fields))
    return tuple(out)


MATRIX = _cases()


def matrix_case(name: str) -> tt.Case:
    """The matrix case called ``name`` (``"<model> <layout>"``)."""
    for c in MATRIX:
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}; cases: {[c.name for c in MATRIX]}")


def refusal(c: tt.Case) -> str | None:
    """torchtitan's own refusal of case ``c``, if it has one."""
    layout = c.name[len(c.model) + 1:]
    return REFUSED.get((c.model, layout))


# ---------------------------------------------------------------------------
# gloo: every rank a process; several cases per launch (the start-up is the dear part)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The one-device value of an FSDP parameter or gradient (a DTensor on the storage mesh): all ranks call this."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _sum_on_gloo(model: torch.nn.Module) -> None:
    """FSDP reduces with a plain sum (gloo has no ``PREMUL_SUM``, NCCL's op, which FSDP picks for torchtitan's
    gradient divide factor of 1: a sum scaled by 1, the same arithmetic)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _one_run(c: tt.Case, *, checking: bool) -> dict:
    """One trainer step of ``c`` in this gloo worker; what rank 0 keeps of it (every rank takes part)."""
    import torch.distributed as dist
    from torch.distributed.tensor import _random

    with tt.environment("gloo", c.world):
        # DTensor's random initializers draw from a tracker made on first use and advanced since: a new one per
        # run, so the run with checking off starts from the same weights
        _random._rng_tracker = None
        b = tt.build(c, checking=checking, world=c.world)
        _sum_on_gloo(b.model)
        params = dict(b.model.named_parameters())
        weights = {n: _full(p) for n, p in params.items()}
        loss = tt.train_step(b, "gloo", c.dp * tt.LOCAL_BATCH).detach()
        missing = [n for n, p in params.items() if p.requires_grad and p.grad is None and not tt.unused(c, n)]
        if missing:
            raise AssertionError(f"{c.name}: parameters without a gradient: {missing}")
        grads = {n: _full(p.grad) for n, p in params.items() if p.grad is not None}
        losses = [torch.zeros_like(loss) for _ in range(c.world)]
        dist.all_gather(losses, loss.contiguous())
    # the loss is P over dp and cp and I over tp: every tp rank holds its dp/cp rank's share
    return {"weights": weights, "grads": grads, "losses": torch.stack(losses),
            "global_loss": torch.stack(losses).sum() / c.tp}


def worker(rank: int, init_method: str, out_dir: str, names: list[str]) -> None:
    """Run each case in ``names`` with checking on, then off; rank 0 saves ``<index>.pt`` per case."""
    import torch.distributed as dist

    world = matrix_case(names[0]).world
    os.environ.setdefault("SPMD_TYPES_ERRORS", "plain")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    error = None
    try:
        for i, name in enumerate(names):
            c = matrix_case(name)
            typed = _one_run(c, checking=True)
            erased = _one_run(c, checking=False)
            if rank == 0:
                torch.save({"name": name, "typed": typed, "erased": erased}, os.path.join(out_dir, f"{i}.pt"))
    except Exception:  # written down for the test to show, instead of a hung peer
        error = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "error": error}, f)


def launch(names: list[str], out_dir: str) -> list[dict]:
    """Spawn the gloo workers for ``names`` (cases of one world size); returns each case's saved results."""
    import torch.multiprocessing as mp

    world = matrix_case(names[0]).world
    if any(matrix_case(n).world != world for n in names):
        raise ValueError("one launch runs cases of one world size")
    mp.start_processes(worker, args=("file://" + os.path.join(out_dir, "store"), out_dir, names), nprocs=world,
                       start_method="spawn")
    errors = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            row = json.load(f)
        if row["error"]:
            errors.append(f"rank {r}:\n{row['error']}")
    if errors:
        raise AssertionError("\n".join(errors[:2]))
    return [torch.load(os.path.join(out_dir, f"{i}.pt"), weights_only=False) for i in range(len(names))]
