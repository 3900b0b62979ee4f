"""Sharding mistakes that only FSDP, HSDP or context parallelism expose, planted in torchtitan 0.3.0's configs.

Each is a one-line change to a function torchtitan calls while it builds its
sharding configs or annotates its inputs, planted by monkeypatching that
function in the test (torchtitan's files are never edited). Each is harmless
without the parallelism that exposes it: a type on the dp axis means nothing
while dp is 1, a declaration about the cp axis nothing while cp is 1. With it,
the mistake is caught at the torchtitan line: by this package's checker, or by
FSDP2's own check of the types it reads (torch 2.14).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import _torchtitan_fsdp as F
import _torchtitan_mistakes as tm
import _torchtitan_support as tt


def _layout(**types_by_axis: Any) -> Any:
    from torchtitan.distributed.parallel_dims import MeshAxisName, SpmdLayout

    return SpmdLayout({MeshAxisName(a): t for a, t in types_by_axis.items()})


def norm_weight_varying_on_dp() -> ContextManager:
    """``norm_config``: the norm weight typed ``V`` on dp (each data-parallel rank its own weight) instead of ``R``."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def norm_config(*, enable_sp: bool) -> Any:
            cfg = original(enable_sp=enable_sp)
            cfg.state_shardings["weight"] = _layout(dp=spmd.V, cp=spmd.R, tp=spmd.R if enable_sp else spmd.I)
            return cfg
        return norm_config

    return tm._patched("torchtitan.models.llama3.sharding", "norm_config", replace)


def embedding_invariant_on_dp() -> ContextManager:
    """``set_decoder_sharding_config``: the embedding table typed ``I`` on dp instead of ``R`` (its gradient
    would be taken as already summed over the data-parallel ranks)."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def set_decoder_sharding_config(config: Any, *, enable_sp: bool) -> None:
            original(config, enable_sp=enable_sp)
            config.tok_embeddings.sharding_config.state_shardings["weight"] = _layout(dp=spmd.I, cp=spmd.R,
                                                                                      tp=spmd.S(0))
        return set_decoder_sharding_config

    return tm._patched("torchtitan.models.llama3.sharding", "set_decoder_sharding_config", replace)


def experts_varying_on_efsdp() -> ContextManager:
    """``expert_param_placement_sparse``: routed-expert weights typed ``V`` on efsdp (the experts' FSDP axis)."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def expert_param_placement_sparse() -> Any:
            return _layout(dp_replicate=spmd.R, efsdp=spmd.V, ep=spmd.S(0))
        return expert_param_placement_sparse

    return tm._patched("torchtitan.models.common.moe_sharding", "expert_param_placement_sparse", replace)


def _input_types(**changes: dict) -> ContextManager:
    """``annotate_input_spmd_types`` with ``changes`` (``inputs``/``labels``/``positions`` -> axis -> type)."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def annotate_input_spmd_types(parallel_dims: Any, inputs: Any, labels: Any, extra_kwargs: dict) -> Any:
            from torchtitan.distributed.parallel_dims import MeshAxisName
            from torchtitan.distributed.spmd_types import set_current_spmd_mesh

            dp, cp, tp = MeshAxisName.DP, MeshAxisName.CP, MeshAxisName.TP
            types = {"inputs": {dp: spmd.S(0), cp: spmd.S(1), tp: spmd.R},
                     "labels": {dp: spmd.S(0), cp: spmd.S(1), tp: spmd.I},
                     "positions": {dp: spmd.S(0), cp: spmd.S(1), tp: spmd.R}}
            for name, per_axis in changes.items():
                types[name] = {**types[name], **{MeshAxisName(a): t for a, t in per_axis.items()}}
            values = {"inputs": inputs, "labels": labels, "positions": extra_kwargs.get("positions")}
            with set_current_spmd_mesh(parallel_dims.spmd_dense_mesh()):
                for name, t in types.items():
                    if values[name] is not None:
                        spmd.assert_type(values[name], t)
            return inputs, labels, extra_kwargs
        return annotate_input_spmd_types

    return tm._patched("torchtitan.distributed.spmd_types", "annotate_input_spmd_types", replace)


def positions_replicated_on_cp() -> ContextManager:
    """``annotate_input_spmd_types``: the positions (RoPE's offsets) typed ``R`` on cp, as if CP left them whole."""
    import spmd_types as spmd

    return _input_types(positions={"cp": spmd.R})


def batch_replicated_on_dp() -> ContextManager:
    """``annotate_input_spmd_types``: the tokens typed ``R`` on dp, as if every data-parallel rank read the same rows."""
    import spmd_types as spmd

    return _input_types(inputs={"dp": spmd.R}, positions={"dp": spmd.R})


def rope_cache_sharded_on_cp() -> ContextManager:
    """``set_gqa_attention_sharding``: the RoPE table (indexed by position) sharded over cp like the activations,
    instead of replicated (a cp rank's tokens can sit anywhere in the sequence)."""
    from torchtitan.protocols.sharding import ShardingConfig

    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def set_gqa_attention_sharding(attention_cfg: Any, *, enable_sp: bool) -> None:
            original(attention_cfg, enable_sp=enable_sp)
            cache = _layout(dp=spmd.R, cp=spmd.S(0), tp=spmd.R)
            attention_cfg.rope.sharding_config = ShardingConfig(state_shardings={"cache": cache})
        return set_gqa_attention_sharding

    return tm._patched("torchtitan.models.llama3.sharding", "set_gqa_attention_sharding", replace)


@dataclass(frozen=True)
class Mistake:
    """A planted mistake, the case that exposes it, a case where it stays hidden, and its error.

    ``error`` is the exception's type and the first line of its message;
    ``lines`` (``path inside torchtitan:line``, torchtitan 0.3.0) are the
    torchtitan frames of its traceback that name where it shows.
    """

    name: str
    plant: Callable[[], ContextManager]
    case: str
    hidden_in: str
    error: tuple[type, str]
    lines: tuple[str, ...]


_FSDP, _HSDP, _CP = "llama3 fsdp4 x tp2", "llama3 hsdp2x2 x tp2", "llama3 fsdp2 x cp2 x tp2"
_TP_ONLY = "llama3 tp4 (no SP)"  # dp = 1: FSDP shards over one rank, and a dp type is dropped with the axis
_EP_ONE_EFSDP = tt.Case("qwen3_moe fsdp2 x ep2", "qwen3_moe", world=2, tp=1, ep=2)  # efsdp = 2 x 1 / 2 = 1


def _fsdp_error(axis: str, param: str, got: str) -> tuple[type, str]:
    return ValueError, (f"Expected spmd.R on FSDP DP axis {axis} for parameter '{param}' but got {got}. FSDP "
                        "requires DP parameters to be R since it handles the DP gradient reduction.")


def _mistakes() -> tuple[Mistake, ...]:
    from spmd_types import SpmdTypeError

    return (
        # torchtitan's fully_shard of the first transformer block: FSDP reads the norm weight's V on dp
        Mistake("norm weight V on dp", norm_weight_varying_on_dp, _FSDP, _TP_ONLY, _fsdp_error("dp", "weight", "V"),
                ("models/llama3/parallelize.py:80", "distributed/fsdp.py:304")),
        # fully_shard(model.tok_embeddings): the table's I on dp, under HSDP (dp = dp_replicate x dp_shard)
        Mistake("embedding I on dp (HSDP)", embedding_invariant_on_dp, _HSDP, _TP_ONLY,
                _fsdp_error("dp", "weight", "I"), ("models/llama3/parallelize.py:80", "distributed/fsdp.py:195")),
        # fully_shard of the MoE block with the experts' placement fn; efsdp covers the ranks dp covers here,
        # and FSDP names the axis by its region
        Mistake("routed experts V on efsdp (EP)", experts_varying_on_efsdp, "qwen3_moe fsdp4 x tp2 x ep2",
                _EP_ONE_EFSDP.name, _fsdp_error("dp", "w1_EFD", "V"),
                ("models/qwen3/parallelize.py:95", "distributed/fsdp.py:297")),
        # tok_embeddings' input checked against its in_src_shardings (S(0) on dp)
        Mistake("tokens R on dp", batch_replicated_on_dp, _FSDP, _TP_ONLY,
                (SpmdTypeError, "Type assertion failed: the tensor is R on axis 'dp', and the assertion says S(0)."),
                ("models/common/decoder.py:235", "protocols/module.py:569")),
        # the RoPE table gathered at R positions: its local_map output declared S(1) on cp
        Mistake("positions R on cp (CP)", positions_replicated_on_cp, _CP, _FSDP,
                (SpmdTypeError, "local_map: output 0 of _reshape_for_broadcast is R on axis 'cp', and out_types "
                                "declares S(1)."),
                ("models/common/attention.py:993", "models/common/rope.py:252")),
    )


MISTAKES: tuple[Mistake, ...] = _mistakes()


def mistake(name: str) -> Mistake:
    for m in MISTAKES:
        if m.name == name:
            return m
    raise KeyError(f"no mistake {name!r}; mistakes: {[m.name for m in MISTAKES]}")


def _case(name: str) -> tt.Case:
    if name == _EP_ONE_EFSDP.name:
        return _EP_ONE_EFSDP
    try:
        return F.matrix_case(name)
    except KeyError:
        return tt.case(name)


def plant(m: Mistake, where: str | None = None) -> BaseException | None:
    """Run ``where`` (default the mistake's case) on the fake group with the mistake planted; what it raised, if anything."""
    try:
        tt.run(_case(where or m.case), "fake", mistake=m.plant)
    except Exception as exc:  # the caller checks the kind: this returns whatever was raised
        return exc
    return None
