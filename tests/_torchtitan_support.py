"""Run torchtitan 0.3.0's own models with ``spmd_types`` checking on CPU, in one process.

torchtitan's ``parallelism.spmd_backend = "spmd_types"`` annotates its models
with ``import spmd_types as spmd`` calls written against meta-pytorch's
``spmd-types`` 0.2.3; this helper drives those models against whichever
``spmd_types`` is importable, so the same matrix checks the peer and ours.

What comes from torchtitan, unchanged: the model configs (its debug flavours
from each model's ``config_registry``, made smaller with the model's own layer
builders), the sharding configs (``update_from_config``), ``ParallelDims`` and
its meshes, each model's ``parallelize_fn`` (``Module.parallelize``), weight
init, the loss (``ChunkedLossWrapper`` over cross entropy), input annotation
(``annotate_input_spmd_types``) and the context the trainer runs forward and
backward in (``get_spmd_context``, which enters ``spmd_types.checker.typecheck``
when ``debug.spmd_typechecking`` is on). The forward/backward body is the
trainer's ``_forward_backward_body``; the ``Trainer`` object itself is not
built (it needs a tokenizer, a dataset, a checkpointer and a GPU).

Two environments: ``"fake"`` runs rank 0's program on a fake process group
(collectives move no data: types only); ``"local"`` runs every rank with torch's
``LocalTensorMode`` (real values), so loss and gradients can be compared with
checking off and with the same model on one device.

The shims this needs on CPU, on torch 2.13 and on simulated ranks live in
``_torchtitan_shims.py`` and nowhere else (:func:`load` and ``simulated_ranks``
list them); the heavy or CUDA-only modules torchtitan imports at module level
are stubbed while torchtitan is imported, then removed again.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from _torchtitan_models import UNUSED, registry_config
from _torchtitan_shims import fsdp_skipped, load, outside_local_mode, simulated_ranks

# Tiny problem: seq divisible by tp (sequence parallelism) and by the loss
# wrapper's chunks; two documents per row so the document mask matters. Under
# context parallelism torch's flex-attention sharding needs the sequence to be
# a multiple of 2 x cp x its 128-token block.
SEQ_LEN = 16
CP_SEQ_LEN = 256
LOCAL_BATCH = 2
SEED = 1234


# ---------------------------------------------------------------------------
# The matrix: torchtitan's debug flavours, made small, on CPU meshes


@dataclass(frozen=True)
class Case:
    """One model under one parallelism; ``world`` ranks, ``dp_shard`` takes what the other degrees leave.

    ``dp_replicate`` > 1 is HSDP; ``cp`` > 1 shards the sequence (context parallelism).
    """

    name: str
    model: str
    world: int
    tp: int
    ep: int = 1
    sp: bool = True
    dp_replicate: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        """The data-parallel ranks (dp_replicate x dp_shard): the batch is split this many ways."""
        return self.world // (self.tp * self.cp)

    @property
    def seq_len(self) -> int:
        return CP_SEQ_LEN if self.cp > 1 else SEQ_LEN


CASES: tuple[Case, ...] = (
    Case("llama3 dp4 x tp2 (SP)", "llama3", world=8, tp=2, sp=True),
    Case("llama3 tp4 (no SP)", "llama3", world=4, tp=4, sp=False),
    Case("qwen3 dp2 x tp2", "qwen3", world=4, tp=2),
    Case("qwen3-MoE tp2 x ep2", "qwen3_moe", world=4, tp=2, ep=2),
    Case("deepseek_v3 tp2 x ep2", "deepseek_v3", world=4, tp=2, ep=2),
    Case("gpt_oss tp2 x ep2", "gpt_oss", world=4, tp=2, ep=2),
)


def unused(c: Case, param: str) -> bool:
    """Whether a text-only step of ``c`` leaves ``param`` without a gradient by design (a vision tower)."""
    return param.startswith(UNUSED.get(c.model, ()))


def case(name: str) -> Case:
    """The case called ``name`` (see :data:`CASES`)."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}; cases: {[c.name for c in CASES]}")


def trainer_config(c: Case, *, checking: bool, world: int | None = None, compile_backend: str | None = None) -> Any:
    """The ``Trainer.Config`` of case ``c``: spmd_types backend, checking on or off, tiny batch.

    ``compile_backend`` turns on torchtitan's own per-block compile (``--compile.enable``, the model only)
    with that backend (``"aot_eager"`` on CPU).
    """
    load()
    cfg = registry_config(c.model)
    world = c.world if world is None else world
    p = cfg.parallelism
    p.spmd_backend = "spmd_types"
    p.tensor_parallel_degree = c.tp if world > 1 else 1
    p.expert_parallel_degree = c.ep if world > 1 else 1
    p.enable_sequence_parallel = c.sp
    p.data_parallel_replicate_degree = c.dp_replicate if world > 1 else 1
    p.context_parallel_degree = c.cp if world > 1 else 1
    p.data_parallel_shard_degree = -1
    cfg.debug.spmd_typechecking = checking
    # what torchtitan's own spmd_types test recipes do when checking is on
    cfg.activation_checkpoint = None
    cfg.compile.enable = compile_backend is not None
    if compile_backend is not None:
        cfg.compile.backend = compile_backend
        cfg.compile.components = ["model"]
    cfg.loss.num_chunks = 2  # the chunked loss's per-chunk backward, twice rather than eight times
    t = cfg.training
    t.seq_len, t.local_batch_size = c.seq_len, LOCAL_BATCH
    t.disable_cuda_graphs = True
    t.dtype = t.mixed_precision_param = "float32"
    return cfg


@dataclass
class Built:
    """A parallelized, initialized model and what the trainer keeps beside it."""

    config: Any
    parallel_dims: Any
    model: torch.nn.Module
    loss_fn: Any


def build(c: Case, *, checking: bool, world: int, simulated: bool = False, compile_backend: str | None = None) -> Built:
    """Build, parallelize and initialize case ``c`` on ``world`` ranks (the process group must exist).

    The trainer's steps (``Trainer.__init__``), on CPU instead of meta: a
    parameter made on the meta device is replaced by ``to_empty`` and loses its
    spmd type; in torchtitan that is repaired by FSDP, which is not applied here.

    ``simulated`` (every rank under ``LocalTensorMode``): the whole model is
    initialized once, before ``parallelize`` shards it, and handed to every
    rank, instead of the trainer's order (shard, then ``to_empty`` and
    initialize each shard). The fused-QKV initializer indexes a list by the TP
    rank, which the simulator makes a per-rank symbolic int; and one
    initialization is what the one-device model starts from.
    """
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh

    cfg = trainer_config(c, checking=checking, world=world, compile_backend=compile_backend)
    if compile_backend is not None:
        torch._dynamo.reset()  # a fresh model's blocks compile afresh (dynamo's recompile limit is per code object)
    parallel_dims = ParallelDims.from_config(cfg.parallelism, world)
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    spec = cfg.model_spec
    spec.model.update_from_config(config=cfg)
    with outside_local_mode():
        torch.manual_seed(SEED)
        with torch.device("cpu"):
            model = spec.model.build()
        model.verify_module_protocol()
        if simulated:
            with torch.no_grad():
                model.init_weights(buffer_device=None)
    if simulated:
        _hand_to_every_rank(model)
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=cfg.training, parallelism=cfg.parallelism,
        compile_config=cfg.compile, ac_config=cfg.activation_checkpoint, dump_folder="/nonexistent")
    if simulated and model.enable_weight_tying:
        # parallelize gave each module its own parameter; Decoder.init_states re-ties them first thing
        model.tok_embeddings.weight = model.lm_head.weight
    if not simulated:
        model.to_empty(device="cpu")
        # Fused-QKV init of plain (non-DTensor) parameters reads the TP rank
        # from the current mesh, the path torchtitan's RL generator takes.
        with torch.no_grad(), set_current_spmd_mesh(parallel_dims.spmd_dense_mesh()):
            model.init_weights(buffer_device=None)
    model.train()
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return Built(cfg, parallel_dims, model, loss_fn)


def _hand_to_every_rank(model: torch.nn.Module) -> None:
    """Make each parameter and buffer a LocalTensor holding the same value on every simulated rank."""
    made: dict[int, torch.nn.Parameter] = {}  # a tied parameter stays one parameter
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(_same_on_ranks(param.detach()), param.requires_grad)
                module._parameters[name] = made[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = _same_on_ranks(buf)


def _same_on_ranks(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed._local_tensor import local_tensor_mode, rank_map

    with outside_local_mode():  # a plain op under the mode makes one value per rank of each rank's value
        copies = {r: value.clone() for r in local_tensor_mode().ranks}
    return rank_map(copies.__getitem__)


# ---------------------------------------------------------------------------
# Environments and one training step


@contextlib.contextmanager
def environment(env: str, world: int) -> Iterator[None]:
    """A fake process group of ``world`` ranks; ``env="local"`` also simulates every rank (``LocalTensorMode``,
    ``fully_shard`` left out); ``env="gloo"`` runs in the gloo process group this worker already joined."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if env not in ("fake", "local", "gloo"):
        raise ValueError(f"env must be 'fake', 'local' or 'gloo', got {env!r}")
    load()
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    if env == "gloo":
        if dist.get_world_size() != world:
            raise ValueError(f"gloo world is {dist.get_world_size()} ranks, the case needs {world}")
    else:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    threaded = torch.autograd.is_multithreading_enabled()
    # torchtitan's init_distributed does this: autograd on one thread keeps the
    # thread-local current mesh visible in backward
    torch.autograd.set_multithreading_enabled(False)
    try:
        with contextlib.ExitStack() as stack:
            if env == "local":
                stack.enter_context(fsdp_skipped())
                stack.enter_context(simulated_ranks(world))
            yield
    finally:
        torch.autograd.set_multithreading_enabled(threaded)
        set_spmd_meshes(dense_mesh=None, sparse_mesh=None)
        if env != "gloo" and dist.is_initialized():
            dist.destroy_process_group()
        # DTensor's sharding caches key on meshes by value: the next run's equal meshes would get this run's mesh
        # objects back, and FSDP checks its parameters' mesh by identity
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


def global_batch(vocab: int, rows: int, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and positions for ``rows`` sequences; every row holds the same two documents."""
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=g)
    labels = torch.randint(0, vocab, (rows, seq_len), generator=g)
    half = seq_len // 2
    positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).repeat(rows, 1)
    return tokens, labels, positions


def _dp_rows(b: Built) -> Callable[[int], slice]:
    """Global rank -> the rows of the global batch that rank reads (its coordinate on the dp axis)."""
    mesh = b.parallel_dims.spmd_dense_mesh()
    names = list(mesh.mesh_dim_names)
    layout = mesh.mesh
    dp = names.index("dp")
    dp_of = {int(layout[coord]): coord[dp] for coord in itertools.product(*[range(n) for n in layout.shape])}
    return lambda r: slice(dp_of[r] * LOCAL_BATCH, (dp_of[r] + 1) * LOCAL_BATCH)


def _per_rank(global_tensor: torch.Tensor, rows: Callable[[int], slice], env: str) -> torch.Tensor:
    if env != "local":  # this process's rank (0 on the fake group)
        import torch.distributed as dist

        return global_tensor[rows(dist.get_rank() if dist.is_initialized() else 0)].clone()
    from torch.distributed._local_tensor import local_tensor_mode, rank_map

    with outside_local_mode():
        values = {r: global_tensor[rows(r)].clone() for r in local_tensor_mode().ranks}
    return rank_map(values.__getitem__)


def train_step(b: Built, env: str, global_rows: int) -> torch.Tensor:
    """The trainer's step for one microbatch of a ``global_rows``-row batch; returns the loss.

    Each rank reads its data-parallel share of the rows (``LOCAL_BATCH`` rows
    per dp rank); with context parallelism torchtitan's
    ``prepare_context_parallel_input`` shards them (and the masks) by sequence;
    inputs are annotated, then forward, loss and backward.

    Mirrors ``Trainer.train_step`` / ``post_dataloading_process`` and runs
    torchtitan's own ``Trainer._forward_backward_body`` (forward and loss in
    ``get_spmd_context``, backward under ``spmd.no_typecheck``).
    """
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.trainer import Trainer

    cfg, pd = b.config, b.parallel_dims
    vocab = cfg.model_spec.model.vocab_size
    with outside_local_mode():  # one plain global batch, not one per simulated rank
        tokens, labels, positions = global_batch(vocab, global_rows, cfg.training.seq_len)
    rows = _dp_rows(b) if pd.world_size > 1 else (lambda r: slice(None))
    inputs, labels = _per_rank(tokens, rows, env), _per_rank(labels, rows, env)
    positions = positions[rows(0)].clone()  # the same on every rank: one plain tensor
    with outside_local_mode():
        masks = b.model.get_attention_masks(positions=positions)
    extra = {"positions": positions, "attention_masks": masks}
    local_valid = (labels != IGNORE_INDEX).sum()
    global_valid = dist_utils.dist_sum_tensor(local_valid, pd.get_mesh("batch")) if pd.dp_enabled else local_valid
    if pd.cp_enabled:
        from torchtitan.distributed.context_parallel import prepare_context_parallel_input

        p = cfg.parallelism
        inputs, labels, extra = prepare_context_parallel_input(
            inputs, labels, extra, pd.get_mesh("cp"), torch.device("cpu"), p.context_parallel_load_balancer,
            p.context_parallel_ptrr_mask_key)
    inputs, labels, extra = annotate_input_spmd_types(pd, inputs, labels, extra)
    train_context = dist_utils.get_spmd_context(
        parallel_dims=pd,
        spmd_typechecking=cfg.parallelism.spmd_backend == "spmd_types" and cfg.debug.spmd_typechecking,
    )
    trainer = types.SimpleNamespace(train_context=train_context, model_parts=[b.model], loss_fn=b.loss_fn)
    return Trainer._forward_backward_body(trainer, inputs, labels, global_valid, extra)


# ---------------------------------------------------------------------------
# Results: per-rank values, and their one-device meaning


@dataclass
class Step:
    """One training step: loss and parameter gradients, each ``{rank: tensor}`` (rank 0 only on "fake").

    ``loss`` and ``grads`` are each rank's own values. On simulated ranks the
    ``global_*`` fields hold their one-device meaning as each rank reassembles
    it from the declared layouts (torchtitan's ``plain_tensor_to_dtensor_state_dict``,
    then ``full_tensor()``): a loss is P over dp and cp, a gradient is P where
    its parameter is R (the reduction FSDP would do), S(d) where it is S(d).
    """

    loss: dict[int, torch.Tensor]
    grads: dict[str, dict[int, torch.Tensor]]
    global_loss: dict[int, torch.Tensor] | None = None
    global_grads: dict[str, dict[int, torch.Tensor]] | None = None
    global_weights: dict[str, dict[int, torch.Tensor]] | None = None


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{rank: plain tensor}``: every simulated rank's value of a LocalTensor, or rank 0's of a plain one (of an
    FSDP parameter's DTensor, rank 0's shard)."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()

    with outside_local_mode(), torch._C.DisableTorchFunctionSubclass():
        if isinstance(t, LocalTensor):
            return {r: v.detach() for r, v in t._local_tensors.items()}
        return {0: t.detach()}


def run(c: Case, env: str, *, checking: bool = True, mistake: Callable[[], ContextManager] | None = None,
        one_device: bool = False, inspect: Callable[[Built], None] | None = None,
        compile_backend: str | None = None) -> Step:
    """One training step of case ``c`` on ``c.world`` ranks in ``env`` ("fake" or "local").

    ``mistake`` (a context manager factory, see ``_torchtitan_mistakes``) is entered
    around building, so the sharding configs torchtitan sets carry the planted
    change. ``one_device`` (simulated ranks only) also reassembles weights,
    gradients and loss into their one-device values (the ``global_*`` fields).
    ``inspect`` is called with the built model before the step.
    ``compile_backend``: torchtitan's per-block compile, with that backend.
    """
    if one_device and env != "local":
        raise ValueError("one_device needs the simulated ranks (env='local')")
    with environment(env, c.world), (mistake() if mistake is not None else contextlib.nullcontext()):
        b = build(c, checking=checking, world=c.world, simulated=env == "local",
                  compile_backend=compile_backend)
        if inspect is not None:
            inspect(b)
        loss = train_step(b, env, c.dp * LOCAL_BATCH)
        params = dict(b.model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and p.grad is None and not unused(c, n)]
        if missing:
            raise AssertionError(f"{c.name}: parameters without a gradient: {missing}")
        step = Step(rank_values(loss), {n: rank_values(p.grad) for n, p in params.items() if p.grad is not None})
        if one_device:
            layouts = state_layouts(b.model)
            step.global_weights = reassemble(b, {n: p.detach() for n, p in params.items()}, layouts)
            step.global_grads = reassemble(b, {n: p.grad for n, p in params.items()},
                                           {n: gradient_layout(layouts[n]) for n in params})
            step.global_loss = reassemble(b, {"loss": loss.detach()}, {"loss": loss_layout()})["loss"]
        return step


def run_one_device(c: Case, weights: dict[str, torch.Tensor]) -> Step:
    """The same model on one device (world 1, checking off, no FSDP), from ``weights`` (one global tensor per parameter)."""
    with environment("fake", 1), fsdp_skipped():
        b = build(c, checking=False, world=1)
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for name, p in b.model.named_parameters():
                # a vision tower is still FSDP-wrapped, on a one-rank mesh: its local tensor is the whole
                (p.to_local() if isinstance(p, DTensor) else p).copy_(weights[name])
        loss = train_step(b, "fake", c.dp * LOCAL_BATCH)
        return Step(rank_values(loss),
                    {n: rank_values(p.grad) for n, p in b.model.named_parameters() if p.grad is not None})


def state_layouts(model: torch.nn.Module) -> dict[str, Any]:
    """``{parameter or buffer FQN: SpmdLayout}`` from every module's ``sharding_config.state_shardings``."""
    layouts = {}
    for prefix, module in model.named_modules():
        sharding = getattr(module, "_sharding_config", None)
        if sharding is not None:
            for name, layout in sharding.state_shardings.items():
                layouts[f"{prefix}.{name}" if prefix else name] = layout
    return layouts


def gradient_layout(layout: Any) -> Any:
    """The layout of a parameter's gradient: P where the parameter is R, the same type elsewhere."""
    from torchtitan.distributed.parallel_dims import SpmdLayout

    import spmd_types as spmd

    return SpmdLayout({a: spmd.P if t == spmd.R else t for a, t in layout.axis_types.items()}, layout.partition_spec)


def loss_layout() -> Any:
    """The loss's layout, as torchtitan's loss asserts it: P over dp and cp, I over tp."""
    from torchtitan.distributed.parallel_dims import MeshAxisName, SpmdLayout

    import spmd_types as spmd

    return SpmdLayout({MeshAxisName.DP: spmd.P, MeshAxisName.CP: spmd.P, MeshAxisName.TP: spmd.I})


def reassemble(b: Built, values: dict[str, torch.Tensor], layouts: dict[str, Any]) -> dict[str, dict[int, torch.Tensor]]:
    """``{name: {rank: global tensor}}``: each simulated rank's reassembly of ``values`` by ``layouts``."""
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.spmd_types import plain_tensor_to_dtensor_state_dict

    as_dtensors = plain_tensor_to_dtensor_state_dict(values, state_dict_layouts=layouts, parallel_dims=b.parallel_dims)
    return {n: rank_values(v.full_tensor() if isinstance(v, DTensor) else v) for n, v in as_dtensors.items()}


def max_abs_diff(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor] | torch.Tensor) -> float:
    """Largest |a - b| over ranks (``b`` one tensor: compared with every rank of ``a``)."""
    worst = 0.0
    for r, value in a.items():
        other = b if isinstance(b, torch.Tensor) else b[r]
        if value.shape != other.shape:
            raise AssertionError(f"rank {r}: shape {tuple(value.shape)} vs {tuple(other.shape)}")
        worst = max(worst, float((value.double() - other.double()).abs().max()) if value.numel() else 0.0)
    return worst
