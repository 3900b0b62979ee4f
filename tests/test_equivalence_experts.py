"""check_equivalence with expert parallelism: reference_names maps each rank's experts to the one-device names (issue 22 item 4).

Each ep rank holds ``n`` whole experts, ``local_experts.0`` to ``local_experts.{n-1}``; on one device they are
``local_experts.{r*n+k}``. The parameter's type (V on ep) says each rank holds different values, not which:
``reference_names={glob: fn(name, coords) -> reference name}`` says which, and gradients and updates are then
compared rank by rank against the named reference. Megatron-core's MoE GPTModel is in
test_equivalence_megatron.py, torchtitan's qwen3-MoE in test_torchtitan_equivalence.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import check_equivalence

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
EXPERTS = 4


def _ep(mesh) -> int:
    return mesh.size(mesh.mesh_dim_names.index("ep"))


class SoftExperts(nn.Module):
    """Every token through every expert, weighted by a softmax gate; each ep rank runs its own experts."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.gate = spmd.assert_type(nn.Parameter(torch.randn(EXPERTS, 4)), {"ep": I})
        self.local_experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(EXPERTS // _ep(mesh)))
        for expert in self.local_experts:
            spmd.assert_type(expert.weight, {"ep": V})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = spmd.convert(F.softmax(F.linear(x, self.gate), dim=-1), "ep", src=I, dst=R)  # [tokens, EXPERTS]
        n = len(self.local_experts)
        mine = weights.index_select(-1, spmd.axis_index("ep") * n + torch.arange(n))  # this rank's experts' weights
        x = spmd.convert(x, "ep", src=I, dst=R)
        out = sum(mine[:, k:k + 1] * expert(x) for k, expert in enumerate(self.local_experts))
        return spmd.all_reduce(out, "ep", src=V, dst=I)


def step(model: nn.Module, batch: dict, mesh) -> torch.Tensor:
    loss = model(batch["x"]).square().sum()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return loss


def experts_of(name: str, coords: dict[str, int]) -> str:
    """``local_experts.k`` on ep rank r is ``local_experts.{r*n+k}`` on one device (n = experts per rank)."""
    n = EXPERTS // 2
    return re.sub(r"local_experts\.(\d+)", lambda m: f"local_experts.{coords['ep'] * n + int(m.group(1))}", name)


KW = {"mesh_shape": (2,), "names": ("ep",)}
BATCH = {"x": (torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), {"ep": I})}


def test_experts_named_by_rank_match_one_device():
    report = check_equivalence(SoftExperts, step, BATCH, reference_names={"local_experts.*": experts_of}, **KW)
    assert report.ok, report
    assert [(c.kind, c.name) for c in report.compared if c.kind in ("grad", "update")] == [
        (kind, name) for kind in ("grad", "update")
        for name in ("gate", "local_experts.0.weight", "local_experts.1.weight")]
    # the reference's experts 2 and 3 are compared as ep rank 1's local_experts 0 and 1: none is left over
    assert [(n.kind, n.name, n.reason) for n in report.not_compared] == [
        ("output", name, "the output of a module named by reference_names (an expert): which tokens reach it on each "
                         "rank is the expert-parallel exchange's choice, not one device's; the layer's output after "
                         "the exchange back is compared") for name in ("local_experts.0", "local_experts.1")]


def test_without_reference_names_the_error_says_so():
    with pytest.raises(ValueError) as err:
        check_equivalence(SoftExperts, step, BATCH, **KW)
    assert str(err.value) == (
        "check_equivalence loads a parameter by its type when the type says which piece each rank holds (S(d): a "
        "chunk of dim d; R and I: the whole), but parameter 'local_experts.0.weight' is V on 'ep': give its layout: "
        "layouts={'local_experts.0.weight': fn(full, coords) -> local}, or, when each rank holds other whole "
        "parameters (experts), their names: reference_names={'local_experts.0.weight': fn(name, coords) -> "
        "reference name}")


def test_a_name_the_reference_lacks_is_refused():
    with pytest.raises(ValueError) as err:
        check_equivalence(SoftExperts, step, BATCH, reference_names={"local_experts.*": lambda n, c: n + "_"}, **KW)
    assert str(err.value) == (
        "check_equivalence: reference_names gives 'local_experts.0.weight_' for parameter 'local_experts.0.weight' on "
        "rank 0, but the reference model has no such parameter (its parameters: gate, local_experts.0.weight, "
        "local_experts.1.weight, local_experts.2.weight, local_experts.3.weight, ...)")


def test_experts_dealt_out_round_robin_by_mistake_diverge_at_the_output():
    def round_robin(name: str, coords: dict[str, int]) -> str:  # BUG: expert r + 2k, as another loader deals them
        return re.sub(r"local_experts\.(\d+)", lambda m: f"local_experts.{coords['ep'] + 2 * int(m.group(1))}", name)

    report = check_equivalence(SoftExperts, step, BATCH, reference_names={"local_experts.*": round_robin}, **KW)
    assert (report.first.kind, report.first.name) == ("output", "SoftExperts")
