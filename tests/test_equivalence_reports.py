"""check_equivalence's reports say why (issue 22 item 5): the ``at:`` line, reasons for inf and not compared, batch types.

Every message here is pinned with its exact text. The ``at:`` line names the innermost frame outside this
package, torch and the standard library, so a value made inside a library (torchtitan, Megatron) points into
that library; ``tests/test_torchtitan_equivalence.py`` checks it on torchtitan itself.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import check_equivalence
from spmd_types.testing._eq_align import MeshInfo, assemble_per_rank
from spmd_types.testing._eq_record import Snapshot, _skipped

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
KW = {"mesh_shape": (2,), "names": ("tp",)}


def _tp(mesh) -> int:
    return mesh.size(mesh.mesh_dim_names.index("tp"))


def test_the_at_line_skips_torch_but_not_a_library_whose_folder_starts_with_torch():
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    assert _skipped(os.path.join(torch_dir, "nn", "functional.py"))
    assert _skipped(os.path.join(os.path.dirname(os.path.abspath(spmd.__file__)), "_comm", "call.py"))
    assert not _skipped(os.path.join(torch_dir + "titan", "models", "common", "embedding.py"))
    assert not _skipped(os.path.join(torch_dir + "_geometric", "nn.py"))
    assert not _skipped(__file__)


class Scale(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.w = spmd.assert_type(nn.Parameter(torch.ones(4)), {"tp": I})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _sum_step(model, batch, mesh):
    loss = model(batch["x"]).sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("types, message", [
    ({"tp": "S(0)"}, "check_equivalence: batch entry 'x' types axis 'tp' with the string 'S(0)': give the type "
                     "itself, e.g. spmd.S(0)"),
    ({"tp": S}, "check_equivalence: batch entry 'x' types axis 'tp' with the class spmd.S: give a shard of one "
                "dim, e.g. spmd.S(0)"),
    ({"tp": 0}, "check_equivalence: batch entry 'x' types axis 'tp' with 0 (int): give an SPMD type: spmd.R, "
                "spmd.I, spmd.S(d) (V and P say nothing about how the global batch splits)"),
])
def test_a_batch_type_that_is_not_a_type_has_its_own_message(types, message):
    with pytest.raises(TypeError) as err:
        check_equivalence(Scale, _sum_step, {"x": (torch.ones(2, 4), types)}, **KW)
    assert str(err.value) == message


def test_a_numpy_batch_is_refused_with_the_conversion():
    with pytest.raises(TypeError) as err:
        check_equivalence(Scale, _sum_step, {"x": (np.ones((2, 4)), {"tp": I})}, **KW)
    assert str(err.value) == ("check_equivalence: batch entry 'x' holds a numpy.ndarray: give a torch tensor "
                              "(torch.from_numpy(array))")
    with pytest.raises(TypeError) as err:
        check_equivalence(Scale, _sum_step, {"x": np.ones((2, 4))}, **KW)
    assert str(err.value) == ("check_equivalence: batch entry 'x' holds a numpy.ndarray: give a torch tensor "
                              "(torch.from_numpy(array))")


class Block(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.up = spmd.assert_type(nn.Parameter(torch.randn(8 // _tp(mesh), 4)), {"dp": R, "tp": S(0)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(spmd.convert(x, "tp", src=I, dst=R), self.up)
        return spmd.all_gather(h, "tp", src=S(1), dst=I)


class Stack(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.block = Block(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _accumulating_step(model, batch, mesh):
    """Gradient accumulation over micro-batches of a fixed size (2 rows): the one-device run makes twice as many."""
    total = 0
    for rows in batch["x"].split(2):
        loss = model(rows).square().sum()
        loss.backward()
        total = total + loss.detach()
    return spmd.all_reduce(total, "dp", src=V, dst=I)


def test_a_value_of_another_shape_is_inf_with_its_reason():
    x = torch.arange(16.0).view(4, 4) / 8
    report = check_equivalence(Stack, _accumulating_step, {"x": (x, {"dp": S(0), "tp": I})}, mesh_shape=(2, 2),
                               output_dims={"*": {"dp": 0}})
    first = report.first
    assert (first.kind, first.name, first.max_abs_error) == ("output", "block", float("inf"))
    assert first.reason == (
        "reassembled from the ranks it is [4, 8], on one device [2, 8]: the two runs made it with different shapes "
        "(a size fixed in step, such as a micro-batch size, makes the one-device run's pieces differ: the module "
        "ran 2 times on one device, 1 on each rank)")
    assert [(n.kind, n.name, n.reason) for n in report.not_compared] == [
        ("output", "block#1", "the module ran 2 times on one device, 1 on each rank: only its first call is "
                              "compared (a size fixed in step, such as a micro-batch size, changes how often "
                              "modules run)"),
        ("output", "Stack#1", "the module ran 2 times on one device, 1 on each rank: only its first call is "
                              "compared (a size fixed in step, such as a micro-batch size, changes how often "
                              "modules run)")]
    text = str(report)
    assert f"\n  why: {first.reason}\n" in text


def _rows(full: torch.Tensor, coords: dict) -> torch.Tensor:
    return full.view(2, 4, -1)[coords["tp"]].clone()


def test_a_layout_that_cuts_a_value_unlike_the_parallel_one_says_why():
    # a gradient always has its parameter's shape, so this is the update of a step that resized the parameter
    snap = Snapshot("w", "update", types={"tp": S(0)}, values={0: torch.ones(2, 4), 1: torch.ones(2, 4)})
    mesh = MeshInfo(("tp",), (2,), {0: (0,), 1: (1,)})
    full = torch.ones(8, 4)
    expected = lambda rank: (_rows(full, mesh.coord_dict(rank)), full)  # noqa: E731
    err, ranks, reason = assemble_per_rank(snap, mesh, expected, 1e-9, "layouts['w']")
    assert (err, ranks) == (float("inf"), (0,))
    assert reason == "layouts['w'] gives [4, 4] on rank 0 from the reference's [8, 4], but the parallel value is [2, 4]"


def test_a_parameter_of_another_size_names_layouts():
    class Padded(nn.Module):
        """An embedding whose rows are padded to a multiple of 4 * tp (Megatron pads the vocabulary by tp)."""

        def __init__(self, mesh) -> None:
            super().__init__()
            tp = _tp(mesh)
            rows = -(-10 // (4 * tp)) * 4 * tp  # 10 rows: 12 on one device, 16 on two ranks
            self.w = spmd.assert_type(nn.Parameter(torch.ones(rows // tp, 4)), {"tp": S(0)})

    with pytest.raises(ValueError) as err:
        check_equivalence(Padded, lambda model, batch, mesh: None, {}, **KW)
    assert str(err.value) == (
        "check_equivalence: parameter 'w': cut by its type {tp: S(0)} gives [6, 4] on rank 0 from the reference's "
        "[12, 4], but the parallel parameter is [8, 4]: build() must make the same model on both meshes (a size that "
        "depends on the mesh, such as a vocabulary padded to a multiple of tp, differs), or give its layout: "
        "layouts={'w': fn(full, coords) -> local} (e.g. pad full, then cut this rank's piece)")


def test_not_compared_reasons_name_their_fix():
    class Partial(nn.Module):
        def __init__(self, mesh) -> None:
            super().__init__()
            self.down = spmd.assert_type(nn.Parameter(torch.ones(4, 8 // _tp(mesh))), {"tp": S(1)})
            self.proj = nn.Identity()

        def forward(self, x):
            return spmd.all_reduce(self.proj(F.linear(x, self.down)), "tp", src=V, dst=I)

    def step(model, batch, mesh):
        loss = model(batch["x"]).sum()
        loss.backward()
        return loss

    report = check_equivalence(Partial, step, {"x": (torch.ones(3, 8), {"tp": S(1)})}, **KW)
    assert report.ok, report
    assert [(n.name, n.reason) for n in report.not_compared] == [(
        "proj", "V on 'tp' whose pieces make the reference's shape [3, 4] on no dim (local [3, 4]): a pending sum "
                "typed V (local SPMD's row-parallel product) has no layout to reassemble, and the value after its "
                "reduction is compared; to compare it too, type it P (spmd.reinterpret(x, 'tp', src=spmd.V, "
                "dst=spmd.P)); pieces interleaved by a flatten of two split dims have none either")]
