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

The shims this needs on CPU and torch 2.13 live here and only here
(:func:`load` lists them); the heavy or CUDA-only modules torchtitan imports at
module level are stubbed while torchtitan is imported, then removed again.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

MODEL_PACKAGES = ("llama3", "qwen3", "deepseek_v3", "gpt_oss")

# Tiny problem: seq divisible by tp (sequence parallelism) and by the loss
# wrapper's 8 chunks; two documents per row so the document mask matters.
SEQ_LEN = 16
LOCAL_BATCH = 2
SEED = 1234


# ---------------------------------------------------------------------------
# Import: stub what torchtitan imports at module level but never runs here


class _Unavailable:
    """Stands in for a class of a module that is stubbed in these tests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__name__}: this dependency is stubbed in the torchtitan tests")


class _TritonStub:
    """``triton.jit`` and ``triton.language`` attributes: decorating works, launching raises."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return _NoKernel(args[0])
        return _TritonStub()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _TritonStub()


class _NoKernel:
    """A ``@triton.jit`` kernel: it may be defined, never launched (no GPU here)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable:
        raise RuntimeError(f"triton kernel {self.fn.__name__} cannot run: triton is stubbed (CPU tests)")


def _module_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _TritonStub()


def _stub_modules() -> dict[str, types.ModuleType]:
    """tokenizers, datasets (HF), tensorboard (through torch's wrapper) and triton."""
    def mod(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    datasets = mod("datasets", Dataset=_Unavailable, load_dataset=_Unavailable, __path__=[])
    triton_language = mod("triton.language")
    triton_language.__getattr__ = _module_getattr  # type: ignore[attr-defined]
    triton = mod("triton", language=triton_language, jit=_TritonStub(), __version__="0.0", __path__=[])
    triton.__getattr__ = _module_getattr  # type: ignore[attr-defined]
    return {
        "tokenizers": mod("tokenizers", AddedToken=_Unavailable, Tokenizer=_Unavailable),
        "datasets": datasets,
        "datasets.distributed": mod("datasets.distributed", split_dataset_by_node=_Unavailable),
        "torch.utils.tensorboard": mod("torch.utils.tensorboard", SummaryWriter=_Unavailable),
        "triton": triton,
        "triton.language": triton_language,
    }


@contextlib.contextmanager
def _stubbed() -> Iterator[None]:
    """Put the stubs in ``sys.modules`` for the import only, then take them out again."""
    # torch asks "is triton installed?" once and caches the answer; ask before
    # the stub is visible so torch never takes the stub for a real triton.
    import torch._dynamo  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()
    added = {k: v for k, v in _stub_modules().items() if k not in sys.modules}
    sys.modules.update(added)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


_LOADED: dict[str, Any] = {}


def load() -> Any:
    """Import torchtitan (trainer + the four model packages) and install the CPU shims; returns ``torchtitan``.

    The shims, each needed on this CPU machine with torch 2.13:

    * ``device_type`` is ``"cpu"`` (torchtitan picks ``"cuda"`` when no
      accelerator is found and would build CUDA device meshes);
    * FlexAttention runs as dense math (:func:`cpu_flex_attention`): torch's
      flex attention has no backward on CPU, and torchtitan compiles it;
    * the block mask is made eagerly (torchtitan compiles ``create_block_mask``);
    * the experts' grouped matmul runs in float32 (:func:`cpu_grouped_mm`);
    * ``fully_shard`` is not applied (:func:`skip_fsdp`): torch 2.13's FSDP
      rejects plain parameters that carry spmd types when ``dp_mesh_dims`` is
      given; the reduction FSDP would do is done when gradients are reassembled.
    """
    if "torchtitan" in _LOADED:
        return _LOADED["torchtitan"]
    with _stubbed():
        import torchtitan.trainer  # noqa: F401

        for name in MODEL_PACKAGES:
            importlib.import_module(f"torchtitan.models.{name}")
            importlib.import_module(f"torchtitan.models.{name}.config_registry")
    _install_cpu_shims()
    import torchtitan

    _LOADED["torchtitan"] = torchtitan
    return torchtitan


def _install_cpu_shims() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention
    import torchtitan.models.common.moe as moe
    import torchtitan.tools.utils as tools_utils
    from torch.nn.attention.flex_attention import create_block_mask

    for module in (tools_utils, parallel_dims, dist_utils):
        module.device_type = "cpu"
    attention.FlexAttention._compiled_flex_attn = staticmethod(cpu_flex_attention)
    attention._compiled_create_block_mask = create_block_mask
    moe.GroupedExperts._grouped_mm = cpu_grouped_mm
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.models.") and getattr(module, "apply_fsdp_to_decoder", None) is apply_fsdp_to_decoder:
            module.apply_fsdp_to_decoder = skip_fsdp
    # torchtitan's init_distributed does this: autograd on one thread keeps the
    # thread-local current mesh visible in backward.
    torch.autograd.set_multithreading_enabled(False)


def cpu_grouped_mm(self: Any, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts._grouped_mm`` in float32: CPU ``_grouped_mm`` in bfloat16 wants 16-byte strides, and
    gpt_oss would add its bfloat16 expert output to the float32 activations FSDP's bf16 policy does not cast here."""
    return torch._grouped_mm(A.float(), B_t.float(), offs=offs)


def skip_fsdp(model: torch.nn.Module, dp_mesh: Any, **kwargs: Any) -> None:
    """Stands for ``apply_fsdp_to_decoder``: records that FSDP was left out (see :func:`load`)."""
    model._fsdp_skipped_mesh = dp_mesh  # type: ignore[attr-defined]


def _outside_local_mode() -> ContextManager:
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()


def cpu_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                       return_aux=None, kernel_options=None):
    """``flex_attention`` as dense math on CPU: softmax(q k^T * scale, masked by the block mask's mask_mod) v."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("cpu_flex_attention: score_mod is not used by the models under test")
    batch, heads, q_len, head_dim = q.shape
    with _outside_local_mode():  # the mask is the same on every rank: one plain tensor
        mask = create_mask(block_mask.mask_mod, block_mask.shape[0], 1, q_len, k.shape[2], device="cpu")
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(head_dim))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    want_lse = return_aux is not None and return_aux.lse
    return out, AuxOutput(lse=lse if want_lse else None)


# ---------------------------------------------------------------------------
# The matrix: torchtitan's debug flavours, made small, on CPU meshes


@dataclass(frozen=True)
class Case:
    """One model under one parallelism; ``world`` ranks, data parallel takes what tp leaves."""

    name: str
    model: str
    world: int
    tp: int
    ep: int = 1
    sp: bool = True

    @property
    def dp(self) -> int:
        return self.world // self.tp


CASES: tuple[Case, ...] = (
    Case("llama3 dp4 x tp2 (SP)", "llama3", world=8, tp=2, sp=True),
    Case("llama3 tp4 (no SP)", "llama3", world=4, tp=4, sp=False),
    Case("qwen3 dp2 x tp2", "qwen3", world=4, tp=2),
    Case("qwen3-MoE tp2 x ep2", "qwen3_moe", world=4, tp=2, ep=2),
    Case("deepseek_v3 tp2 x ep2", "deepseek_v3", world=4, tp=2, ep=2),
    Case("gpt_oss tp2 x ep2", "gpt_oss", world=4, tp=2, ep=2),
)


def case(name: str) -> Case:
    """The case called ``name`` (see :data:`CASES`)."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}; cases: {[c.name for c in CASES]}")


def _registry_config(model: str) -> Any:
    """torchtitan's own debug-flavour ``Trainer.Config`` for ``model``, with fewer layers and experts."""
    if model == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel

        cfg = llama3_debugmodel()
        cfg.model_spec.model.layers = cfg.model_spec.model.layers[:1]
    elif model == "qwen3":
        from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

        cfg = qwen3_debugmodel()
        cfg.model_spec.model.layers = cfg.model_spec.model.layers[:1]
    elif model == "qwen3_moe":
        import torchtitan.models.qwen3 as qwen3
        from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

        cfg = qwen3_moe_debug()
        mc = cfg.model_spec.model
        mc.layers = qwen3._build_qwen3_moe_layers(
            n_layers=1, dim=mc.dim, n_heads=16, n_kv_heads=8, head_dim=128, moe_hidden_dim=64, num_experts=8,
            top_k=2, attn_backend="flex", moe_comm_backend="standard", rope=mc.layers[0].attention.rope)
    elif model == "deepseek_v3":
        import torchtitan.models.deepseek_v3 as deepseek_v3
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

        cfg = deepseek_v3_debugmodel()
        mc = cfg.model_spec.model
        mc.layers = deepseek_v3._build_dsv3_layers(  # one dense layer, one MoE layer
            n_layers=2, n_dense_layers=1, dim=mc.dim, n_heads=4, q_lora_rank=0, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, mscale=0.70, dense_hidden_dim=128,
            moe_hidden_dim=64, num_experts=8, num_shared_experts=2, router_top_k=3, router_score_func="softmax",
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=mc.layers[0].attention.rope)
    elif model == "gpt_oss":
        import torchtitan.models.gpt_oss as gpt_oss
        from torchtitan.models.gpt_oss.config_registry import gpt_oss_debugmodel_flex

        cfg = gpt_oss_debugmodel_flex()
        mc = cfg.model_spec.model
        mc.layers = gpt_oss._build_gptoss_layers(
            dim=mc.dim, n_layers=2, hidden_dim=64, num_experts=8, top_k=4, load_balance_coeff=1e-3,
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=mc.layers[0].attention.rope)
    else:
        raise KeyError(model)
    return cfg


def trainer_config(c: Case, *, checking: bool, world: int | None = None) -> Any:
    """The ``Trainer.Config`` of case ``c``: spmd_types backend, checking on or off, tiny batch."""
    load()
    cfg = _registry_config(c.model)
    world = c.world if world is None else world
    p = cfg.parallelism
    p.spmd_backend = "spmd_types"
    p.tensor_parallel_degree = c.tp if world > 1 else 1
    p.expert_parallel_degree = c.ep if world > 1 else 1
    p.enable_sequence_parallel = c.sp
    p.data_parallel_shard_degree = -1
    cfg.debug.spmd_typechecking = checking
    # what torchtitan's own spmd_types test recipes do when checking is on
    cfg.activation_checkpoint = None
    cfg.compile.enable = False
    cfg.loss.num_chunks = 2  # the chunked loss's per-chunk backward, twice rather than eight times
    t = cfg.training
    t.seq_len, t.local_batch_size = SEQ_LEN, LOCAL_BATCH
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


def build(c: Case, *, checking: bool, world: int, simulated: bool = False) -> Built:
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

    cfg = trainer_config(c, checking=checking, world=world)
    parallel_dims = ParallelDims.from_config(cfg.parallelism, world)
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    spec = cfg.model_spec
    spec.model.update_from_config(config=cfg)
    with _outside_local_mode():
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

    with _outside_local_mode():  # a plain op under the mode makes one value per rank of each rank's value
        copies = {r: value.clone() for r in local_tensor_mode().ranks}
    return rank_map(copies.__getitem__)


# ---------------------------------------------------------------------------
# Environments and one training step


@contextlib.contextmanager
def environment(env: str, world: int) -> Iterator[None]:
    """A fake process group of ``world`` ranks; ``env="local"`` also simulates every rank (``LocalTensorMode``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if env not in ("fake", "local"):
        raise ValueError(f"env must be 'fake' or 'local', got {env!r}")
    load()
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with contextlib.ExitStack() as stack:
            if env == "local":
                from torch.distributed._local_tensor import LocalTensorMode

                _register_simulator_functions()
                stack.enter_context(_ranks_read_per_rank())
                stack.enter_context(LocalTensorMode(world))
            yield
    finally:
        set_spmd_meshes(dense_mesh=None, sparse_mesh=None)
        if dist.is_initialized():
            dist.destroy_process_group()


class _SimulatedDist(types.ModuleType):
    """``torch.distributed`` as one simulated rank's code sees it: ``get_rank`` answers per rank.

    Under ``LocalTensorMode`` every simulated rank runs in this one process,
    whose fake process group says rank 0; ``get_rank(group)`` here returns a
    per-rank int (each rank's index in its group, as torch's simulator lays
    groups out), so code that slices by its rank slices right on every rank.
    """

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    def __getattr__(self, name: str) -> Any:
        import torch.distributed as dist

        return getattr(dist, name)

    @staticmethod
    def get_rank(group: Any = None) -> Any:
        import torch.distributed as dist
        from torch.distributed._local_tensor import LocalIntNode, local_tensor_mode
        from torch.distributed._local_tensor._c10d import _prepare_collective_groups

        mode = local_tensor_mode()
        if mode is None:
            return dist.get_rank(group)
        if group is None:
            return torch.SymInt(LocalIntNode({r: r for r in mode.ranks}))
        ranks, group_offsets, _ = _prepare_collective_groups(group)
        index = {offset + r: i for offset in group_offsets for i, r in enumerate(ranks)}
        return torch.SymInt(LocalIntNode({r: index[r] for r in mode.ranks}))


def _per_rank(op: Callable[..., int]) -> Callable[..., Any]:
    """``op`` (``min`` or ``max`` of ints) taken on each simulated rank when an argument is a per-rank int."""
    def on_each_rank(*args: Any) -> Any:
        from torch.distributed._local_tensor import LocalIntNode, _int_on_rank, local_tensor_mode

        mode = local_tensor_mode()
        if mode is None or not any(isinstance(a, torch.SymInt) for a in args):
            return op(*args)
        nodes = [a.node if isinstance(a, torch.SymInt) else a for a in args]
        return torch.SymInt(LocalIntNode({r: op(_int_on_rank(n, r) for n in nodes) for r in mode.ranks}))

    return on_each_rank


# torchtitan's modules that read their rank with ``dist.get_rank(group)`` on the step's path: the
# vocab-parallel Embedding (vocab offset) and the loss-parallel cross entropy (vocab bounds, with
# ``min``/``max`` of the rank-dependent ints, which must be taken rank by rank)
_READS_RANK = {
    "torchtitan.models.common.embedding": {"dist": _SimulatedDist()},
    "torchtitan.components.loss": {"dist": _SimulatedDist(), "min": _per_rank(min), "max": _per_rank(max)},
}


@contextlib.contextmanager
def _ranks_read_per_rank() -> Iterator[None]:
    """For the simulated ranks, the modules in :data:`_READS_RANK` see their own rank on each rank."""
    saved: list[tuple[Any, str, Any]] = []
    for name, names in _READS_RANK.items():
        module = importlib.import_module(name)
        for attr, value in names.items():
            saved.append((module, attr, module.__dict__.get(attr, _ABSENT)))
            setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in saved:
            if value is _ABSENT:
                delattr(module, attr)
            else:
                setattr(module, attr, value)


_ABSENT = object()


def _register_simulator_functions() -> None:
    """Keep the simulator's own bookkeeping out of the checker's way.

    ``LocalTensor.contiguous`` runs the autograd Function ``_LocalContiguous``,
    which keeps its input's type (torchtitan calls ``.contiguous()`` on typed
    activations, e.g. when splitting fused QKV): register it so. And
    ``LocalTensor.tolist`` (the MoE split sizes) compares and converts the
    ranks' plain, untyped values: that work is not the program's, so it runs
    unchecked (a Python method of the subclass, it never reaches the checker as
    one ``tolist`` call anyway). And a per-rank int (``LocalIntNode``: the MoE
    token exchange makes tensors whose length differs per rank) holds concrete
    values, so it has a hint; torch 2.13 lacks ``has_hint`` and indexing such a
    tensor fails without it.
    """
    import spmd_types as spmd
    from spmd_types.runtime import get_partition_spec
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor, _LocalContiguous

    if getattr(_LocalContiguous, "typecheck_forward", None) is not None:
        return
    if not hasattr(LocalIntNode, "has_hint"):
        LocalIntNode.has_hint = lambda self: True
    tolist = LocalTensor.tolist

    def unchecked_tolist(self: Any) -> list[Any]:
        with spmd.no_typecheck():
            return tolist(self)

    LocalTensor.tolist = unchecked_tolist

    def typecheck_forward(x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        with spmd.no_typecheck():
            out = _LocalContiguous.apply(x, memory_format)
        spmd.assert_type(out, dict(spmd.get_local_type(x)), get_partition_spec(x))
        return out

    _LocalContiguous.typecheck_forward = staticmethod(typecheck_forward)
    spmd.register_autograd_function(_LocalContiguous)


def global_batch(vocab: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and positions for ``rows`` sequences; every row holds the same two documents."""
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, vocab, (rows, SEQ_LEN), generator=g)
    labels = torch.randint(0, vocab, (rows, SEQ_LEN), generator=g)
    half = SEQ_LEN // 2
    positions = torch.cat([torch.arange(half), torch.arange(SEQ_LEN - half)]).repeat(rows, 1)
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
    if env == "fake":
        return global_tensor[rows(0)].clone()
    from torch.distributed._local_tensor import local_tensor_mode, rank_map

    with _outside_local_mode():
        values = {r: global_tensor[rows(r)].clone() for r in local_tensor_mode().ranks}
    return rank_map(values.__getitem__)


def train_step(b: Built, env: str, global_rows: int) -> torch.Tensor:
    """The trainer's step for one microbatch of a ``global_rows``-row batch; returns the loss.

    Each rank reads its data-parallel share of the rows (``LOCAL_BATCH`` rows
    per dp rank); inputs are annotated, then forward, loss and backward.

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
    with _outside_local_mode():  # one plain global batch, not one per simulated rank
        tokens, labels, positions = global_batch(vocab, global_rows)
    rows = _dp_rows(b) if pd.world_size > 1 else (lambda r: slice(None))
    inputs, labels = _per_rank(tokens, rows, env), _per_rank(labels, rows, env)
    positions = positions[rows(0)].clone()  # the same on every rank: one plain tensor
    with _outside_local_mode():
        masks = b.model.get_attention_masks(positions=positions)
    extra = {"positions": positions, "attention_masks": masks}
    local_valid = (labels != IGNORE_INDEX).sum()
    global_valid = dist_utils.dist_sum_tensor(local_valid, pd.get_mesh("batch")) if pd.dp_enabled else local_valid
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
    """``{rank: plain tensor}``: every simulated rank's value of a LocalTensor, or rank 0's of a plain one."""
    from torch.distributed._local_tensor import LocalTensor

    with _outside_local_mode(), torch._C.DisableTorchFunctionSubclass():
        if isinstance(t, LocalTensor):
            return {r: v.detach() for r, v in t._local_tensors.items()}
        return {0: t.detach()}


def run(c: Case, env: str, *, checking: bool = True, mistake: Callable[[], ContextManager] | None = None,
        one_device: bool = False) -> Step:
    """One training step of case ``c`` on ``c.world`` ranks in ``env`` ("fake" or "local").

    ``mistake`` (a context manager factory, see :data:`MISTAKES`) is entered
    around building, so the sharding configs torchtitan sets carry the planted
    change. ``one_device`` (simulated ranks only) also reassembles weights,
    gradients and loss into their one-device values (the ``global_*`` fields).
    """
    if one_device and env != "local":
        raise ValueError("one_device needs the simulated ranks (env='local')")
    with environment(env, c.world), (mistake() if mistake is not None else contextlib.nullcontext()):
        b = build(c, checking=checking, world=c.world, simulated=env == "local")
        loss = train_step(b, env, c.dp * LOCAL_BATCH)
        params = dict(b.model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and p.grad is None]
        if missing:
            raise AssertionError(f"{c.name}: parameters without a gradient: {missing}")
        step = Step(rank_values(loss), {n: rank_values(p.grad) for n, p in params.items()})
        if one_device:
            layouts = state_layouts(b.model)
            step.global_weights = reassemble(b, {n: p.detach() for n, p in params.items()}, layouts)
            step.global_grads = reassemble(b, {n: p.grad for n, p in params.items()},
                                           {n: gradient_layout(layouts[n]) for n in params})
            step.global_loss = reassemble(b, {"loss": loss.detach()}, {"loss": loss_layout()})["loss"]
        return step


def run_one_device(c: Case, weights: dict[str, torch.Tensor]) -> Step:
    """The same model on one device (world 1, checking off), from ``weights`` (one global tensor per parameter)."""
    with environment("fake", 1):
        b = build(c, checking=False, world=1)
        with torch.no_grad():
            for name, p in b.model.named_parameters():
                p.copy_(weights[name])
        loss = train_step(b, "fake", c.dp * LOCAL_BATCH)
        return Step(rank_values(loss), {n: rank_values(p.grad) for n, p in b.model.named_parameters()})


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
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import SpmdLayout

    return SpmdLayout({a: spmd.P if t == spmd.R else t for a, t in layout.axis_types.items()}, layout.partition_spec)


def loss_layout() -> Any:
    """The loss's layout, as torchtitan's loss asserts it: P over dp and cp, I over tp."""
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName, SpmdLayout

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
