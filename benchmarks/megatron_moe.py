"""Megatron-core mixture of experts: the cost of typechecking one step (issue 16).

Run: python benchmarks/megatron_moe.py   (needs megatron-core; prints one table)

An MoE GPTModel (local spec, SequentialMLP experts, top-2 router with the aux loss; 4 layers, hidden
128, 8 experts) at tp=2 with sequence parallelism, ep=2 on a fake process group of 8 ranks (edp=2):
one forward+backward untyped and typed (``spmd.typecheck()`` with the adapter's registrations, the
expert mesh inside every MoE layer), for each token dispatcher. Collectives on a fake group do no
work, so only Python, autograd and the checker are timed. Medians of repeats, the two variants
interleaved in each repeat, CPU time (``time.process_time``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from typing import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))

import torch  # noqa: E402

import spmd_types as spmd  # noqa: E402

LAYERS, HIDDEN, HEADS, EXPERTS, SEQ, VOCAB, BATCH = 4, 128, 8, 8, 64, 256, 2


def _patch() -> None:
    import _megatron_moe_support as S
    from _megatron_support import Patcher

    S.accommodate_moe_cpu(Patcher())


def build_steps(dispatcher: str) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(untyped step, typed step, reset before a step, teardown) for the MoE GPTModel with ``dispatcher``.

    Also used by ``benchmarks/step_breakdown.py --moe``. Call ``_patch()`` once first.
    """
    import _megatron_moe_support as S
    from conftest import fake_world
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from spmd_types import megatron as spmd_megatron

    fake_world(8)
    S.forget_aux_losses()
    S.init_moe(2, 2, 2)
    spmd_megatron.register()
    config = S.moe_config(2, 2, 2, dispatcher, num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                          num_moe_experts=EXPERTS)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    norm = S.sp_layer_norm_class()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
    spec = TransformerBlockSubmodules(layer_specs=[spec] * LAYERS, layer_norm=norm)
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)

    # Two models built alike: typing is in place, so the untyped run gets one that was never typed.
    plain_model, model = build(), build()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    mesh = spmd_megatron.mesh()
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd_megatron.type_parameters(model)

    def untyped() -> None:
        plain_model(tokens, positions, mask, labels=tokens).sum().backward()

    def typed() -> None:
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            t = spmd.assert_type(tokens.clone(), {"dp": spmd.V, "tp": spmd.I})
            p = spmd.assert_type(positions.clone(), {"dp": spmd.V, "tp": spmd.I})
            model(t, p, mask, labels=t).sum().backward()

    def reset() -> None:
        model.zero_grad(set_to_none=True)
        plain_model.zero_grad(set_to_none=True)
        S.clear_aux_losses_tracker()

    return untyped, typed, reset, ps.destroy_model_parallel


def one_dispatcher(dispatcher: str, repeats: int) -> tuple[float, float]:
    """Median CPU seconds of the untyped and the typed step, interleaved (the order alternating)."""
    untyped, typed, reset, teardown = build_steps(dispatcher)
    times: dict[str, list[float]] = {"untyped": [], "typed": []}
    for fn in (untyped, typed):  # warm-up
        reset()
        fn()
    for i in range(repeats):
        for name, fn in (("untyped", untyped), ("typed", typed))[:: 1 if i % 2 == 0 else -1]:  # order alternates
            reset()
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    teardown()
    return statistics.median(times["untyped"]), statistics.median(times["typed"])


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _patch()
    repeats = int(os.environ.get("REPEATS", "7"))
    print(f"MoE GPTModel ({LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts, top-2, aux loss), tp=2 + SP, ep=2, "
          f"edp=2 on a fake group of 8; one forward+backward, CPU ms, median of {repeats}, interleaved; "
          f"torch {torch.__version__}")
    print(f"{'dispatcher':>10}  {'untyped ms':>10}  {'typed ms':>9}  {'typed/untyped':>13}")
    for dispatcher in ("allgather", "alltoall"):
        u, t = one_dispatcher(dispatcher, repeats)
        print(f"{dispatcher:>10}  {u * 1e3:10.1f}  {t * 1e3:9.1f}  {t / u:13.2f}")


if __name__ == "__main__":
    main()
