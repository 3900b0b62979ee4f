"""Where a typed Megatron-core step spends its time: Python bytecodes counted per function (deterministic).

Run: python benchmarks/step_breakdown.py [--top N] [--moe allgather|alltoall]   (needs megatron-core)

Timings on a shared machine move by 20% between runs; a count of the Python bytecodes each function
executes in one step does not. This runs the GPTModel step of ``benchmarks/megatron.py`` (a), or with
``--moe`` the MoE step of ``benchmarks/megatron_moe.py`` with that token dispatcher, once untyped
and once typed (parameters typed before, as a training loop does) under a tracer that counts every
bytecode, and prints the totals, this package's share by module, and the functions that run the most
bytecodes in the typed step beside their count in the untyped one. What bytecodes do not show: the cost
of torch's own subclass dispatch (C++ calling ``__torch_function__``), of the aliases a registered
Function's typed inputs get, and of the kernels, which the timing table measures.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings
from typing import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import spmd_types as spmd  # noqa: E402

_SITE = ("site-packages/", "/spmd_types/")


def _short(path: str) -> str:
    for marker in _SITE:
        if marker in path:
            return ("spmd_types/" if marker == "/spmd_types/" else "") + path.split(marker, 1)[1]
    return path


def count(fn) -> collections.Counter:
    """Bytecodes run by ``fn()``, per (file, function)."""
    counts: collections.Counter = collections.Counter()

    def tracer(frame, event, arg):
        if event != "call":
            return None
        frame.f_trace_opcodes = True
        key = (_short(frame.f_code.co_filename), frame.f_code.co_name)

        def local(frame, event, arg):
            if event == "opcode":
                counts[key] += 1
            return local

        return local

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return counts


def _dense_steps() -> tuple[str, Callable[[], None], Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(title, untyped step, typed step, reset, teardown): ``benchmarks/megatron.py``'s GPTModel (a)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, os.path.join(_HERE, "..", "examples"))
    import megatron_gpt
    from megatron.core import parallel_state as ps

    from spmd_types import megatron as spmd_megatron

    megatron_gpt.cpu_accommodations()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    spmd_megatron.register()
    models = {}
    for name in ("untyped", "typed"):
        torch.manual_seed(0)
        models[name] = megatron_gpt.build(2, True, layers=4, hidden=128, heads=8)[1]
    seq, vocab = megatron_gpt.SEQ, megatron_gpt.VOCAB
    tokens = torch.randint(0, vocab, (2, seq))
    positions = torch.arange(seq).expand(2, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    mesh = spmd_megatron.mesh()
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd_megatron.type_parameters(models["typed"])

    def untyped() -> None:
        models["untyped"](tokens, positions, mask, labels=tokens).sum().backward()

    def typed() -> None:
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            t = spmd.assert_type(tokens.clone(), {"dp": spmd.V, "tp": spmd.I})
            p = spmd.assert_type(positions.clone(), {"dp": spmd.V, "tp": spmd.I})
            models["typed"](t, p, mask, labels=t).sum().backward()

    def reset() -> None:
        for m in models.values():
            m.zero_grad(set_to_none=True)

    def teardown() -> None:
        ps.destroy_model_parallel()
        dist.destroy_process_group()

    return "GPTModel (4 layers, hidden 128, tp=2, dp=2, SP)", untyped, typed, reset, teardown


def _moe_steps(dispatcher: str) -> tuple[str, Callable[[], None], Callable[[], None], Callable[[], None],
                                         Callable[[], None]]:
    """(title, untyped step, typed step, reset, teardown): ``benchmarks/megatron_moe.py``'s model."""
    sys.path.insert(0, _HERE)
    import megatron_moe

    megatron_moe._patch()
    steps = megatron_moe.build_steps(dispatcher)
    return f"MoE GPTModel ({dispatcher} dispatcher, tp=2 + SP, ep=2)", steps.untyped, steps.typed, steps.reset, \
        steps.teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--moe", choices=("allgather", "alltoall"), default=None,
                        help="count benchmarks/megatron_moe.py's MoE step with this token dispatcher instead")
    args = parser.parse_args()
    top = args.top
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    title, untyped, typed, reset, teardown = _moe_steps(args.moe) if args.moe else _dense_steps()
    for fn in (untyped, typed, untyped, typed):  # warm: every cache filled
        reset()
        fn()
    got = {}
    for name, fn in (("untyped", untyped), ("typed", typed)):
        reset()
        got[name] = count(fn)
    u, t = got["untyped"], got["typed"]
    total_u, total_t = sum(u.values()), sum(t.values())
    ours = sum(v for (f, _), v in t.items() if f.startswith("spmd_types/"))
    print(f"{title} one forward+backward; torch {torch.__version__}")
    print(f"Python bytecodes per step: untyped {total_u}, typed {total_t} ({total_t / total_u:.2f}x); "
          f"in spmd_types {ours} ({100 * ours / (total_t - total_u):.0f}% of the difference)")
    by_module: collections.Counter = collections.Counter()
    for (f, _), v in t.items():
        if f.startswith("spmd_types/"):
            by_module[f] += v
    print("\nspmd_types by module (typed step)")
    for f, v in by_module.most_common(8):
        print(f"    {v:8d}  {f}")
    print(f"\nthe {top} functions that run the most bytecodes in the typed step (untyped beside)")
    print(f"    {'typed':>8} {'untyped':>8}  function")
    for (f, n), v in t.most_common(top):
        print(f"    {v:8d} {u.get((f, n), 0):8d}  {f}:{n}")
    teardown()


if __name__ == "__main__":
    main()
