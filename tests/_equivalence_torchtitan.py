"""torchtitan 0.3.0's own models under ``check_equivalence``: build, training step and batch, with no rank shims.

What a torchtitan user writes to check a model: ``build(mesh)`` makes the model the trainer's way
(torchtitan's config, ``ParallelDims``, ``spec.model.build()``, ``init_weights``, the model's own
``parallelize_fn``), and ``step`` is the trainer's ``_forward_backward_body`` (forward and loss in
``get_spmd_context``, backward), then, when asked, an optimizer step. With ``Options(fsdp=True)``
(torch 2.14) torchtitan's own ``fully_shard`` is applied and its reduce-scatter is the gradient sync,
run on the simulated ranks; otherwise FSDP is left out (``fsdp_skipped``) and the step does the sum
over dp FSDP would do (an all-reduce). Nothing here reads or fakes a rank: ``dist.get_rank(group)`` in torchtitan's embedding and
loss is answered per simulated rank by ``check_equivalence`` itself. The CPU accommodations are
``_torchtitan_shims.load``'s (``device_type`` "cpu", FlexAttention as dense math, the experts'
grouped matmul in float32, ``fully_shard`` not applied unless asked); docs/equivalence.md names them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from _torchtitan_shims import fsdp_skipped, load, outside_local_mode
from _torchtitan_support import LOCAL_BATCH, SEED, SEQ_LEN, Case, global_batch, trainer_config

import spmd_types as spmd

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
MODELS = {"llama3": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


@dataclass
class Options:
    """How the model is built and stepped: its torchtitan model name, sequence parallelism, an optimizer step."""

    model: str = "llama3"
    sp: bool = False
    lr: float | None = None  # an SGD step with this learning rate after the gradient sync
    optimizer: Callable[..., Any] | None = None  # (named parameters, lr, parallel_dims) -> optimizer; default SGD
    ep: int = 1
    after_build: Callable[[torch.nn.Module, Any], None] | None = None  # (model, parallel_dims): a planted change
    fsdp: bool = False  # torchtitan's fully_shard applied (torch 2.14): FSDP's reduce-scatter is in the step


def _sizes(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))


def build(mesh: Any, opts: Options) -> torch.nn.Module:
    """torchtitan's model for ``mesh`` (axes ``dp``, ``tp``, and ``ep`` inside dp x tp), built as the trainer does."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    load()
    sizes = _sizes(mesh)
    world = math.prod(sizes.values())
    tp = sizes.get("tp", 1)
    case = Case(opts.model, opts.model, world=world, tp=tp, ep=opts.ep if world > 1 else 1, sp=opts.sp and tp > 1)
    cfg = trainer_config(case, checking=True, world=world)
    if opts.fsdp:  # FSDP computes and reduces in the run's dtype: the float64 twin that measures round-off too
        from torchtitan.config import TORCH_DTYPE_MAP

        TORCH_DTYPE_MAP.setdefault("float64", torch.float64)  # torchtitan's config names no float64
        cfg.training.mixed_precision_param = cfg.training.mixed_precision_reduce = \
            str(torch.get_default_dtype()).removeprefix("torch.")
    parallel_dims = ParallelDims.from_config(cfg.parallelism, world)
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    spec = cfg.model_spec
    spec.model.update_from_config(config=cfg)
    model = spec.model.build()
    model.verify_module_protocol()
    with torch.no_grad(), spmd.no_typecheck():
        model.init_weights(buffer_device=None)  # the values do not matter: check_equivalence loads the reference's
    # FSDP applied (outside typecheck(), as the trainer parallelizes), or left out and its reduction done in step
    with spmd.no_typecheck() if opts.fsdp else fsdp_skipped():
        model = spec.parallelize_fn(
            model, parallel_dims=parallel_dims, training=cfg.training, parallelism=cfg.parallelism,
            compile_config=cfg.compile, ac_config=cfg.activation_checkpoint, dump_folder="/nonexistent")
    if model.enable_weight_tying:
        model.tok_embeddings.weight = model.lm_head.weight
    model.train()
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    if opts.after_build is not None:
        opts.after_build(model, parallel_dims)
    model.__dict__["_titan"] = (cfg, parallel_dims, loss_fn)  # not a submodule: kept out of named_modules
    return model


def batch(opts: Options, dp: int = 2) -> dict[str, Any]:
    """Tokens and labels of ``dp * LOCAL_BATCH`` rows (split over dp), and the positions every row shares."""
    load()
    from _torchtitan_models import registry_config

    vocab = registry_config(opts.model).model_spec.model.vocab_size
    tokens, labels, positions = global_batch(vocab, dp * LOCAL_BATCH)
    return {"tokens": (tokens, {"dp": S(0), "tp": R}), "labels": (labels, {"dp": S(0), "tp": I}),
            "positions": positions[0]}


def step(model: torch.nn.Module, batch: dict, mesh: Any, opts: Options) -> torch.Tensor:
    """The trainer's forward, loss and backward; the gradient reduction over dp; an optimizer step if asked."""
    import types

    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.trainer import Trainer

    cfg, pd, loss_fn = model.__dict__["_titan"]
    inputs, labels = batch["tokens"], batch["labels"]
    positions = batch["positions"].expand(inputs.shape[0], SEQ_LEN).contiguous()  # the same on every rank
    with outside_local_mode():
        masks = model.get_attention_masks(positions=positions)
    extra = {"positions": positions, "attention_masks": masks}
    valid = (labels != IGNORE_INDEX).sum()
    with spmd.no_typecheck():
        global_valid = dist_utils.dist_sum_tensor(valid, pd.get_mesh("batch")) if pd.dp_enabled else valid
    inputs, labels, extra = annotate_input_spmd_types(pd, inputs, labels, extra)
    context = dist_utils.get_spmd_context(parallel_dims=pd, spmd_typechecking=True)
    trainer = types.SimpleNamespace(train_context=context, model_parts=[model], loss_fn=loss_fn)
    loss = Trainer._forward_backward_body(trainer, inputs, labels, global_valid, extra)
    with spmd.set_current_mesh(pd.spmd_dense_mesh()):
        for p in model.parameters() if not opts.fsdp else ():  # what FSDP's reduce-scatter (or DDP's all-reduce) does
            if p.grad is not None and spmd.get_type(p.grad).get("dp") is P:
                p.grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R)
        if opts.lr is not None:
            make = opts.optimizer or (lambda named, lr, pd: torch.optim.SGD([p for _, p in named], lr=lr))
            make(list(model.named_parameters()), opts.lr, pd).step()
        return spmd.all_reduce(loss.detach(), "dp", src=P, dst=I) if pd.dp_enabled else loss.detach()


SEQ = SEQ_LEN
__all__ = ["Options", "build", "batch", "step", "LOCAL_BATCH", "SEED", "SEQ"]
