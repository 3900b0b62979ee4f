"""spmd_types.testing.check_equivalence: the API, alignment by type, tolerance, and the report (issue 17).

Small tensor-parallel models on simulated ranks against the same code on one device. The Megatron-style
GPT with its planted bugs is in test_equivalence_gpt.py, Megatron-core's GPTModel in
test_equivalence_megatron.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import DivergenceError, EquivalenceReport, check_equivalence, rank_values
from spmd_types.testing._eq_align import ATOL64, RTOL64, SAFETY, MeshInfo, assemble, tolerance
from spmd_types.testing._eq_record import Snapshot

R, I, V, P, S = spmd.R, spmd.I, spmd.V, spmd.P, spmd.S
HERE = Path(__file__)


def _line(marker: str) -> int:
    """The line number of the one line of this file that contains ``marker``."""
    (found,) = [i for i, text in enumerate(HERE.read_text().splitlines(), 1) if marker in text and "_line(" not in text]
    return found


# ---------------------------------------------------------------------------
# a tensor-parallel MLP: column-parallel fc1, row-parallel fc2, a bias after the all-reduce


class MLP(nn.Module):
    def __init__(self, tp: int, bug: bool = False) -> None:
        super().__init__()
        self.bug = bug
        self.fc1 = nn.Linear(8, 16 // tp)
        self.fc2 = nn.Linear(16 // tp, 8, bias=False)
        self.bias = nn.Parameter(torch.randn(8))
        spmd.assert_type(self.fc1.weight, {"dp": R, "tp": S(0)})
        spmd.assert_type(self.fc1.bias, {"dp": R, "tp": S(0)})
        spmd.assert_type(self.fc2.weight, {"dp": R, "tp": S(1)})
        spmd.assert_type(self.bias, {"dp": R, "tp": I})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.gelu(self.fc1(spmd.convert(x, "tp", src=I, dst=R))))
        if self.bug:
            out = out + spmd.convert(self.bias, "tp", src=I, dst=R)  # BUG: the bias joins every partial sum
            return spmd.all_reduce(out, "tp", src=V, dst=I)  # so the sum adds it tp times
        return spmd.all_reduce(out, "tp", src=V, dst=I) + self.bias


def mlp_step(model: nn.Module, batch: dict, mesh, optimizer: bool = False) -> torch.Tensor:
    loss = (model(batch["x"]) ** 2).mean()
    loss.backward()
    for p in model.parameters():
        p.grad = spmd.all_reduce(p.grad, "dp", src=P, dst=R, op="avg")
    if optimizer:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return spmd.all_reduce(loss.detach(), "dp", src=V, dst=I, op="avg")


def mlp_batch() -> dict:
    return {"x": (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), {"dp": S(0), "tp": I})}


def test_a_typed_tensor_on_simulated_ranks_keeps_its_type_through_contiguous():
    # LocalTensor.contiguous is its own autograd Function returning a plain LocalTensor; Megatron calls
    # .transpose(0, 1).contiguous() on every activation, which lost its type under the simulation.
    from spmd_types.testing import simulate

    with simulate((2,), ("tp",), ranks="local", device="cpu"), spmd.typecheck():
        x = spmd.assert_type(torch.randn(4, 3, requires_grad=True), {"tp": I})
        y = x.transpose(0, 1).contiguous()
        assert spmd.get_type(y) == {"tp": I} and spmd.get_type(x.contiguous()) == {"tp": I}
        y.sum().backward()
        assert spmd.get_type(x.grad) == {"tp": I}
        assert all(torch.equal(g, torch.ones(4, 3)) for g in rank_values(x.grad).values())


def test_the_three_public_names():
    import spmd_types.testing as testing

    assert {"check_equivalence", "EquivalenceReport", "DivergenceError"} <= set(testing.__all__)
    assert issubclass(DivergenceError, AssertionError)


def test_a_correct_step_is_ok_and_compares_every_kind_in_order():
    rng = torch.get_rng_state()
    report = check_equivalence(lambda mesh: MLP(mesh.size(1)), lambda m, b, mesh: mlp_step(m, b, mesh, True),
                               mlp_batch(), output_dims={"*": {"dp": 0}})
    assert isinstance(report, EquivalenceReport)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is left as it was
    assert report.ok and report.first is None and report.divergences == []
    report.raise_if_diverged()
    got = [(c.kind, c.name) for c in report.compared]
    params = ["bias", "fc1.weight", "fc1.bias", "fc2.weight"]
    assert got == ([("output", "fc1"), ("output", "MLP"), ("loss", "loss")] + [("grad", n) for n in params]
                   + [("update", n) for n in params])
    # fc2's output is a partial sum typed V: no dim of it makes the reference's shape, so it is not guessed at
    assert [(n.kind, n.name, n.reason) for n in report.not_compared] == [
        ("output", "fc2", "V on 'tp' whose pieces make the reference's shape [4, 8] on no dim (local [2, 8]): a "
                          "pending sum typed V (local SPMD's row-parallel product) has no layout to reassemble, and "
                          "the value after its reduction is compared; to compare it too, type it P "
                          "(spmd.reinterpret(x, 'tp', src=spmd.V, dst=spmd.P)); pieces interleaved by a flatten of "
                          "two split dims have none either")]
    for c in report.compared:
        assert c.max_abs_error <= c.tolerance and c.ranks == () and c.reference_norm > 0


def test_a_planted_bug_is_the_first_divergence_with_its_line():
    report = check_equivalence(lambda mesh: MLP(mesh.size(1), bug=True), mlp_step, mlp_batch(),
                               output_dims={"*": {"dp": 0}})
    first = report.first
    assert not report.ok and first is report.divergences[0]
    assert (first.name, first.kind, first.ranks) == ("MLP", "output", ())
    assert first.max_abs_error > 1e6 * first.tolerance
    line = _line("# so the sum adds it tp times")
    assert first.source == f"tests/test_equivalence.py:{line}: {HERE.read_text().splitlines()[line - 1].strip()}"
    assert [d.kind for d in report.divergences] == ["output", "loss", "grad", "grad", "grad", "grad"]
    with pytest.raises(DivergenceError) as err:
        report.raise_if_diverged()
    assert err.value.report is report and str(err.value) == str(report)
    assert repr(report) == "<EquivalenceReport first='MLP' (output), 7 compared, 6 diverged, 1 not compared>"


def test_float32_and_bfloat16_take_their_tolerance_from_the_reference_round_off():
    for dtype in (torch.float32, torch.bfloat16):
        report = check_equivalence(lambda mesh: MLP(mesh.size(1)), mlp_step, mlp_batch(),
                                   output_dims={"*": {"dp": 0}}, dtype=dtype)
        assert report.ok, report
    report = check_equivalence(lambda mesh: MLP(mesh.size(1), bug=True), mlp_step, mlp_batch(),
                               output_dims={"*": {"dp": 0}}, dtype=torch.float32)
    assert report.first.name == "MLP" and report.first.max_abs_error > 1e3 * report.first.tolerance


def test_tolerance_rules():
    ref = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    assert tolerance(ref, None, torch.float64) == RTOL64 * 4 + ATOL64
    ref64 = ref + torch.tensor([0.0, 2.0**-20, 0.0], dtype=torch.float64)
    assert tolerance(ref, ref64, torch.float32) == SAFETY * 2.0**-20 + torch.finfo(torch.float32).tiny
    exact = tolerance(ref, ref, torch.float32)  # no round-off measured: the floor, eps of the dtype times the scale
    assert exact == SAFETY * torch.finfo(torch.float32).eps * 4 + torch.finfo(torch.float32).tiny
    # a float64 model that computed in float32 somewhere (Megatron's cross entropy does): float32's floor
    assert tolerance(ref, None, torch.float64, torch.float32) == exact


def test_an_spmd_type_error_in_the_parallel_step_propagates_unchanged():
    class Forgot(nn.Module):
        def __init__(self, tp: int) -> None:
            super().__init__()
            self.w = spmd.assert_type(nn.Parameter(torch.randn(4 // tp, 4)), {"dp": R, "tp": S(0)})
            self.gain = spmd.assert_type(nn.Parameter(torch.ones(4)), {"dp": R, "tp": I})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * self.gain
            if self.w.shape[0] < 4:  # only the parallel model takes this path
                return F.linear(x, self.w)  # BUG: forgot the I -> R conversion
            return F.linear(spmd.convert(x, "tp", src=I, dst=R), self.w)

    def step(model, batch, mesh):
        out = model(batch["x"])
        out.sum().backward()
        return out

    with pytest.raises(spmd.SpmdTypeError) as err:
        check_equivalence(lambda mesh: Forgot(mesh.size(1)), step, {"x": (torch.randn(2, 4), {"dp": S(0), "tp": I})})
    assert err.value.rule == ("Invariant (I) values only combine with other I values: F.linear combines input (I) "
                              "with weight (S(0)). Convert the I operand to R, so that its gradient is all-reduced in "
                              "backward.")
    assert err.value.source.startswith(f"tests/test_equivalence.py:{_line('# BUG: forgot the I -> R')}:")


class Twice(nn.Module):
    """One block called twice, an output with two tensors, and a layer with a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4, bias=False)
        spmd.assert_type(self.block.weight, {"tp": I})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.block(self.block(x))
        return h, h * 2


def test_names_calls_and_tuple_outputs():
    def step(model, batch, mesh):
        a, b = model(batch["x"])
        loss = (a + b).sum()
        loss.backward()
        return loss

    report = check_equivalence(lambda mesh: Twice(), step, {"x": (torch.randn(3, 4), {"tp": I})}, mesh_shape=(2,),
                               names=("tp",))
    assert report.ok, report
    assert [c.name for c in report.compared] == ["block", "block#1", "Twice[0]", "Twice[1]", "loss", "block.weight"]

    def step_float(model, batch, mesh):
        return float(step(model, batch, mesh).detach().sum())  # a number, not a tensor: no type to line it up by

    report = check_equivalence(lambda mesh: Twice(), step_float, {"x": (torch.randn(3, 4), {"tp": I})},
                               mesh_shape=(2,), names=("tp",))
    assert [(n.kind, n.name, n.reason) for n in report.not_compared] == [
        ("loss", "loss", "step returned float, not a tensor")]


def test_the_reference_starts_from_a_given_state_dict():
    seen = []

    def step(model, batch, mesh):
        seen.append(rank_values(model.bias))
        return mlp_step(model, batch, mesh)

    start = MLP(1).state_dict()
    start = {k: torch.full_like(v, 0.5) for k, v in start.items()}
    report = check_equivalence(lambda mesh: MLP(mesh.size(1)), step, mlp_batch(), output_dims={"*": {"dp": 0}},
                               state_dict=start)
    assert report.ok, report
    # the parallel run, then the reference twice (a step must repeat: see test_equivalence_random.py)
    assert len(seen) == 3 and all(torch.equal(v, torch.full((8,), 0.5)) for run in seen for v in run.values())


# ---------------------------------------------------------------------------
# layouts: parameters whose pieces are not contiguous chunks of the whole


class Strided(nn.Module):
    """An MLP whose hidden units are dealt out to tp ranks round-robin (a checkpoint loader's choice)."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.w1 = spmd.assert_type(nn.Parameter(torch.randn(8 // tp, 4)), {"tp": S(0)})
        self.b1 = spmd.assert_type(nn.Parameter(torch.randn(8 // tp)), {"tp": S(0)})
        self.w2 = spmd.assert_type(nn.Parameter(torch.randn(4, 8 // tp)), {"tp": S(1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(spmd.convert(x, "tp", src=I, dst=R), self.w1, self.b1))
        return spmd.all_reduce(F.linear(h, self.w2), "tp", src=V, dst=I)


def _strided_step(model, batch, mesh):
    loss = (model(batch["x"]) ** 2).sum()
    loss.backward()
    return loss


def _rows(full: torch.Tensor, coords: dict) -> torch.Tensor:
    return full[coords["tp"]::2].clone()


def _cols(full: torch.Tensor, coords: dict) -> torch.Tensor:
    return full[:, coords["tp"]::2].clone()


def test_layouts_win_over_types_and_a_loader_mistake_is_found():
    batch, kw = {"x": (torch.randn(3, 4), {"tp": I})}, {"mesh_shape": (2,), "names": ("tp",)}
    build = lambda mesh: Strided(mesh.size(0))  # noqa: E731
    report = check_equivalence(build, _strided_step, batch, layouts={"w1": _rows, "b1": _rows, "w2": _cols}, **kw)
    assert report.ok, report
    assert [c.name for c in report.compared if c.kind == "grad"] == ["w1", "b1", "w2"]  # compared rank by rank
    report = check_equivalence(build, _strided_step, batch, layouts={"w1": _rows, "b1": _rows}, **kw)  # BUG: w2
    assert (report.first.name, report.first.kind) == ("Strided", "output")


class PartialBias(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.b = spmd.assert_type(nn.Parameter(torch.randn(4)), {"tp": P})


def test_a_parameter_whose_type_gives_no_piece_needs_a_layout():
    with pytest.raises(ValueError) as err:
        check_equivalence(lambda mesh: PartialBias(mesh.size(0)), _strided_step, {}, mesh_shape=(2,), names=("tp",))
    assert str(err.value) == (
        "check_equivalence loads a parameter by its type when the type says which piece each rank holds (S(d): a "
        "chunk of dim d; R and I: the whole), but parameter 'b' is P on 'tp': give its layout: layouts={'b': "
        "fn(full, coords) -> local}, or, when each rank holds other whole parameters (experts), their names: "
        "reference_names={'b': fn(name, coords) -> reference name}")


# ---------------------------------------------------------------------------
# argument errors, each with its text


def test_argument_errors():
    build = lambda mesh: MLP(mesh.size(1))  # noqa: E731
    cases = [
        (dict(mesh_shape=(2,)), ValueError, "check_equivalence: 1 mesh sizes but 2 axis names"),
        (dict(dtype=torch.int64), ValueError,
         "check_equivalence: dtype must be one of float64, float32, bfloat16, float16; got torch.int64"),
        (dict(batch={"x": (torch.randn(4, 8), {"dp": V, "tp": I})}), ValueError,
         "check_equivalence: batch entry 'x' is V on 'dp', which does not say how the global batch splits: give "
         "S(d) (a chunk of dim d per rank), R or I (the whole on every rank)"),
        (dict(batch={"x": (torch.randn(4, 8), {"pp": I})}), ValueError,
         "check_equivalence: batch entry 'x' is typed on 'pp', which is not a mesh axis (dp, tp)"),
        (dict(batch={"x": [1, 2]}), TypeError,
         "check_equivalence: batch entry 'x' must be (global tensor, {axis: type}) or a tensor, got list"),
        (dict(batch={"x": (torch.randn(3, 8), {"dp": S(0), "tp": I})}), ValueError,
         "check_equivalence: batch entry 'x' is S(0) on 'dp', but its shape [3, 8] does not split into 2 equal "
         "chunks on dim 0"),
        (dict(build=lambda mesh: 3), TypeError, "check_equivalence: build(mesh) must return an nn.Module, got int"),
    ]
    for change, kind, text in cases:
        args = {"build": build, "step": mlp_step, "batch": mlp_batch(), **change}
        with pytest.raises(kind) as err:
            check_equivalence(args.pop("build"), args.pop("step"), args.pop("batch"), **args)
        assert str(err.value) == text


def test_parameter_errors():
    class Untyped(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(n))

        def forward(self, x):
            return x

    def step(model, batch, mesh):
        return batch["x"]

    batch = {"x": (torch.randn(2), {"tp": I})}
    kw = {"mesh_shape": (2,), "names": ("tp",)}
    with pytest.raises(ValueError) as err:
        check_equivalence(lambda mesh: Untyped(4), step, batch, **kw)
    assert str(err.value) == (
        "check_equivalence loads each parallel parameter from the reference by its type, but parameter 'w' is "
        "untyped: type it in build() (spmd.assert_type(param, types), or spmd_megatron.type_parameters(model)), or "
        "give its layout: layouts={'w': fn(full, coords) -> local}")
    with pytest.raises(ValueError) as err:
        check_equivalence(lambda mesh: Untyped(4), step, batch, layouts={"w": lambda full, coords: full[:3]}, **kw)
    assert str(err.value) == (
        "check_equivalence: parameter 'w': its layout gives [3] on rank 0 from the reference's [4], but the parallel "
        "parameter is [4]: build() must make the same model on both meshes")


# ---------------------------------------------------------------------------
# reassembly by type, value by value


def _snap(types: dict, values: dict, dims: dict | None = None, module: str = "m") -> Snapshot:
    return Snapshot("m", "output", module=module, types=types, dims=dims or {},
                    values={r: v.double() for r, v in values.items()})


MESH = MeshInfo(("dp", "tp"), (2, 2), {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)})


def test_reassembly_by_type():
    x = torch.arange(16.0).view(4, 4)
    # S(1) on tp, V on dp with its dim from the partition spec: dp chunks of rows, tp chunks of columns
    pieces = {r: x[2 * c[0]:2 * c[0] + 2, 2 * c[1]:2 * c[1] + 2] for r, c in MESH.coords.items()}
    got = assemble(_snap({"dp": V, "tp": S(1)}, pieces, {"dp": 0}), MESH, (4, 4), None, 0.0)
    assert torch.equal(got.value, x.double()) and got.reason is None
    # P on tp: summed; I on dp: one copy
    halves = {r: (x if c[1] == 0 else 2 * x) for r, c in MESH.coords.items()}
    assert torch.equal(assemble(_snap({"dp": I, "tp": P}, halves), MESH, (4, 4), None, 0.0).value, 3 * x.double())
    # V with its dim from output_dims, then the only dim the shapes leave
    got = assemble(_snap({"dp": V, "tp": V}, pieces), MESH, (4, 4), {"dp": 0}, 0.0)
    assert torch.equal(got.value, x.double())
    rows = {r: x[c[1] * 2:c[1] * 2 + 2] for r, c in MESH.coords.items()}
    got = assemble(_snap({"dp": R, "tp": V}, rows), MESH, (4, 4), None, 0.0)
    assert torch.equal(got.value, x.double())


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = spmd.assert_type(nn.Parameter(torch.randn(4)), {"dp": R, "tp": R})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_a_v_output_takes_its_dims_from_its_partition_spec_in_global_spmd():
    def step(model, batch, mesh, local):
        with spmd.typecheck(local=local):
            return spmd.sum(model(batch["x"]), out_partial_axes=("dp", "tp"))

    batch = {"x": (torch.randn(4, 6, 4), {"dp": S(0), "tp": S(1)})}  # dims 0 and 1 both double: ambiguous by shape
    report = check_equivalence(lambda mesh: Scale(), lambda m, b, mesh: step(m, b, mesh, False), batch)
    assert report.ok and [c.name for c in report.compared] == ["Scale", "loss"] and report.not_compared == []
    report = check_equivalence(lambda mesh: Scale(), lambda m, b, mesh: step(m, b, mesh, True), batch)
    assert [(n.name, n.reason) for n in report.not_compared] == [(
        "Scale", "V on 'dp' and 'tp': the shapes (local [2, 3, 4], reference [4, 6, 4]) fit several layouts ({dp: 0, "
                 "tp: 1}, {dp: 1, tp: 0}); name the dims with output_dims={'Scale': {axis: dim}}")]


def test_an_ambiguous_v_is_not_compared_with_its_reason():
    x = torch.arange(16.0).view(4, 4)
    pieces = {r: x[:2, :2] for r in MESH.coords}
    got = assemble(_snap({"dp": V, "tp": V}, pieces, module="decoder.mlp"), MESH, (4, 4), None, 0.0)
    assert got.value is None and got.reason == (
        "V on 'dp' and 'tp': the shapes (local [2, 2], reference [4, 4]) fit several layouts ({dp: 0, tp: 1}, "
        "{dp: 1, tp: 0}); name the dims with output_dims={'decoder.mlp': {axis: dim}}")
    got = assemble(_snap({"dp": R, "tp": V}, pieces), MESH, (4, 4), None, 0.0)
    assert got.reason.startswith("V on 'tp' whose pieces make the reference's shape [4, 4] on no dim (local [2, 2]): ")
    got = assemble(_snap({"dp": V, "tp": R}, {r: torch.tensor(1.0) for r in MESH.coords}), MESH, (), {"dp": 0}, 0.0)
    assert got.reason == "V on 'dp' on dim 0, but the value has 0 dims (shape [])"


def test_disagreeing_copies_of_an_invariant_value_name_their_ranks():
    x = torch.ones(3)
    values = {r: (x + 1 if r == 3 else x) for r in MESH.coords}
    got = assemble(_snap({"dp": I, "tp": I}, values), MESH, (3,), None, 1e-9)
    assert got.ranks == (3,) and got.spread == 1.0
    got = assemble(_snap({"dp": S(0), "tp": I}, {r: x for r in MESH.coords}), MESH, (5,), None, 0.0)
    assert got.shape_error == "reassembled shape [6], reference [5]"


# ---------------------------------------------------------------------------
# the report a person reads: its exact text


class Exact(nn.Module):
    """Integer arithmetic, so that every error is exact and the table is the same on every machine."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.scale = spmd.assert_type(nn.Parameter(torch.arange(1.0, 1.0 + 4 // tp)), {"tp": S(0)})
        self.squares = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.squares(x * self.scale)  # [1, 4, 9, 16], sharded
        partial = h.sum()  # this rank's share of the total
        partial = partial + 1  # BUG: an offset added on every rank, so the sum adds it tp times
        return spmd.all_reduce(partial, "tp", src=V, dst=I)


def _exact_step(model, batch, mesh):
    loss = model(batch["x"])
    loss.backward()
    return loss


def test_the_report_text():
    batch = {"x": (torch.tensor([1.0, 2.0, 3.0, 4.0]), {"tp": S(0)})}
    report = check_equivalence(lambda mesh: Exact(mesh.size(0)), _exact_step, batch, mesh_shape=(2,), names=("tp",))
    line = _line("partial = partial + 1  # BUG")
    assert str(report) == f"""\
check_equivalence: tp=2 (simulated) against one device, float64

 #   kind     value     max error   tolerance   result
 ────────────────────────────────────────────────────────────────
 1   output   squares           0     1.6e-08   ok
 2   output   Exact       1.0e+00     3.1e-08   DIVERGED <- first
 3   loss     loss        1.0e+00     3.1e-08   DIVERGED
 4   grad     scale             0     4.0e-09   ok

2 of 4 compared values diverged. The first: output of Exact, max error 1.0e+00 > tolerance 3.1e-08 (reference norm 3.1e+01)
  at: tests/test_equivalence.py:{line + 1}: return spmd.all_reduce(partial, "tp", src=V, dst=I)"""


def test_the_docs_page_example_prints_what_the_page_shows(tmp_path, monkeypatch):
    import contextlib
    import io
    import linecache
    import re
    import runpy

    page = (HERE.parents[1] / "docs" / "equivalence.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", page, flags=re.S | re.M)
    code, (lang, shown) = blocks[0][1], blocks[1]
    assert blocks[0][0] == "python" and lang == "text"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(code)
    linecache.clearcache()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path("model.py", run_name="__main__")
    assert printed.getvalue() == shown


# ---------------------------------------------------------------------------
# a torchtitan-style DTensor model (tests/_dtensor_llama.py) at tp=2


def test_torchtitan_style_dtensor_llama_at_tp2(monkeypatch):
    import _dtensor_llama as L

    monkeypatch.setitem(L._CORES, "none", L._sdpa)  # the attention core without the tensor-parallel local_map

    def step(model, batch, mesh):
        loss = F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["targets"].flatten())
        loss.backward()
        return spmd.assert_type(loss, {"tp": I})  # the loss is a plain tensor (the logits' local value)

    tokens, targets = L.batch()
    def build(mesh):  # as torchtitan does: the tensor-parallel plan is applied when tp is enabled (> 1)
        model = L.Llama()
        if mesh.size(0) > 1:
            return L.apply_tp(model, mesh["tp"])
        for block in model.layers.values():
            block.attention.core = "none"
        return model

    report = check_equivalence(build, step,
                               {"tokens": tokens, "targets": targets}, mesh_shape=(2,), names=("tp",))
    assert report.ok, report
    assert len([c for c in report.compared if c.kind == "grad"]) == 21
    assert [(n.name, n.reason) for n in report.not_compared] == [
        ("output", "untyped (give it a type with spmd.assert_type, or type the module's output)"),
        ("Llama", "untyped (give it a type with spmd.assert_type, or type the module's output)")]
