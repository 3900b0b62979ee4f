"""torch 2.14's DTensor ``local_map(..., spmd_types=True)`` checks its body with this package.

torch annotates each DTensor argument's local tensor from its placements
(``Shard -> V``, ``Replicate -> R``, or I when its gradient is ``Replicate``,
``Partial -> P``; ``assert_type`` keyed by ``MeshAxis``), runs the body inside
``spmd_types._checker.typecheck(strict_mode="strict")``, then reads the
outputs' types (``get_local_type``) to check ``out_placements`` and to choose
the gradients' placements. Run on simulated ranks against one device.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh, torch_calls_spmd_types
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import rank_values

if not torch_calls_spmd_types():
    pytest.skip("local_map(spmd_types=True) is torch 2.14's", allow_module_level=True)

from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.experimental import local_map  # noqa: E402

R, I, V = spmd.R, spmd.I, spmd.V


@pytest.fixture
def mesh():
    return fake_mesh((2, 2), ("dp", "tp"))


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


X_IN, W_IN = [Shard(0), Replicate()], [Replicate(), Shard(1)]
X_GRAD, W_GRAD = [Shard(0), Partial()], [Partial(), Shard(1)]  # each rank's part of a replicated input's gradient


def _run(body, mesh, grads, spmd_types=True):
    """``body(x, w)`` through torch's local_map on 4 simulated ranks; the output and both gradients, whole."""
    mapped = local_map(body, out_placements=[Shard(0), Shard(1)], device_mesh=mesh, spmd_types=spmd_types,
                       in_placements=(X_IN, W_IN), in_grad_placements=grads)
    with LocalTensorMode(4):
        x = distribute_tensor(_full(0, 4, 8), mesh, X_IN).requires_grad_()
        w = distribute_tensor(_full(1, 8, 6), mesh, W_IN).requires_grad_()
        y = mapped(x, w)
        y.pow(2).sum().backward()
        return [rank_values(t.full_tensor())[0] for t in (y, x.grad, w.grad)]  # every rank holds the whole


def _one_device():
    x, w = _full(0, 4, 8).requires_grad_(), _full(1, 8, 6).requires_grad_()
    y = torch.relu(x @ w)
    y.pow(2).sum().backward()
    return [y.detach(), x.grad, w.grad]


def test_body_is_typed_from_placements_and_matches_one_device(mesh):
    seen = {}

    def body(x, w):
        seen["x"], seen["w"], seen["checking"] = spmd.get_type(x), spmd.get_type(w), spmd.is_type_checking()
        y = torch.relu(x @ w)
        seen["y"] = spmd.get_type(y)
        return y

    got = _run(body, mesh, (X_GRAD, W_GRAD))
    assert seen == {"x": {"dp": V, "tp": R}, "w": {"dp": R, "tp": V}, "checking": True, "y": {"dp": V, "tp": V}}
    for value, ref in zip(got, _one_device()):
        torch.testing.assert_close(value, ref)


def relu_matmul(x, w):
    return torch.relu(x @ w)  # x is I on tp, w is V: x's gradient needs the sum over tp its placement denies


def test_a_replicated_gradient_on_a_replicated_input_is_refused_where_plain_local_map_is_wrong(mesh):
    grads = ([Shard(0), Replicate()], [Replicate(), Shard(1)])  # x's gradient declared Replicate: x is I
    unchecked = _run(relu_matmul, mesh, grads, spmd_types=False)
    ref = _one_device()
    assert not torch.allclose(unchecked[1], ref[1])  # without types: x's gradient silently wrong
    with pytest.raises(spmd.SpmdTypeError) as info:
        _run(relu_matmul, mesh, grads)
    assert info.value.rule.startswith("Invariant (I) values only combine with other I values: ")
    assert "return torch.relu(x @ w)  # x is I on tp" in str(info.value)


def test_an_output_placement_the_types_contradict_gets_torchs_error(mesh):
    mapped = local_map(lambda x, w: x @ w, out_placements=[Shard(0), Replicate()], device_mesh=mesh,
                       spmd_types=True, in_placements=([Shard(0), Replicate()], [Replicate(), Shard(1)]))
    with LocalTensorMode(4):
        x = distribute_tensor(_full(0, 4, 8), mesh, [Shard(0), Replicate()])
        w = distribute_tensor(_full(1, 8, 6), mesh, [Replicate(), Shard(1)])
        with pytest.raises(ValueError) as info:
            mapped(x, w)
    assert str(info.value) == "Output tensor placement mismatch on tp: out_placements=R but spmd_types " \
                              "inferred spmd.V"
