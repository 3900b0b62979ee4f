"""torch's own autograd Functions that real trainers apply to typed activations (issue 14, item 2).

FSDP2 (``fully_shard``) and DDP wrap a module's activations in identity
Functions so that their hooks run when backward reaches them; torchtitan's
activation checkpointing re-runs a block; torch's tensor-parallel styles turn
plain local inputs into DTensors with ``DTensor.from_local``. None may be
refused as an unregistered custom Function: FSDP2's, DDP's and checkpoint's
run with their bodies checked op by op (their communication is on the
parameters, never on the activations' gradients), and ``DTensor.from_local``
is checked like ``spmd.to_dtensor`` (tests/test_dtensor_placements.py).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types._guards.function_guard import _TORCH_TRANSPARENT
from spmd_types.testing import denote, random_value

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("local", [True, False], ids=["local", "global"])
def test_fully_shard_runs_on_typed_activations(local):
    """FSDP2's RegisterPreBackwardFunction and RegisterPostBackwardFunction (a fake process group: fully_shard
    frees storage, which simulated ranks do not have)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = fake_mesh((2,), ("dp",))
    model = _mlp()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with spmd.set_current_mesh(mesh), spmd.typecheck(local=local):
        x = spmd.assert_type(torch.randn(4, 4, requires_grad=True), {"dp": S(0)})
        out = model(x)
        assert spmd.get_type(out) == {"dp": V}
        if not local:
            assert spmd.get_partition_spec(out) == spmd.PartitionSpec("dp", None)
        spmd.all_reduce(spmd.sum(out, out_partial_axes="dp") if not local else out.sum(), "dp",
                        src=P if not local else V, dst=I).backward()
    assert spmd.get_type(x.grad) == {"dp": S(0)}
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_ddp_static_graph_runs_on_typed_activations():
    """DDP's _DDPSink (static_graph=True) on a fake dp group."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = fake_mesh((2,), ("dp",))
    model = _mlp()
    ddp = DistributedDataParallel(model, process_group=mesh.get_group("dp"), static_graph=True)
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd.assert_type(model, {"dp": R})
        spmd.register_ddp(ddp, "dp")
        x = spmd.assert_type(torch.randn(3, 4, requires_grad=True), {"dp": V})
        out = ddp(x)
        assert spmd.get_type(out) == {"dp": V}
        out.pow(2).sum().backward()
    assert spmd.get_type(x.grad) == {"dp": V}
    assert all(spmd.get_type(p.grad) == {"dp": R} for p in model.parameters())


@pytest.mark.parametrize("impl", ["NO_REENTRANT", "REENTRANT"])
def test_checkpoint_wrapper_on_typed_activations_matches_the_plain_block(impl):
    """torchtitan's activation checkpointing (torch.distributed's checkpoint_wrapper), on simulated ranks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    mesh = fake_mesh((2,), ("tp",))
    plain, wrapped = _mlp(), checkpoint_wrapper(_mlp(), checkpoint_impl=getattr(CheckpointImpl, impl))
    grads = []
    with LocalTensorMode(2), spmd.set_current_mesh(mesh), spmd.typecheck():
        for block in (plain, copy.deepcopy(wrapped)):
            spmd.assert_type(block, {"tp": R})
            x = spmd.assert_type(random_value(mesh, {"tp": V}, (3, 4)).requires_grad_(), {"tp": V})
            out = block(x)
            assert spmd.get_type(out) == {"tp": V}
            out.pow(2).sum().backward()
            grads.append([denote(x.grad, mesh, {"tp": V})] + [denote(p.grad, mesh, {"tp": P}) for p in
                                                              block.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_a_bug_inside_a_transparent_torch_function_is_still_caught():
    """Transparent means checked op by op: an I + V mix inside a checkpointed block is the rules' error."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    mesh = fake_mesh((2,), ("tp",))

    class AddBias(torch.nn.Module):
        def forward(self, h, b):
            return F.gelu(h + b)

    with spmd.set_current_mesh(mesh), spmd.typecheck():
        h = spmd.assert_type(torch.randn(3, 4, requires_grad=True), {"tp": V})
        b = spmd.assert_type(torch.randn(4, requires_grad=True), {"tp": I})
        with pytest.raises(spmd.SpmdTypeError) as err:
            checkpoint_wrapper(AddBias())(h, b)
    assert err.value.rule.startswith("Invariant (I) values only combine with other I values: Tensor.__add__ (+)")


@pytest.mark.parametrize("name", sorted(_TORCH_TRANSPARENT))
def test_every_torch_function_named_transparent_exists(name):
    """A rename in torch must fail here, not silently refuse the Function again."""
    module, _, qualname = name.rpartition(".")
    cls = getattr(importlib.import_module(module), qualname)
    assert issubclass(cls, torch.autograd.Function)
