"""The result caches of answers that read more than the operands' types (``_checker/result_keys.py``,
``_core/spaces.py``'s ``move_types``).

An op on tensors typed on different presentations of the ranks (a dense and an expert mesh, an MoE layer)
moves its operands onto the current mesh: its answer depends on that mesh too, and is cached with the
mesh's token (and, for a gradient-free acceptance, with the operands' gradient bits as well). A hit must be
the full inference exactly: each case runs with the caches emptied (the full path) and warm (a hit), under
each mesh in turn, and the answers and refusals are compared.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import spmd_types as spmd
from spmd_types._checker import tensor as _tensor
from spmd_types._core import spaces
from spmd_types._core.types import Space, TypeMap
from spmd_types.testing import simulate

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


def _empty() -> None:
    for cache in _tensor._CACHES:
        cache.clear()
    spaces._MOVED.clear()


@pytest.fixture
def meshes():
    with simulate((2, 2, 2), ("dp", "cp", "tp")) as dense, spmd.typecheck():
        flat = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_cp", "tp"))
        yield dense, flat


def _answer(fn):
    """The type of ``fn()``'s result, or the refusal's rule."""
    try:
        return spmd.get_type(fn())
    except spmd.SpmdTypeError as e:
        return e.rule


def _full_and_hit(fn):
    _empty()
    full = _answer(fn)
    return full, _answer(fn)


def test_an_op_on_two_meshes_is_cached_per_current_mesh(meshes):
    dense, flat = meshes
    x = spmd.assert_type(torch.randn(3), {"dp": V, "cp": V, "tp": R})
    with spmd.set_current_mesh(flat):
        y = spmd.assert_type(torch.randn(3), {"dp_cp": V, "tp": R})
    on = {"dense": dense, "flat": flat}
    want = {"dense": {"dp": V, "cp": V, "tp": R}, "flat": {"dp_cp": V, "tp": R}}
    for name, mesh in on.items():
        with spmd.set_current_mesh(mesh):
            assert _full_and_hit(lambda: x * y) == (want[name], want[name])
    _empty()
    for name in ("dense", "flat", "dense", "flat"):  # warm from the other mesh: never its answer
        with spmd.set_current_mesh(on[name]):
            assert _answer(lambda: x * y) == want[name]
    key = (torch.Tensor.__mul__, x._spmd_types, y._spmd_types)
    assert type(_tensor._CACHES[False][key]).__name__ == "Keyed"


def test_a_gradient_free_acceptance_across_meshes_is_cached_with_the_gradients(meshes):
    """I meets V across meshes: accepted only while the I operand carries no gradient (choice 13); the cached
    acceptance is never reused for a differentiable operand, under either mesh."""
    dense, flat = meshes
    with spmd.set_current_mesh(flat):
        v = spmd.assert_type(torch.randn(3), {"dp_cp": V, "tp": V})
    plain_i = spmd.assert_type(torch.randn(3), {"dp": V, "cp": V, "tp": I})
    grad_i = spmd.assert_type(torch.randn(3, requires_grad=True), {"dp": V, "cp": V, "tp": I})
    refused = "Invariant (I) values only combine with other I values"
    _empty()
    for _ in range(3):
        for mesh, want in ((flat, {"dp_cp": V, "tp": V}), (dense, {"dp": V, "cp": V, "tp": V})):
            with spmd.set_current_mesh(mesh):
                assert _answer(lambda: plain_i * v) == want
                assert _answer(lambda: grad_i * v).startswith(refused)
    with spmd.set_current_mesh(flat):
        assert _full_and_hit(lambda: grad_i * v)[1].startswith(refused)
        assert _full_and_hit(lambda: plain_i * v) == ({"dp_cp": V, "tp": V},) * 2


def test_a_refusal_to_move_is_never_cached(meshes):
    _, flat = meshes
    mixed = spmd.assert_type(torch.ones(3), {"dp": R, "cp": V, "tp": R})
    with spmd.set_current_mesh(flat):
        y = spmd.assert_type(torch.randn(3), {"dp_cp": V, "tp": R})
        full, hit = _full_and_hit(lambda: mixed * y)
    assert full == hit == (
        "Tensor.__mul__ (*) mixes tensors typed on different meshes, and input cannot be moved onto the current mesh: "
        "axes (dp, cp) would flatten into (dp_cp), but their types differ (dp: R, cp: V); a flattened axis has one "
        "type.")


def test_move_types_remembers_the_full_answer(meshes):
    """``move_types`` is a pure function of two interned values: a remembered answer equals a fresh one (moves
    and refusals), and the groups it returns are immutable."""
    dense, flat = meshes
    dense_space = _space(dense)
    flat_space = _space(flat)
    cases = [
        (TypeMap.of({"dp": V, "cp": V, "tp": R}, dense_space), flat_space),
        (TypeMap.of({"dp": R, "cp": R, "tp": P}, dense_space), flat_space),
        (TypeMap.of({"dp": R, "cp": V, "tp": R}, dense_space), flat_space),  # refused: a group mixes types
        (TypeMap.of({"dp_cp": V, "tp": I}, flat_space), dense_space),
    ]
    spaces._MOVED.clear()
    for types, target in cases:
        fresh = spaces._move_types(types, target)
        first, again = spaces.move_types(types, target), spaces.move_types(types, target)
        assert again is first
        if isinstance(fresh, str):
            assert first == fresh
        else:
            assert first[0] is fresh[0] and first[1] == tuple(fresh[1]) and type(first[1]) is tuple


def _space(mesh) -> Space:
    with spmd.set_current_mesh(mesh):
        from spmd_types._core.mesh import current_mesh

        return current_mesh().space


# ---------------------------------------------------------------------------
# a registered Function's pure rule, remembered per its arguments' own types, shapes and the mesh


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):  # k: a number, or sizes (a list, a numpy array) whose first scales
        return x * (k if isinstance(k, (int, float)) else float(k[0]))

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


_ASKED: list = []


def _rule(x, k):
    _ASKED.append((x, k))
    if x is None or any(t is P for _, t in x.items):
        from spmd_types._core.errors import Rejection

        return Rejection("no P here", [("x", str(x))], [])
    return {a: (V if t.is_varying else t) for a, t in x.items}


@pytest.fixture
def scale():
    from spmd_types._boundaries.autograd_functions import pure_rule

    spmd.register_autograd_function(_Scale, rule=pure_rule(_rule))
    try:
        yield
    finally:
        spmd.unregister_autograd_function(_Scale)


def test_a_pure_rule_is_asked_once_per_types_and_mesh_and_a_hit_is_its_answer(meshes, scale):
    """The key holds the arguments' own types and the mesh's token: a tensor typed on the dense mesh is
    presented to the rule on the flat one, and the flat mesh's answer is never the dense one's."""
    dense, flat = meshes
    x = spmd.assert_type(torch.randn(3), {"dp": V, "cp": V, "tp": R})
    want = {"dense": {"dp": V, "cp": V, "tp": R}, "flat": {"dp_cp": V, "tp": R}}
    from spmd_types._boundaries import autograd_functions as af

    af._RULE_RESULTS.clear()
    for _ in range(2):
        for name, mesh in (("dense", dense), ("flat", flat)):
            _ASKED.clear()
            with spmd.set_current_mesh(mesh):
                assert spmd.get_type(_Scale.apply(x, 2.0)) == want[name]
                assert spmd.get_type(_Scale.apply(x, 2.0)) == want[name]
            assert len(_ASKED) <= 1
            if _ASKED:
                assert _ASKED[0][0].as_dict() == want[name]  # presented on the current mesh
    _ASKED.clear()
    with spmd.set_current_mesh(flat):
        assert spmd.get_type(_Scale.apply(x, 3.0)) == want["flat"]  # another argument value: asked again
    assert len(_ASKED) == 1


def test_a_pure_rule_refusal_or_an_unhashable_argument_is_asked_every_time(meshes, scale):
    dense, _ = meshes
    p = spmd.assert_type(torch.randn(3), {"dp": P, "cp": V, "tp": R})
    v = spmd.assert_type(torch.randn(3), {"dp": V, "cp": V, "tp": R})
    _ASKED.clear()
    for _ in range(2):
        with pytest.raises(spmd.SpmdTypeError):
            _Scale.apply(p, 2.0)
        assert spmd.get_type(_Scale.apply(v, [2.0])) == {"dp": V, "cp": V, "tp": R}
    assert len(_ASKED) == 4


def test_a_pure_rule_given_sizes_is_remembered_by_their_values(meshes, scale):
    """A list of sizes (an all-to-all's splits) is part of the key by value; a list of anything else is not
    remembered at all (asked every time)."""
    dense, _ = meshes
    v = spmd.assert_type(torch.randn(3), {"dp": V, "cp": V, "tp": R})
    _ASKED.clear()
    for k in ([2], [2], [3], [2]):
        assert spmd.get_type(_Scale.apply(v, k)) == {"dp": V, "cp": V, "tp": R}
    assert [asked[1] for asked in _ASKED] == [[2], [3]]
    _ASKED.clear()
    for _ in range(2):
        _Scale.apply(v, [2.0])
    assert len(_ASKED) == 2


def _count_and_total(own: tuple, args: tuple) -> tuple:
    return own[0], (len(args[1]), sum(int(s) for s in args[1]))


def _sized_rule(x, sizes):  # its own function: pure_rule and rule_reads mark the function they are given
    return _rule(x, sizes)


def test_a_pure_rule_that_says_what_it_reads_is_keyed_by_that(meshes):
    """rule_reads: a rule that reads only the count and total of its sizes (Megatron's all-to-all) is asked once
    per count and total, whatever the values (a numpy array too, which the plain key cannot hold). _Scale is
    registered here with such a rule instead of the fixture's."""
    import numpy as np

    from spmd_types._boundaries.autograd_functions import pure_rule, rule_reads

    dense, _ = meshes
    spmd.register_autograd_function(_Scale, rule=pure_rule(rule_reads(_count_and_total)(_sized_rule)))
    try:
        v = spmd.assert_type(torch.randn(3), {"dp": V, "cp": V, "tp": R})
        _ASKED.clear()
        for k in ([1, 2], [2, 1], np.array([3, 0]), [2, 2], [1, 2, 0], np.array([4, 0])):
            assert spmd.get_type(_Scale.apply(v, k)) == {"dp": V, "cp": V, "tp": R}
        assert [list(asked[1]) for asked in _ASKED] == [[1, 2], [2, 2], [1, 2, 0]]
    finally:
        spmd.unregister_autograd_function(_Scale)
