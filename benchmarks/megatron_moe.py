"""Megatron-core mixture of experts: the cost of typechecking one step (issue 16).

Run: python benchmarks/megatron_moe.py   (needs megatron-core; prints one table)

An MoE GPTModel (local spec, SequentialMLP experts, top-2 router with the aux loss; 4 layers, hidden
128, 8 experts) at tp=2 with sequence parallelism, ep=2 on a fake process group of 8 ranks (edp=2):
one forward+backward untyped, typed (``spmd.typecheck()`` with the adapter's registrations, the
expert mesh inside every MoE layer) and as the floor (the untyped model with its parameters and inputs
the least subclass any typed tensor must be, ``benchmarks/subclass_floor.py``: what no checker can
avoid), for each token dispatcher. Collectives on a fake group do no
work, so only Python, autograd and the checker are timed. Medians of repeats, the three variants
interleaved in each repeat, CPU time (``time.process_time``).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
import types
import warnings
from typing import Callable, NamedTuple

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


def _load_sibling(name: str) -> types.ModuleType:
    """A module of this folder, loaded by its path (the folder is off ``sys.path``: its megatron.py would shadow
    megatron-core, a namespace package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class Steps(NamedTuple):
    """The MoE step three ways, with what runs between steps."""

    untyped: Callable[[], None]
    typed: Callable[[], None]
    floor: Callable[[], None]  # the untyped model and inputs as benchmarks/subclass_floor.py's floor subclass
    reset: Callable[[], None]  # before every step
    teardown: Callable[[], None]


def build_steps(dispatcher: str) -> Steps:
    """The MoE GPTModel's steps with ``dispatcher``; also used by ``benchmarks/step_breakdown.py --moe``.

    Call ``_patch()`` once first.
    """
    floor_module = _load_sibling("subclass_floor")
    as_floor, floor_parameters = floor_module.as_floor, floor_module.floor_parameters

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

    # Models built alike: typing is in place, so the untyped run gets one that was never typed.
    plain_model, model, floor_model = build(), build(), floor_parameters(build())
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

    def floor() -> None:
        t, p = as_floor(tokens.clone()), as_floor(positions.clone())
        floor_model(t, p, mask, labels=t).sum().backward()

    def reset() -> None:
        for m in (model, plain_model, floor_model):
            m.zero_grad(set_to_none=True)
        S.clear_aux_losses_tracker()

    return Steps(untyped, typed, floor, reset, ps.destroy_model_parallel)


def one_dispatcher(dispatcher: str, repeats: int) -> dict[str, list[float]]:
    """CPU seconds of each step (untyped, floor, typed) in every repeat; the order rotates between repeats."""
    steps = build_steps(dispatcher)
    variants = (("untyped", steps.untyped), ("floor", steps.floor), ("typed", steps.typed))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _, fn in variants:  # warm-up
        steps.reset()
        fn()
    for i in range(repeats):
        for name, fn in variants[i % 3:] + variants[:i % 3]:
            steps.reset()
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    steps.teardown()
    return times


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _patch()
    floor = _load_sibling("subclass_floor")
    repeats = int(os.environ.get("REPEATS", "7"))
    print(f"MoE GPTModel ({LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts, top-2, aux loss), tp=2 + SP, ep=2, "
          f"edp=2 on a fake group of 8; one forward+backward, CPU ms, median of {repeats}, rotating order; "
          f"torch {torch.__version__}")
    print("floor: the untyped model as the least subclass that keeps its class and one attribute through ops "
          "(benchmarks/subclass_floor.py); ratios: over the untyped step of the same repeat, median [quartiles]")
    print(f"{'dispatcher':>10}  {'untyped ms':>10}  {'floor ms':>8}  {'typed ms':>8}  {'floor/untyped':>17}  "
          f"{'typed/untyped':>17}")
    for dispatcher in ("allgather", "alltoall"):
        times = one_dispatcher(dispatcher, repeats)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{dispatcher:>10}  {med['untyped']:10.1f}  {med['floor']:8.1f}  {med['typed']:8.1f}  "
              f"{floor.paired_ratio(times, 'floor'):>17}  {floor.paired_ratio(times, 'typed'):>17}")


if __name__ == "__main__":
    main()
