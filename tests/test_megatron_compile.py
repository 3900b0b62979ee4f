"""Megatron-core's GPTModel compiled with spmd_megatron typing on (issue 23, item 4).

Megatron's tensor-parallel layers are autograd Functions whose backward calls ``torch.distributed.all_reduce``
with ``async_op=True``, which dynamo cannot trace: ``fullgraph=True`` stops there, typed or not (a torch
limit). With ``fullgraph=False`` the model compiles around them; a registered Function runs eagerly between
graphs under checking (its registration checks it), and every graph is checked when it compiles.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from _megatron_support import accommodate_cpu, fake_gpt, typed_inputs  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from test_megatron_core import _expected_grad_types  # noqa: E402

import spmd_types as spmd  # noqa: E402
from spmd_types import I, V  # noqa: E402
from spmd_types import megatron as spmd_megatron  # noqa: E402
from spmd_types._compile.backend import CHECKS  # noqa: E402


@pytest.fixture
def cpu(monkeypatch):
    accommodate_cpu(monkeypatch.setattr)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # else Megatron warns inside the trace (a graph break)
    yield monkeypatch
    ps.destroy_model_parallel()


def _step(model, mesh, batch, compiled: bool):
    torch._dynamo.reset()
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd_megatron.type_parameters(model)
        run = torch.compile(model, backend="aot_eager", fullgraph=False) if compiled else model
        loss = _forward(run, typed_inputs(batch))
        loss.sum().backward()
    return loss


def _forward(model, batch):
    return model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"])


@pytest.mark.parametrize("sp", [False, True])
def test_compiled_gpt_is_checked_and_types_its_gradients(cpu, sp):
    model, mesh, batch = fake_gpt(2, 2, sp)
    before = len(CHECKS)
    loss = _step(model, mesh, batch, compiled=True)
    assert len(CHECKS) > before, "no graph was checked: nothing compiled"
    assert spmd.get_type(loss) == {"dp": V, "tp": I}
    got = {n: dict(spmd.get_type(p.grad)) for n, p in model.named_parameters()}
    assert got == _expected_grad_types(model)
    compiled_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    eager_model, _, _ = fake_gpt(2, 2, sp)
    eager_loss = _step(eager_model, mesh, batch, compiled=False)
    torch.testing.assert_close(loss.detach(), eager_loss.detach())
    for n, p in eager_model.named_parameters():
        torch.testing.assert_close(compiled_grads[n], p.grad.detach(), msg=lambda m, n=n: f"{n}: {m}")


def test_fullgraph_stops_at_megatrons_async_all_reduce_typed_or_not(cpu):
    """A torch limit: dynamo refuses ``async_op=True`` collectives, which Megatron's linear backward uses."""
    model, mesh, batch = fake_gpt(2, 2, False)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="async_op=True for distributed collectives"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(batch["tokens"], batch["positions"], batch["mask"],
                                                                  labels=batch["labels"])
