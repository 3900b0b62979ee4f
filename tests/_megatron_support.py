"""Helpers for tests/test_megatron_core.py: a small Megatron-core GPTModel on CPU, typed and untyped.

The two CPU accommodations (Megatron-core is written for CUDA) are applied by
``accommodate_cpu(setattr)`` with the caller's patcher (pytest's
``monkeypatch.setattr`` in tests, a restoring patcher in the gloo workers):
``torch.cuda.current_device`` answers ``"cpu"`` (Megatron allocates its
communication buffers with ``device=torch.cuda.current_device()``), and the
CUDA RNG tracker's ``fork`` is a null context (dropout is 0 here). Megatron
itself is never edited.

The gloo worker (``worker``) builds GPTModel at tp=2 and tp=4, with and without
sequence parallel, runs one forward+backward untyped and typed, reassembles the
shards, and runs the same weights and batch on a tp=1 GPTModel; each rank
writes the largest differences it saw to a JSON-lines file.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

import spmd_types as spmd

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 32, 16, 4, 2, 8, 2
WORLD = 4
CONFIGS = ((2, False), (2, True), (4, False), (4, True))  # (tp, sequence_parallel) on 4 ranks
DDP_CONFIGS = ((2, True),)  # the training loop: Megatron's DDP at tp=2, dp=2, sequence parallel


def _null_fork(self, name: str = "") -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def accommodate_cpu(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The two CPU accommodations, applied with ``setattr_`` (e.g. ``monkeypatch.setattr``)."""
    from megatron.core.tensor_parallel import random as mrandom

    setattr_(torch.cuda, "current_device", lambda: "cpu")
    setattr_(mrandom.CudaRNGStatesTracker, "fork", _null_fork)


class Patcher:
    """``setattr`` that remembers and restores (monkeypatch for code outside pytest)."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def __call__(self, obj: Any, name: str, value: Any, raising: bool = True) -> None:
        self.saved.append((obj, name, getattr(obj, name) if raising else getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        self.saved.clear()


_MISSING = object()


def init_parallel(tp: int, **kwargs: Any) -> None:
    """(Re)initialize Megatron's parallel state on the current default process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False, **kwargs)


def sp_layer_norm_class():
    """A LayerNorm usable under sequence parallel (marks its parameters as Megatron's FusedLayerNorm does).

    Megatron's local spec uses torch's LayerNorm through WrappedTorchNorm, which
    refuses sequence parallel; FusedLayerNorm needs Apex. This is the user-side
    norm a CPU user would plug into the spec.
    """

    class SPLayerNorm(torch.nn.LayerNorm):
        def __init__(self, config, hidden_size, eps=1e-5, **_):
            super().__init__(hidden_size, eps=eps)
            for p in self.parameters():
                p.sequence_parallel = config.sequence_parallel

    return SPLayerNorm


def gpt_config(tp: int, sp: bool = False, **overrides: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
                hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=sp,
                params_dtype=torch.float32)
    args.update(overrides)
    return TransformerConfig(**args)


def build_gpt(tp: int, sp: bool = False, seed: int = 1234, model_kwargs: dict | None = None, **overrides: Any):
    """GPTModel with the local layer spec (and a sequence-parallel LayerNorm when ``sp``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    torch.manual_seed(seed)
    config = gpt_config(tp, sp, **overrides)
    spec = get_gpt_layer_local_spec()
    if sp:
        norm = sp_layer_norm_class()
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                        **(model_kwargs or {}))


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return {"tokens": tokens, "positions": positions, "labels": labels, "mask": mask}


def typed_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch typed: a different micro-batch per dp rank, the same on every tp rank (I).

    Integer ids carry no gradient, so I meets the vocab-sharded embedding and
    loss as soundly as it meets the replicated position embedding.
    """
    ids = {"dp": spmd.V, "tp": spmd.I}
    return {
        "tokens": spmd.assert_type(batch["tokens"], ids),
        "positions": spmd.assert_type(batch["positions"], ids),
        "labels": spmd.assert_type(batch["labels"], ids),
        "mask": batch["mask"],
    }


def forward_backward(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward and backward of the per-token loss's sum; returns the loss (per token)."""
    loss = model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"])
    loss.sum().backward()
    return loss


def typed_step(model, batch: dict[str, torch.Tensor], mesh: dict) -> torch.Tensor:
    """forward_backward inside typecheck, with the adapter's three calls."""
    from spmd_types import megatron as spmd_megatron

    spmd_megatron.register()
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd_megatron.type_parameters(model)
        return forward_backward(model, typed_inputs(batch))


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain detached copy (an LTensor's data as a torch.Tensor)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor(t.detach().clone()) if type(t) is not torch.Tensor else t.detach().clone()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: plain(p.grad) for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------
# the gloo worker


def _gather_full(model, grads_: dict[str, torch.Tensor], synced: bool = False) -> tuple[dict, dict, float]:
    """Reassemble every parameter and its gradient over tp; the largest spread of an I gradient over tp."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    full_w, full_g, spread = {}, {}, 0.0
    for name, p in model.named_parameters():
        w, g = plain(p), grads_[name]
        if getattr(p, "tensor_model_parallel", False):
            d = p.partition_dim
            ws, gs = [torch.empty_like(w) for _ in range(tp)], [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(ws, w.contiguous(), group=group)
            dist.all_gather(gs, g.contiguous(), group=group)
            full_w[name], full_g[name] = torch.cat(ws, d), torch.cat(gs, d)
        elif getattr(p, "sequence_parallel", False) and not synced:  # R on tp: each rank holds a share
            total = g.clone()
            dist.all_reduce(total, group=group)
            full_w[name], full_g[name] = w, total
        else:  # I on tp: every rank must hold the same gradient
            gs = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(gs, g.contiguous(), group=group)
            spread = max(spread, max(float((x - g).abs().max()) for x in gs))
            full_w[name], full_g[name] = w, g
    return full_w, full_g, spread


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run_config(tp: int, sp: bool) -> dict[str, Any]:
    """One (tp, sp) configuration on the current gloo world: typed vs untyped vs tp=1."""
    from megatron.core import parallel_state as ps

    from spmd_types import megatron as spmd_megatron

    init_parallel(tp)
    batch = make_batch(100 + ps.get_data_parallel_rank())
    model = build_gpt(tp, sp)
    loss_u = plain(forward_backward(model, batch))
    grads_u = grads(model)
    model.zero_grad(set_to_none=True)
    loss_t_typed = typed_step(model, batch, spmd_megatron.mesh())
    loss_t, grads_t = plain(loss_t_typed), grads(model)
    full_w, full_g, spread = _gather_full(model, grads_t)
    init_parallel(1)
    ref = build_gpt(1, False)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full_w[name])
    loss_r = plain(forward_backward(ref, batch))
    return {
        "key": f"tp{tp}_sp{int(sp)}",
        "loss_typed_vs_untyped": float((loss_t - loss_u).abs().max()),
        "grad_typed_vs_untyped": _max_diff(grads_t, grads_u),
        "loss_vs_tp1": float((loss_t - loss_r).abs().max()),
        "grad_vs_tp1": _max_diff(full_g, grads(ref)),
        "invariant_grad_spread": spread,
        "loss_type": str(spmd.get_type(loss_t_typed)),
        "n_params": len(grads_t),
    }


def run_ddp(tp: int, sp: bool) -> dict[str, Any]:
    """Megatron's DDP + finalize_model_grads, typed and tracked; the synced gradients vs a tp=1 model's average."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


    init_parallel(tp)
    dp = ps.get_data_parallel_world_size()
    model = build_gpt(tp, sp)
    ddp = DistributedDataParallel(gpt_config(tp, sp), DistributedDataParallelConfig(), model)
    tracker = tracked_ddp_step(ddp)
    synced = {n: plain(p.main_grad) for n, p in model.named_parameters()}
    full_w, full_g, spread = _gather_full(model, synced, synced=True)
    init_parallel(1)
    ref = build_gpt(1, False)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full_w[name])
    for i in range(dp):  # the data-parallel gradient is the average over the dp ranks' micro-batches
        forward_backward(ref, make_batch(100 + i))
    want = {n: g / dp for n, g in grads(ref).items()}
    return {"key": f"ddp_tp{tp}_sp{int(sp)}", "grad_vs_tp1": _max_diff(full_g, want),
            "unsynced": tracker.unsynced(), "invariant_grad_spread": spread}


def tracked_ddp_step(ddp) -> Any:
    """Megatron's DDP training step, typed: type the parameters, track the gradient buffers, one typed
    forward+backward of this dp rank's micro-batch, then ``finalize_model_grads`` inside the tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from spmd_types import megatron as spmd_megatron

    with spmd.set_current_mesh(spmd_megatron.mesh()):
        with spmd.typecheck():
            spmd_megatron.type_parameters(ddp)
        tracker = spmd_megatron.track_grad_sync(ddp)
        with spmd.typecheck():
            forward_backward(ddp, typed_inputs(make_batch(100 + ps.get_data_parallel_rank())))
        with tracker:
            finalize_model_grads([ddp])
    return tracker


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One gloo rank: every configuration in CONFIGS and DDP_CONFIGS; one JSON line each (or the error)."""
    jobs = [(f"tp{tp}_sp{int(sp)}", lambda tp=tp, sp=sp: run_config(tp, sp)) for tp, sp in CONFIGS]
    jobs += [(f"ddp_tp{tp}_sp{int(sp)}", lambda tp=tp, sp=sp: run_ddp(tp, sp)) for tp, sp in DDP_CONFIGS]
    with gloo_worker(rank, init_method, WORLD, accommodate_cpu):
        record_jobs(Path(out_dir) / f"rank{rank}.jsonl", jobs)


# ---------------------------------------------------------------------------
# gloo workers: one world of forked processes, one JSON line per job and rank


@contextlib.contextmanager
def gloo_worker(rank: int, init_method: str, world: int, *accommodations: Callable[[Any], None]):
    """A forked worker's gloo world: the accommodations applied, the parent's (fake) groups dropped; torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    patch = Patcher()
    for accommodate in accommodations:
        accommodate(patch)
    ps.destroy_model_parallel()  # a forked worker inherits the parent's (fake) process groups
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.barrier()  # every rank done before gloo is torn down
        dist.destroy_process_group()
        patch.undo()


def record_jobs(path: Path, jobs: list[tuple[str, Callable[[], dict]]]) -> None:
    """Run each job; append ``{"key": ..., **its row, "seconds": ...}`` (or the error) to ``path``."""
    for key, run in jobs:
        start = time.perf_counter()
        try:
            row = {"key": key, **run()}
            row["seconds"] = round(time.perf_counter() - start, 2)
        except Exception as err:  # recorded, so the test shows which configuration failed and why
            row = {"key": key, "error": f"{type(err).__name__}: {err}"}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def launch_gloo(worker: Callable[..., None], world: int, out: Path, timeout: float = 240) -> dict:
    """``worker(rank, init_method, out_dir)`` on ``world`` forked processes; ``{(rank, key): row}``.

    Fork, not spawn: a spawned worker re-imports megatron.core (about 50 s for 4 workers on 2 busy cores);
    a forked one inherits it, drops the parent's fake process group and joins a gloo world (about 6 s).
    """
    import pytest
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    if not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    ctx = mp.start_processes(worker, args=("file://" + str(out / "store"), str(out)), nprocs=world, join=False,
                             start_method="fork")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                pytest.fail(f"the gloo workers did not finish within {timeout:.0f} s")
    except ProcessException as err:
        pytest.fail(f"a gloo worker failed: {err}")
    rows = {}
    for rank in range(world):
        for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows[(rank, row["key"])] = row
    return rows


# ---------------------------------------------------------------------------
# fake process group (types only)


def fake_gpt(tp: int, dp: int, sp: bool = False, **overrides: Any):
    """GPTModel on a fake process group of tp*dp ranks (this process is rank 0): (model, mesh, batch)."""
    from conftest import fake_world
    from megatron.core import parallel_state as ps

    from spmd_types import megatron as spmd_megatron

    ps.destroy_model_parallel()
    fake_world(tp * dp)
    init_parallel(tp)
    spmd_megatron.register()
    return build_gpt(tp, sp, **overrides), spmd_megatron.mesh(), make_batch(0)
