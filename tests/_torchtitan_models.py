"""torchtitan 0.3.0's debug-size model configs, made small with each model's own builders (see ``_torchtitan_support``).

One entry per model torchtitan ships with spmd annotations and a debug-size
config. Each starts from the model's own ``config_registry`` debug flavour
(the ``Trainer.Config`` its users run) and keeps its parallelism, sharding and
layer code; only sizes shrink (fewer layers and experts, a smaller vocabulary),
so a step runs in seconds on CPU.

Not here, with the reason (``tests/test_torchtitan_fsdp.py`` proves each):
qwen3_5 (its Gated DeltaNet layers run flash-linear-attention's Triton
kernels, which need a GPU; the module imports ``fla`` at import time).
"""

from __future__ import annotations

from typing import Any

# Decoder models (text in, next-token loss out), and which of them route tokens to experts.
DECODERS = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_k2_7", "muse_glimmer")
MOE = ("qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_k2_7")
# parameters a text-only step leaves without a gradient, by the prefix of their names
UNUSED = {"kimi_k2_7": ("vision_encoder.",)}


def registry_config(model: str) -> Any:
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
    elif model == "kimi_k2_7":
        from torchtitan.models.kimi_k2_7.config_registry import kimi_k2_5_debugmodel

        cfg = kimi_k2_5_debugmodel()
        mc = cfg.model_spec.model
        mc.layers = mc.layers[:2]  # its dense layer and its first MoE layer (MLA attention in both)
        # The MoonViT tower stays (its sharding config shapes the decoder's under SP); the harness's batches are
        # text only, so the tower's parameters get no gradient (UNUSED)
    elif model == "muse_glimmer":
        from torchtitan.models.muse_glimmer.config_registry import muse_glimmer_debugmodel

        cfg = muse_glimmer_debugmodel()
        cfg.model_spec.model.layers = cfg.model_spec.model.layers[:1]
    else:
        raise KeyError(model)
    return cfg
