"""torchtitan 0.3.0 as its users run it on torch 2.14: FSDP applied, under the layouts torchtitan typechecks.

The matrix (:data:`MATRIX`): every decoder model of ``_torchtitan_models`` under
FSDP + TP + SP (dp_shard=4 x tp=2), HSDP (dp_replicate=2 x dp_shard=2 x tp=2),
CP=2 with FSDP and TP (dp_shard=2 x cp=2 x tp=2, torchtitan's own CP test
layout) and, for the MoE models, EP=2 (dp_shard=4 x tp=2 x ep=2), each on 8
ranks. ``fully_shard(..., dp_mesh_dims=)`` is torchtitan's own call, reading our
types. On a fake process group a case typechecks (rank 0's program); on gloo
(:func:`worker`, several cases per launch) it also gives loss and gradients,
with checking on and off, for the test to compare with each other and with the
same model on one device.
"""

from __future__ import annotations

import _torchtitan_support as tt
from _torchtitan_models import DECODERS, MOE

# name -> Case fields (the model is filled in per case)
LAYOUTS = {
    "fsdp4 x tp2 (SP)": {"world": 8, "tp": 2},
    "hsdp2x2 x tp2": {"world": 8, "tp": 2, "dp_replicate": 2},
    "fsdp2 x cp2 x tp2": {"world": 8, "tp": 2, "cp": 2},
    "fsdp4 x tp2 x ep2": {"world": 8, "tp": 2, "ep": 2},
}
# torchtitan itself refuses these (parallelize_fn raises NotImplementedError before anything runs)
REFUSED = {("kimi_k2_7", "fsdp2 x cp2 x tp2"): "Context Parallel is not yet supported for Kimi K2.5"}


def _cases() -> tuple[tt.Case, ...]:
    out = []
    for model in DECODERS:
        for layout, fields in LAYOUTS.items():
            if fields.get("ep", 1) > 1 and model not in MOE:
                continue
            out.append(tt.Case(f"{model} {layout}", model, **fields))
    return tuple(out)


MATRIX = _cases()


def matrix_case(name: str) -> tt.Case:
    """The matrix case called ``name`` (``"<model> <layout>"``)."""
    for c in MATRIX:
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}; cases: {[c.name for c in MATRIX]}")


def refusal(c: tt.Case) -> str | None:
    """torchtitan's own refusal of case ``c``, if it has one."""
    layout = c.name[len(c.model) + 1:]
    return REFUSED.get((c.model, layout))
