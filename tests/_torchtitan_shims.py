"""CPU and simulator shims for running torchtitan 0.3.0 in these tests (see ``_torchtitan_support``).

Two kinds, both installed only by the tests that use them:

* import and CPU shims (:func:`load`): the heavy or CUDA-only modules torchtitan
  imports at module level are stubbed while it is imported, and the pieces
  that need a GPU or a newer torch are replaced by CPU equivalents;
* simulator shims (:func:`simulated_ranks`): what torch's ``LocalTensorMode``
  needs to run torchtitan's code for every rank in one process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import sys
import types
from typing import Any, Callable, ContextManager, Iterator

import torch

MODEL_PACKAGES = ("llama3", "qwen3", "deepseek_v3", "gpt_oss", "kimi_k2_7", "muse_glimmer")


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
    """tokenizers, datasets (HF), tensorboard (through torch's wrapper), triton, and where absent torchvision, PIL
    and einops."""
    def mod(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    datasets = mod("datasets", Dataset=_Unavailable, load_dataset=_Unavailable, __path__=[])
    triton_language = mod("triton.language")
    triton_language.__getattr__ = _module_getattr  # type: ignore[attr-defined]
    triton = mod("triton", language=triton_language, jit=_TritonStub(), __version__="0.0", __path__=[])
    triton.__getattr__ = _module_getattr  # type: ignore[attr-defined]
    # the multimodal data pipeline's image and video helpers (kimi_k2_7's and muse_glimmer's config registries
    # import it); the models' own code does not use them
    vision = {name: mod(name, __path__=[]) for name in (
        "torchvision", "torchvision.io", "torchvision.transforms", "torchvision.transforms.v2")}
    vision["torchvision.transforms.v2.functional"] = mod("torchvision.transforms.v2.functional")
    pil_image = mod("PIL.Image", Image=_Unavailable)
    vision.update({"PIL": mod("PIL", Image=pil_image, __path__=[]), "PIL.Image": pil_image})
    einops = {"einops": mod("einops", rearrange=_Unavailable, repeat=_Unavailable)}
    return {
        **{k: v for k, v in {**vision, **einops}.items() if importlib.util.find_spec(k.split(".")[0]) is None},
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
    * on torch 2.13 only, ``fully_shard`` is not applied (:func:`skip_fsdp`):
      its FSDP rejects plain parameters that carry spmd types when
      ``dp_mesh_dims`` is given; the reduction FSDP would do is done when
      gradients are reassembled. torch 2.14 reads the types, and FSDP is applied
      (on simulated ranks too; :func:`fsdp_skipped` leaves it out where asked).
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
    if not fsdp_reads_spmd_types():
        _set_fsdp(skip_fsdp)


def fsdp_reads_spmd_types() -> bool:
    """Whether this torch's FSDP2 builds its storage from spmd types (torch 2.14 on)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "_restore_spmd_types")


def _set_fsdp(fn: Callable) -> Callable:
    """Make ``fn`` the ``apply_fsdp_to_decoder`` every loaded model's parallelize calls; returns the one it replaced."""
    from torchtitan.distributed import fsdp

    current = sys.modules["torchtitan.models.llama3.parallelize"].apply_fsdp_to_decoder
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.models.") and getattr(module, "apply_fsdp_to_decoder", None) in (
                fsdp.apply_fsdp_to_decoder, skip_fsdp):
            module.apply_fsdp_to_decoder = fn
    return current


@contextlib.contextmanager
def fsdp_skipped() -> Iterator[None]:
    """``fully_shard`` left out inside the block (:func:`skip_fsdp`): the step then does FSDP's sum over dp.

    Under torch's bare ``LocalTensorMode`` FSDP's first all-gather fails to resize its storage
    (``tests/test_torchtitan_fsdp.py`` pins the error); ``simulate(ranks="local")`` and so
    ``check_equivalence`` run FSDP per simulated rank (``_equivalence_torchtitan.Options(fsdp=True)``).
    The checks without FSDP keep it out, on torch 2.14 as on 2.13.
    """
    load()
    previous = _set_fsdp(skip_fsdp)
    try:
        yield
    finally:
        _set_fsdp(previous)


def cpu_grouped_mm(self: Any, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts._grouped_mm`` in float32: CPU ``_grouped_mm`` in bfloat16 wants 16-byte strides, and
    gpt_oss would add its bfloat16 expert output to the float32 activations FSDP's bf16 policy does not cast here."""
    if torch.compiler.is_compiling():  # the fake kernel of _grouped_mm takes bfloat16 only: the same sum, dense
        return dense_grouped_mm(A.float(), B_t.float(), offs)
    return torch._grouped_mm(A.float(), B_t.float(), offs=offs)


def dense_grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``_grouped_mm(A, B_t, offs)`` without data-dependent shapes: every group's product, each row keeping its own.

    Rows ``offs[g-1] <= i < offs[g]`` belong to group ``g``; rows past the last offset are zeros.
    """
    rows = torch.arange(A.shape[0], device=A.device)
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    member = (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])  # [groups, rows]
    every = torch.einsum("rk,gkn->grn", A, B_t)
    return (every * member[..., None].to(A.dtype)).sum(0)


def skip_fsdp(model: torch.nn.Module, dp_mesh: Any, **kwargs: Any) -> None:
    """Stands for ``apply_fsdp_to_decoder``: records that FSDP was left out (see :func:`load`)."""
    model._fsdp_skipped_mesh = dp_mesh  # type: ignore[attr-defined]


def outside_local_mode() -> ContextManager:
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()


def cpu_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                       return_aux=None, kernel_options=None):
    """``flex_attention`` as dense math on CPU: softmax(q k^T * scale, masked by the block mask's mask_mod) v."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("cpu_flex_attention: score_mod is not used by the models under test")
    batch, heads, q_len, head_dim = q.shape
    with outside_local_mode():  # the mask is the same on every rank: one plain tensor
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


@contextlib.contextmanager
def simulated_ranks(world: int) -> Iterator[None]:
    """Every one of ``world`` ranks run in this process (``LocalTensorMode``), with the shims it needs."""
    from torch.distributed._local_tensor import LocalTensorMode

    with _ranks_read_per_rank(), _simulator_kept_out_of_the_checker(), LocalTensorMode(world):
        yield


@contextlib.contextmanager
def _simulator_kept_out_of_the_checker() -> Iterator[None]:
    """Keep the simulator's own bookkeeping out of the checker's way (undone on exit).

    ``LocalTensor.contiguous`` runs torch's autograd Function ``_LocalContiguous``,
    which the checker does not know; the copy keeps its input's type
    (torchtitan calls ``.contiguous()`` on typed activations, e.g. when
    splitting fused QKV), so it runs unchecked and the result gets the input's
    type. ``LocalTensor.tolist`` (the MoE split sizes) compares and converts
    the ranks' plain, untyped values: not the program's work, so it runs
    unchecked (a Python method of the subclass, it never reaches the checker as
    one ``tolist`` call anyway). And a per-rank int (``LocalIntNode``: the MoE
    token exchange makes tensors whose length differs per rank) holds concrete
    values, so it has a hint; torch 2.13 lacks ``has_hint`` and indexing such a
    tensor fails without it.
    """
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor

    import spmd_types as spmd

    contiguous, tolist = LocalTensor.contiguous, LocalTensor.tolist

    def typed_contiguous(self: Any, memory_format: torch.memory_format = torch.contiguous_format) -> Any:
        from spmd_types.runtime import get_partition_spec, has_local_type

        checking = spmd.is_type_checking()
        with spmd.no_typecheck():
            out = contiguous(self, memory_format)
        if checking and has_local_type(self):
            spmd.assert_type(out, dict(spmd.get_local_type(self)), get_partition_spec(self))
        return out

    def unchecked_tolist(self: Any) -> list[Any]:
        with spmd.no_typecheck():
            return tolist(self)

    added_hint = not hasattr(LocalIntNode, "has_hint")
    LocalTensor.contiguous, LocalTensor.tolist = typed_contiguous, unchecked_tolist
    if added_hint:
        LocalIntNode.has_hint = lambda self: True
    try:
        yield
    finally:
        LocalTensor.contiguous, LocalTensor.tolist = contiguous, tolist
        if added_hint:
            del LocalIntNode.has_hint
