"""Helpers for tests/test_megatron_moe*.py: a small Megatron-core MoE GPTModel on CPU, typed and untyped.

CPU accommodations beyond the dense ones (``accommodate_moe_cpu``), applied with the caller's
patcher, never by editing Megatron: the router's ``te_general_gemm`` is None (no Transformer
Engine: the router multiplies with torch), the alltoall dispatcher's device-to-host stream is a
no-op object, and its split sizes come back as NumPy arrays as they would from a GPU (on the CPU
Megatron leaves them tensors, which ``all_to_all_single`` refuses).

The gloo worker (``worker``) builds the MoE model for every configuration in ``CONFIGS`` on 4
processes, runs one forward+backward untyped and typed, reassembles every weight and gradient
(tp and etp shards, experts by their global index over ep, sums over dp and edp) and runs the
same weights on a one-device model (tp=ep=1) over every dp rank's micro-batch: each rank writes
the largest differences it saw to a JSON-lines file.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from _megatron_support import (
    accommodate_cpu,
    forward_backward,
    gloo_worker,
    grads,
    make_batch,
    plain,
    record_jobs,
    sp_layer_norm_class,
    tracked_ddp_step,
    typed_inputs,
)

import spmd_types as spmd

EXPERTS, TOPK = 4, 2
WORLD = 4
# (dispatcher, tp, ep, etp) on 4 gloo ranks: etp=tp (edp=1) and Megatron's parallel folding etp=1 (edp=2).
# The alltoall dispatcher at etp > 1 all-gathers pieces of different lengths over etp, which gloo cannot
# (NCCL can): it is typechecked on the fake group only.
CONFIGS = (("allgather", 2, 2, 2), ("alltoall", 2, 2, 1), ("allgather", 2, 2, 1))
DDP_CONFIGS = (("alltoall", 2, 2, 1),)


class _HostStream:
    """A CUDA stream that is not there: the alltoall dispatcher's device-to-host copies run inline."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        return None


_STREAM = _HostStream()


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron's maybe_move_tensor_to_cpu on the CPU: split sizes as NumPy arrays, as from a GPU."""
    if as_numpy and torch.is_tensor(tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.numpy(torch.Tensor.detach(tensor))
    return tensor


def accommodate_moe_cpu(setattr_: Callable[..., None]) -> None:
    """The dense CPU accommodations plus the MoE ones, applied with ``setattr_`` (``monkeypatch.setattr``)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    accommodate_cpu(setattr_)
    setattr_(moe_utils, "te_general_gemm", None, raising=False)
    setattr_(torch.cuda, "Stream", lambda *a, **k: _STREAM)
    setattr_(torch.cuda, "current_stream", lambda *a, **k: _STREAM)
    setattr_(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    setattr_(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host)


def init_moe(tp: int, ep: int, etp: int | None = None) -> None:
    """(Re)initialize Megatron's parallel state with expert parallelism on the current default process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp if etp is not None else tp,
                                 create_gloo_process_groups=False)


def moe_config(tp: int, ep: int, etp: int, dispatcher: str, **overrides: Any):
    from _megatron_support import gpt_config

    args = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_token_dispatcher_type=dispatcher,
                moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss", add_bias_linear=False,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    args.update(overrides)
    return gpt_config(tp, tp > 1, **args)


def build_moe(tp: int, ep: int, etp: int, dispatcher: str, seed: int = 1234, **overrides: Any):
    """An MoE GPTModel (local spec, SequentialMLP experts; sequence parallel where tp > 1)."""
    from _megatron_support import SEQ, VOCAB
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    torch.manual_seed(seed)
    config = moe_config(tp, ep, etp, dispatcher, **overrides)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if tp > 1:
        norm = sp_layer_norm_class()
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def fake_moe(tp: int, ep: int, world: int, dispatcher: str, etp: int | None = None, **overrides: Any):
    """The MoE GPTModel on a fake process group of ``world`` ranks (this process is rank 0): (model, batch)."""
    from conftest import fake_world

    from spmd_types import megatron as spmd_megatron

    fake_world(world)
    forget_aux_losses()
    init_moe(tp, ep, etp)
    spmd_megatron.register()
    return build_moe(tp, ep, etp if etp is not None else tp, dispatcher, **overrides), make_batch(0)


def typed_moe_step(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """type_parameters and one forward+backward inside typecheck() on the dense mesh (the adapter's calls)."""
    from spmd_types import megatron as spmd_megatron

    spmd_megatron.register()
    with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck():
        spmd_megatron.type_parameters(model)
        return forward_backward(model, typed_inputs(batch))


# ---------------------------------------------------------------------------
# reassembly on gloo


def _is_expert(name: str) -> bool:
    return ".local_experts." in name


def _global_expert_name(name: str, ep_rank: int, local: int) -> str:
    head, rest = name.split(".local_experts.", 1)
    k, tail = rest.split(".", 1)
    return f"{head}.local_experts.{ep_rank * local + int(k)}.{tail}"


def _gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _summed(t: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def gather_full(model, grads_: dict[str, torch.Tensor], synced: bool = False) -> tuple[dict, dict]:
    """Every weight and gradient as the one-device model has it: shards joined, experts by global index,
    gradients summed over the data-parallel ranks (unless ``synced``: already the DDP average)."""
    from megatron.core import parallel_state as ps

    tp_g, etp_g, ep_g = (ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                         ps.get_expert_model_parallel_group())
    dp_g, edp_g = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    local = EXPERTS // ps.get_expert_model_parallel_world_size()
    full_w, full_g = {}, {}
    for name, p in model.named_parameters():
        w, g = plain(p), grads_[name]
        expert = _is_expert(name)
        group = etp_g if expert else tp_g
        if getattr(p, "tensor_model_parallel", False):
            w, g = (torch.cat(_gather(x, group), p.partition_dim) for x in (w, g))
        elif getattr(p, "sequence_parallel", False) and not synced:
            g = _summed(g, tp_g)  # R on tp: each rank holds a share of the gradient
        if not synced:
            g = _summed(g, edp_g if expert else dp_g)
        if expert:
            for r, (wr, gr) in enumerate(zip(_gather(w, ep_g), _gather(g, ep_g))):
                key = _global_expert_name(name, r, local)
                full_w[key], full_g[key] = wr, gr
        else:
            full_w[name], full_g[name] = w, g
    return full_w, full_g


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def clear_aux_losses_tracker() -> None:
    """Megatron's per-process aux-loss log back to zeros (its training loop does this every iteration).

    A log filled by an unchecked run holds plain values; a checked run writing typed values into it is
    refused (the write would drop their type). Zeros take the type of what is written.
    """
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()


def forget_aux_losses() -> None:
    """Megatron's per-process aux-loss log emptied, as in a new process (tests build many layouts in one)."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()


def _one_device(full_w: dict, dispatcher: str, dp: int) -> tuple[dict, dict]:
    """The same weights on one device (tp=ep=1), over every dp rank's micro-batch: (losses by rank, grads)."""
    init_moe(1, 1, 1)
    ref = build_moe(1, 1, 1, dispatcher)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full_w[name])
    losses = {i: plain(forward_backward(ref, make_batch(100 + i))) for i in range(dp)}
    return losses, grads(ref)


def run_config(dispatcher: str, tp: int, ep: int, etp: int) -> dict[str, Any]:
    """One configuration on the current gloo world: typed vs untyped vs one device."""
    from megatron.core import parallel_state as ps

    forget_aux_losses()
    init_moe(tp, ep, etp)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = make_batch(100 + dp_rank)
    model = build_moe(tp, ep, etp, dispatcher)
    loss_u = plain(forward_backward(model, batch))
    grads_u = grads(model)
    model.zero_grad(set_to_none=True)
    clear_aux_losses_tracker()  # as Megatron's training loop does every iteration
    loss_typed = typed_moe_step(model, batch)
    loss_t, grads_t = plain(loss_typed), grads(model)
    full_w, full_g = gather_full(model, grads_t)
    losses, ref_g = _one_device(full_w, dispatcher, dp)
    return {
        "key": f"{dispatcher}_tp{tp}_ep{ep}_etp{etp}",
        "loss_typed_vs_untyped": float((loss_t - loss_u).abs().max()),
        "grad_typed_vs_untyped": _max_diff(grads_t, grads_u),
        "loss_vs_one_device": float((loss_t - losses[dp_rank]).abs().max()),
        "grad_vs_one_device": _max_diff(full_g, ref_g),
        "grad_scale": max(float(g.abs().max()) for g in ref_g.values()),
        "loss_type": str(spmd.get_type(loss_typed)),
        "n_params": len(grads_t),
    }


def run_ddp(dispatcher: str, tp: int, ep: int, etp: int) -> dict[str, Any]:
    """Megatron's DDP + finalize_model_grads, typed and tracked: the synced gradients vs one device's average."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


    init_moe(tp, ep, etp)
    dp = ps.get_data_parallel_world_size()
    model = build_moe(tp, ep, etp, dispatcher)
    ddp = DistributedDataParallel(moe_config(tp, ep, etp, dispatcher), DistributedDataParallelConfig(), model)
    forget_aux_losses()
    tracker = tracked_ddp_step(ddp)
    synced = {n: plain(p.main_grad) for n, p in model.named_parameters()}
    full_w, full_g = gather_full(model, synced, synced=True)
    _, ref_g = _one_device(full_w, dispatcher, dp)
    want = {n: g / dp for n, g in ref_g.items()}  # Megatron's DDP averages over dp (experts: edp/dp then sum)
    return {"key": f"ddp_{dispatcher}_tp{tp}_ep{ep}_etp{etp}", "grad_vs_one_device": _max_diff(full_g, want),
            "grad_scale": max(float(g.abs().max()) for g in want.values()), "unsynced": tracker.unsynced(),
            "expert_grad_type": str(tracker.grad_type(next(n for n in tracker.params if _is_expert(n))))}


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One gloo rank: every configuration; one JSON line each (or the error)."""
    jobs = [(f"{d}_tp{tp}_ep{ep}_etp{etp}", lambda c=(d, tp, ep, etp): run_config(*c)) for d, tp, ep, etp in CONFIGS]
    jobs += [(f"ddp_{d}_tp{tp}_ep{ep}_etp{etp}", lambda c=(d, tp, ep, etp): run_ddp(*c))
             for d, tp, ep, etp in DDP_CONFIGS]
    with gloo_worker(rank, init_method, WORLD, accommodate_moe_cpu):
        record_jobs(Path(out_dir) / f"rank{rank}.jsonl", jobs)
