"""Planted sharding-config mistakes in torchtitan 0.3.0's models (``tests/test_torchtitan.py``).

Each is a one-line change to a function torchtitan calls while it builds its
sharding configs, planted by monkeypatching that function (torchtitan's files
are never edited), and run on the fake process group with checking on (see
``_torchtitan_support``). The mistakes only FSDP, HSDP or context parallelism
expose are in ``_torchtitan_fsdp_mistakes.py``.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

from _torchtitan_support import case, run


@contextlib.contextmanager
def _patched(module_name: str, attr: str, replacement: Callable[[Callable], Callable]) -> Iterator[None]:
    """``module.attr = replacement(original)`` inside the block."""
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, replacement(original))
    try:
        yield
    finally:
        setattr(module, attr, original)


def _layout(**types_by_axis: Any) -> Any:
    from torchtitan.distributed.parallel_dims import MeshAxisName, SpmdLayout

    return SpmdLayout({MeshAxisName(a): t for a, t in types_by_axis.items()})


def norm_weight_invariant_under_sp() -> ContextManager:
    """``norm_config``: the norm weight is ``I`` on tp under sequence parallelism (it must be ``R``:
    its gradient is partial over the sequence shards)."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def norm_config(*, enable_sp: bool) -> Any:
            cfg = original(enable_sp=enable_sp)
            cfg.state_shardings["weight"] = _layout(dp=spmd.R, cp=spmd.R, tp=spmd.I)
            return cfg
        return norm_config

    return _patched("torchtitan.models.llama3.sharding", "norm_config", replace)


def rowwise_output_invariant() -> ContextManager:
    """``rowwise_config``: a row-parallel linear's output declared ``I`` on tp instead of ``P``."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def rowwise_config(*, output_sp: bool = False) -> Any:
            cfg = original(output_sp=output_sp)
            cfg.out_src_shardings = _layout(dp=spmd.S(0), cp=spmd.S(1), tp=spmd.I)
            return cfg
        return rowwise_config

    return _patched("torchtitan.models.common.decoder_sharding", "rowwise_config", replace)


def embedding_output_replicated() -> ContextManager:
    """``set_decoder_sharding_config``: the vocab-parallel embedding's output claimed ``R`` on tp
    (each rank holds only its vocab shard's rows: it is ``P``)."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def set_decoder_sharding_config(config: Any, *, enable_sp: bool) -> None:
            original(config, enable_sp=enable_sp)
            config.tok_embeddings.sharding_config.out_src_shardings = _layout(dp=spmd.S(0), cp=spmd.S(1), tp=spmd.R)
        return set_decoder_sharding_config

    return _patched("torchtitan.models.llama3.sharding", "set_decoder_sharding_config", replace)


def ffn_skips_all_gather() -> ContextManager:
    """``set_dense_ffn_sharding``: the FFN keeps its sequence-sharded input (no all-gather to ``R``)."""
    def replace(original: Callable) -> Callable:
        def set_dense_ffn_sharding(feed_forward_cfg: Any, *, attn_x_layout: Any, enable_sp: bool) -> None:
            original(feed_forward_cfg, attn_x_layout=attn_x_layout, enable_sp=enable_sp)
            feed_forward_cfg.sharding_config.in_dst_shardings = {"x": attn_x_layout}
        return set_dense_ffn_sharding

    return _patched("torchtitan.models.llama3.sharding", "set_dense_ffn_sharding", replace)


def tokens_per_expert_replicated() -> ContextManager:
    """``_tokens_per_expert_placement``: the per-expert token counts claimed ``R`` (each rank counts its
    own tokens: they are ``P``)."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def _tokens_per_expert_placement(*, enable_ep: bool) -> Any:
            return _layout(dp=spmd.R, cp=spmd.R, tp=spmd.R)
        return _tokens_per_expert_placement

    return _patched("torchtitan.models.common.moe_sharding", "_tokens_per_expert_placement", replace)


def lm_head_logits_replicated() -> ContextManager:
    """``set_decoder_sharding_config``: the lm_head's logits claimed ``R`` on tp (the lm_head is
    column-parallel over the vocabulary: they are ``S(-1)``)."""
    import spmd_types as spmd

    def replace(original: Callable) -> Callable:
        def set_decoder_sharding_config(config: Any, *, enable_sp: bool) -> None:
            original(config, enable_sp=enable_sp)
            replicated = _layout(dp=spmd.S(0), cp=spmd.S(1), tp=spmd.R)
            config.lm_head.sharding_config.out_src_shardings = replicated
            config.lm_head.sharding_config.out_dst_shardings = replicated
        return set_decoder_sharding_config

    return _patched("torchtitan.models.llama3.sharding", "set_decoder_sharding_config", replace)


@dataclass(frozen=True)
class Mistake:
    """A planted mistake, the case it is planted in, and the torchtitan lines its error points at.

    ``lines`` (``path inside torchtitan:line``, torchtitan 0.3.0) are the
    model-code line where the mistake surfaces and the innermost torchtitan
    line of the error, as the peer's ``SpmdTypeError`` traceback has them.
    """

    name: str
    plant: Callable[[], ContextManager]
    case: str
    lines: tuple[str, ...]


_SP = "llama3 dp4 x tp2 (SP)"
MISTAKES: tuple[Mistake, ...] = (
    # attention_norm(x): RMSNorm of the V (sequence-sharded) activation with an I weight
    Mistake("norm weight I under SP", norm_weight_invariant_under_sp, _SP,
            ("models/llama3/model.py:48", "protocols/module.py:291")),
    # wo's output checked against out_src_shardings (spmd.assert_type in _redistribute_outputs)
    Mistake("row-wise output declared I, not P", rowwise_output_invariant, _SP,
            ("models/common/attention.py:1010", "protocols/module.py:665")),
    # tok_embeddings(tokens): the local_map region's output checked against its declared type
    Mistake("embedding output claimed replicated", embedding_output_replicated, _SP,
            ("models/common/decoder.py:235", "protocols/module.py:291")),
    # self.w1(x) on the sequence-sharded x: no sharding strategy for the column-parallel linear
    Mistake("FFN skips its all-gather", ffn_skips_all_gather, _SP,
            ("models/common/feed_forward.py:54", "protocols/module.py:291")),
    # tokens_per_expert_E.add_(counts): the R-declared buffer takes P counts
    Mistake("tokens-per-expert counts claimed replicated", tokens_per_expert_replicated, "qwen3-MoE tp2 x ep2",
            ("models/common/moe.py:446",)),
    # logits = lm_head(h_chunk): the vocab-sharded logits checked against out_src_shardings
    Mistake("lm_head logits claimed replicated", lm_head_logits_replicated, _SP,
            ("components/loss.py:748", "protocols/module.py:665")),
)


def mistake(name: str) -> Mistake:
    """The planted mistake called ``name`` (see :data:`MISTAKES`)."""
    for m in MISTAKES:
        if m.name == name:
            return m
    raise KeyError(f"no mistake {name!r}; mistakes: {[m.name for m in MISTAKES]}")


def torchtitan_frames(exc: BaseException) -> list[str]:
    """The torchtitan source lines in ``exc``'s traceback, outermost first, as ``models/common/x.py:123``."""
    import traceback

    marker = "/torchtitan/"
    return [f"{f.filename.split(marker, 1)[1]}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)
            if marker in f.filename]


def plant(m: Mistake, compile_backend: str | None = None) -> BaseException:
    """Run the mistake's case on the fake group with checking on; returns the exception it raised.

    Raises ``AssertionError`` if the step ran through. ``compile_backend``: torchtitan's per-block compile.
    """
    try:
        run(case(m.case), "fake", mistake=m.plant, compile_backend=compile_backend)
    except Exception as exc:  # the caller checks the kind: this returns whatever was raised
        return exc
    raise AssertionError(f"planted mistake {m.name!r} ran through: no error")
