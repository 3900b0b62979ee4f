"""Typed checkpoints: state_dict keeps types, torch.load(weights_only=True) restores them, loads check them.

Each rank saves and loads its own local state, so these run on rank 0 of a
fake process group (real tensors, no communication).
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import spmd_types as spmd

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V
DP_V = {"dp": V, "tp": V}


@pytest.fixture
def mesh(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp):
        yield mesh_dp_tp


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _typed_model(types=None, seed=0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(4, 2)
    with spmd.typecheck():
        spmd.assert_type(lin, types or DP_V)
    return lin


def _train_step(lin, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with spmd.typecheck():
        x = spmd.assert_type(torch.randn(3, 4, generator=g), DP_V)
        opt.zero_grad()
        lin(x).pow(2).sum().backward()
        opt.step()


def test_state_dict_keeps_types_inside_and_outside_typecheck(mesh):
    lin = _typed_model({"dp": R, "tp": S(0)})
    with spmd.typecheck():
        inside = lin.state_dict()
    outside = lin.state_dict()
    for sd in (inside, outside):
        assert spmd.get_type(sd["weight"]) == {"dp": R, "tp": S(0)}
        assert spmd.get_type(sd["bias"]) == {"dp": R, "tp": S(0)}
        assert torch.equal(sd["weight"].as_subclass(torch.Tensor), lin.weight.detach().as_subclass(torch.Tensor))
        assert not sd["weight"].requires_grad


def test_weights_only_load_restores_types_and_values(mesh):
    lin = _typed_model({"dp": R, "tp": S(0)})
    loaded = _roundtrip({"model": lin.state_dict(), "param": lin.weight})
    assert spmd.get_type(loaded["model"]["weight"]) == {"dp": R, "tp": S(0)}
    assert torch.equal(loaded["model"]["bias"].as_subclass(torch.Tensor), lin.bias.detach().as_subclass(torch.Tensor))
    p = loaded["param"]
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and spmd.get_type(p) == {"dp": R, "tp": S(0)}


def test_optimizer_state_round_trip_resumes_training_exactly(mesh):
    lin = _typed_model()
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    _train_step(lin, opt, 1)
    ckpt = _roundtrip({"model": lin.state_dict(), "opt": opt.state_dict()})
    assert spmd.get_type(ckpt["opt"]["state"][0]["exp_avg"]) == DP_V
    _train_step(lin, opt, 2)  # the uninterrupted run

    fresh = _typed_model(seed=5)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    spmd.load_state_dict(fresh, ckpt["model"])
    spmd.load_state_dict(fresh_opt, ckpt["opt"])
    assert spmd.get_type(fresh.weight) == DP_V and spmd.get_type(fresh_opt.state[fresh.weight]["exp_avg"]) == DP_V
    _train_step(fresh, fresh_opt, 2)  # the resumed run
    for a, b in zip(lin.parameters(), fresh.parameters()):
        assert torch.equal(a.detach().as_subclass(torch.Tensor), b.detach().as_subclass(torch.Tensor))


def test_plain_and_compatible_checkpoints_load(mesh):
    lin = _typed_model({"dp": R, "tp": V})
    lin.load_state_dict({"weight": torch.ones(2, 4), "bias": torch.zeros(2)})  # untyped: nothing to check
    assert spmd.get_type(lin.weight) == {"dp": R, "tp": V} and float(lin.weight.detach().sum()) == 8.0
    spmd.load_state_dict(lin, _typed_model({"dp": R, "tp": S(0)}).state_dict())  # S(0) refines V
    assert spmd.get_type(lin.weight) == {"dp": R, "tp": V}


def test_module_load_of_another_type_is_refused_naming_the_key(mesh):
    sd = _typed_model({"dp": V, "tp": S(0)}).state_dict()
    lin = _typed_model({"dp": R, "tp": S(0)})
    before = lin.weight.detach().clone()
    with pytest.raises(RuntimeError) as info:
        lin.load_state_dict(sd)
    text = str(info.value)
    assert 'While copying the parameter named "weight"' in text
    assert (
        "Loading a value of another type: the value copied in (Tensor.copy_) is V on axis 'dp', and the tensor "
        "it is loaded into is R.\\n  loaded: {dp: V, tp: S(0)}\\n  into:   {dp: R, tp: S(0)}" in text
    )
    assert torch.equal(lin.weight.detach(), before)
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.load_state_dict(lin, sd)
    assert str(info.value) == (
        "Loading a value of another type: state_dict['weight'] is V on axis 'dp', and the tensor it is loaded into "
        "is R.\n"
        "  loaded: {dp: V, tp: S(0)}\n"
        "  into:   {dp: R, tp: S(0)}\n"
        "  axis:   'dp': V is not R\n"
        "  fix:    save and load with the same types (a checkpoint keeps the types it was saved with)"
    )


def test_shard_dims_must_agree(mesh):
    saved, live = _typed_model({"dp": R, "tp": V}), _typed_model({"dp": R, "tp": V})
    with spmd.typecheck():
        spmd.assert_type(saved.weight, {"tp": S(0)})  # a refining assert: V -> S(d)
        spmd.assert_type(live.weight, {"tp": S(1)})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.check_state_dict(live, saved.state_dict())
    assert info.value.rule == (
        "Loading a value of another type: state_dict['weight'] is S(0) on axis 'tp', and the tensor it is loaded "
        "into is S(1)."
    )


def test_optimizer_state_of_another_type_is_refused(mesh):
    lin = _typed_model()
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    _train_step(lin, opt, 1)
    sd = opt.state_dict()
    other = _typed_model({"dp": I, "tp": V})
    with pytest.raises(spmd.SpmdTypeError) as info:
        spmd.load_state_dict(torch.optim.Adam(other.parameters()), sd)  # before any step: against the parameter
    assert info.value.rule == (
        "Loading a value of another type: state_dict['state'][0]['exp_avg'] is V on axis 'dp', and the tensor it "
        "is loaded into is I."
    )
    with pytest.raises(TypeError) as info:
        spmd.check_state_dict({"weight": 1}, sd)
    assert str(info.value) == "spmd.check_state_dict takes an nn.Module or a torch.optim.Optimizer, got dict"


class _Forged:
    def __init__(self, reduce_to):
        self.reduce_to = reduce_to

    def __reduce__(self):
        return self.reduce_to


def test_weights_only_stays_safe(mesh):
    from spmd_types._core.types import _type_map_of

    # Our rebuild functions validate their arguments...
    with pytest.raises(TypeError) as info:
        _roundtrip(_Forged((_type_map_of, (("tp", "not a type"),))))
    assert str(info.value) == "a TypeMap is a tuple of (axis name, SPMD type) pairs, got ('tp', 'not a type')"
    # ...and nothing else became loadable.
    with pytest.raises(pickle.UnpicklingError) as info:
        _roundtrip(_Forged((print, ("hi",))))
    assert "Unsupported global: GLOBAL print was not an allowed global by default." in str(info.value)
    assert set(spmd._boundaries.checkpoint.SAFE_GLOBALS) <= set(torch.serialization.get_safe_globals())


def test_global_spmd_partition_specs_survive_the_round_trip(mesh):
    with spmd.typecheck(local=False):
        w = torch.nn.Parameter(torch.randn(4, 2))
        spmd.assert_type(w, {"dp": S(0), "tp": R})
    got = _roundtrip({"w": w.detach()})["w"]  # detached outside typecheck
    assert spmd.get_type(got) == {"dp": S(0), "tp": R}
    assert spmd.get_partition_spec(got) == spmd.PartitionSpec("dp", None)


def test_to_keeps_the_type_outside_typecheck(mesh):
    lin = _typed_model()
    lin.to(torch.float64)
    assert lin.weight.dtype == torch.float64 and spmd.get_type(lin.weight) == DP_V
    assert spmd.get_type(lin.weight.detach().to(torch.float32)) == DP_V
    assert spmd.get_type((lin.weight * 2).detach()) is None  # other ops outside typecheck stay erased
