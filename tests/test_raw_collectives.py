"""Raw torch.distributed collectives on typed tensors (spmd_types/_comm/raw_collectives.py).

Functional collectives run as the typed op they are (typed result, seed 003's
backward); in-place ones may not change their tensor's type; out= forms need a
typed output; everything else is rejected. Each rejection's text is pinned and
comes before any communication. Numerics on simulated ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalIntNode, LocalTensorMode, maybe_disable_local_tensor_mode

import spmd_types as spmd
from spmd_types._comm.raw_collectives import RAW_OPS, Form
from spmd_types.testing import CommCounter, denote, pair, per_rank, random_value, rank_values

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture
def tp4():
    mesh = fake_mesh((4,), ("tp",))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh), spmd.typecheck():
        yield mesh


@pytest.fixture
def mesh2x2():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh), spmd.typecheck():
        yield mesh



def _typed(mesh, types, shape=(4, 2), seed=0, grad=False):
    x = random_value(mesh, types, shape, seed)
    if grad:
        x.requires_grad_()
    return spmd.assert_type(x, types)


def _raises(fn, *args, **kwargs) -> spmd.SpmdTypeError:
    with CommCounter() as comms:
        with pytest.raises(spmd.SpmdTypeError) as info:
            fn(*args, **kwargs)
    assert comms.total == 0, "an error must come before any communication"
    return info.value


def _group(mesh, axis="tp"):
    return mesh.get_group(axis)


# ---------------------------------------------------------------------------
# in place: dist.all_reduce, dist.broadcast


def test_in_place_all_reduce_of_p_is_a_type_change(tp4):
    x = _typed(tp4, {"tp": P})
    before = rank_values(x)
    err = _raises(dist.all_reduce, x, group=_group(tp4))
    assert err.rule == (
        "torch.distributed.all_reduce writes its input in place, and an in-place op cannot change its "
        "tensor's type: on axis 'tp' it takes P to R."
    )
    assert err.seen == (("op", "torch.distributed.all_reduce"), ("input", "f32[4,2] {tp: P}"), ("axis", "'tp': P -> R"))
    assert err.fixes == ("x = spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)",)
    assert spmd.get_type(x) == {"tp": P}, "no wrong type left behind"
    assert all(torch.equal(v, before[r]) for r, v in rank_values(x).items())


def test_in_place_all_reduce_of_v_default_group(tp4):
    err = _raises(dist.all_reduce, _typed(tp4, {"tp": V}))  # group=None: the default group is the 'tp' axis
    assert err.fixes == ("x = spmd.all_reduce(x, 'tp', src=spmd.V, dst=spmd.R)",)


def test_default_group_of_a_2d_mesh_is_both_axes_flattened(mesh2x2):
    err = _raises(dist.all_reduce, _typed(mesh2x2, {"dp": P, "tp": P}))
    assert err.rule == (
        "torch.distributed.all_reduce writes its input in place, and an in-place op cannot change its "
        "tensor's type: on axis ('dp', 'tp') it takes P to R."
    )
    assert err.fixes == ("x = spmd.all_reduce(x, ('dp', 'tp'), src=spmd.P, dst=spmd.R)",)


def test_flattened_axes_with_different_types(mesh2x2):
    err = _raises(dist.all_reduce, _typed(mesh2x2, {"dp": P, "tp": R}))
    assert err.rule == (
        "torch.distributed.all_reduce runs on the flattened axes ('dp', 'tp'), and the input's types differ on "
        "them (dp: P, tp: R); one typed call per axis says what is meant."
    )


def test_all_reduce_sum_of_r_has_no_typed_equivalent(tp4):
    err = _raises(dist.all_reduce, _typed(tp4, {"tp": R}), group=_group(tp4))
    assert err.rule == (
        "torch.distributed.all_reduce on axis 'tp' has no typed equivalent for a R input: every rank holds the "
        "same R value, so their sum is not a typed all_reduce (seed 003 reduces P or V values)."
    )
    assert err.fixes == (
        "spmd.all_reduce(spmd.reinterpret(x, 'tp', src=spmd.R, dst=spmd.P), 'tp', src=spmd.P, dst=spmd.R)",
    )
    err = _raises(dist.all_reduce, _typed(tp4, {"tp": I}), group=_group(tp4))
    assert err.fixes == (
        "spmd.all_reduce(spmd.reinterpret(spmd.reinterpret(x, 'tp', src=spmd.I, dst=spmd.R), 'tp', src=spmd.R, "
        "dst=spmd.P), 'tp', src=spmd.P, dst=spmd.R)",
    )


def test_all_reduce_max_of_r_keeps_the_type_and_runs(tp4):
    x = _typed(tp4, {"tp": R})
    before = denote(x, tp4, {"tp": R})
    with CommCounter() as comms:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_group(tp4))
    assert comms.counts == {"all_reduce": 1}
    assert spmd.get_type(x) == {"tp": R}
    torch.testing.assert_close(denote(x, tp4, {"tp": R}), before)


def test_all_reduce_max_of_p_and_product_of_v(tp4):
    err = _raises(dist.all_reduce, _typed(tp4, {"tp": P}), op=dist.ReduceOp.MAX, group=_group(tp4))
    assert err.rule == (
        "torch.distributed.all_reduce on axis 'tp' has no typed equivalent for a P input: a pending sum means "
        "the sum over ranks, and the max of its summands is not a function of that sum."
    )
    err = _raises(dist.all_reduce, _typed(tp4, {"tp": V}), op=dist.ReduceOp.MAX, group=_group(tp4))
    assert err.fixes == ('x = spmd.all_reduce(x, \'tp\', src=spmd.V, dst=spmd.R, op="max")',)
    err = _raises(dist.all_reduce, _typed(tp4, {"tp": V}), op=dist.ReduceOp.PRODUCT, group=_group(tp4))
    assert err.rule.endswith("has no typed equivalent for a V input: op=product has no typed all_reduce.")
    assert err.fixes == ("spmd.all_gather(x, 'tp', src=spmd.V, dst=spmd.R), then reduce its dim 0 locally",)


def test_broadcast_of_r_runs_and_keeps_r(tp4):
    x = _typed(tp4, {"tp": R})
    with CommCounter() as comms:
        dist.broadcast(x, 0, group=_group(tp4))
    assert comms.counts == {"broadcast": 1}
    assert spmd.get_type(x) == {"tp": R}


def test_broadcast_repairs_values_but_of_v_is_rejected(tp4):
    x = _typed(tp4, {"tp": V})
    err = _raises(dist.broadcast, x, 2, group=_group(tp4))
    assert err.rule == (
        "torch.distributed.broadcast on axis 'tp' has no typed equivalent for a V input: a broadcast gives every "
        "rank rank 2's value: a V value would become R, with no backward in seed 003's table."
    )
    assert err.fixes == ("spmd.all_gather(x, 'tp', src=spmd.V, dst=spmd.R)[2]",)
    err = _raises(dist.broadcast, _typed(tp4, {"tp": P}), 0, group=_group(tp4))
    assert err.fixes == ("spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)",)


def test_raw_collective_with_grad_is_rejected(tp4):
    w = _typed(tp4, {"tp": R}, grad=True)
    y = w * 2
    err = _raises(dist.broadcast, y, 0, group=_group(tp4))
    assert err.rule == (
        "torch.distributed.broadcast has no backward: its input requires grad, and the gradient would stop at "
        "this collective silently."
    )
    assert err.fixes == ()
    with torch.no_grad():  # parameter sync at start-up: fine
        dist.broadcast(w, 0, group=_group(tp4))


# ---------------------------------------------------------------------------
# out= forms: all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single


def test_all_gather_into_plain_output_is_rejected(tp4):
    x = _typed(tp4, {"tp": S(0)}, shape=(2, 3))
    out = torch.empty(8, 3)
    err = _raises(dist.all_gather_single, out, x, group=_group(tp4))
    assert err.rule == (
        "torch.distributed.all_gather_single writes a typed result (R on axis 'tp') into a plain (untyped) "
        "output tensor, which would lose the type."
    )
    assert err.seen == (("op", "torch.distributed.all_gather_single"), ("result", "{tp: R}"),
                        ("output", "plain tensor (untyped)"))
    assert err.fixes == ("out = spmd.all_gather(x, 'tp', src=spmd.S(0), dst=spmd.R)",)


def test_all_gather_into_typed_output(tp4):
    x = _typed(tp4, {"tp": S(0)}, shape=(2, 3))
    out = spmd.assert_type(per_rank(lambda r: torch.zeros(8, 3)), {"tp": R})
    with CommCounter() as comms:
        dist.all_gather_single(out, x, group=_group(tp4))
    assert comms.counts == {"all_gather": 1}
    torch.testing.assert_close(denote(out, tp4, {"tp": R}), denote(x, tp4, {"tp": S(0)}))
    wrong = spmd.assert_type(per_rank(lambda r: torch.zeros(8, 3)), {"tp": V})
    err = _raises(dist.all_gather_single, wrong, x, group=_group(tp4))
    assert err.rule == (
        "torch.distributed.all_gather_single writes a result that is R on axis 'tp' into an output tensor that is V."
    )
    err = _raises(dist.all_gather_single, out, _typed(tp4, {"tp": V}, shape=(2, 3), grad=True), group=_group(tp4))
    assert err.fixes == ("out = spmd.all_gather(x, 'tp', src=spmd.S(0), dst=spmd.R)",)


def test_reduce_scatter_and_all_to_all_into_typed_outputs(tp4):
    x = _typed(tp4, {"tp": P}, shape=(8, 3))
    out = spmd.assert_type(per_rank(lambda r: torch.zeros(2, 3)), {"tp": V})
    with CommCounter() as comms:
        dist.reduce_scatter_single(out, x, group=_group(tp4))
    assert comms.counts == {"reduce_scatter": 1}
    torch.testing.assert_close(denote(out, tp4, {"tp": S(0)}), denote(x, tp4, {"tp": P}))
    err = _raises(dist.reduce_scatter_single, torch.empty(2, 3), x, group=_group(tp4))
    assert err.fixes == ("out = spmd.reduce_scatter(x, 'tp', src=spmd.P, dst=spmd.S(0))",)
    v = _typed(tp4, {"tp": V}, shape=(8, 3))
    got = spmd.assert_type(per_rank(lambda r: torch.zeros(8, 3)), {"tp": V})
    with CommCounter() as comms:
        dist.all_to_all_single(got, v, group=_group(tp4))
    assert comms.counts == {"all_to_all": 1}
    want = spmd.all_to_all(v, "tp", src=V, dst=V, split_dim=0, concat_dim=0)
    assert all(torch.equal(rank_values(got)[r], w) for r, w in rank_values(want).items())
    err = _raises(dist.all_to_all_single, got, _typed(tp4, {"tp": P}, shape=(8, 3)), group=_group(tp4))
    assert err.rule == (
        "torch.distributed.all_to_all_single on axis 'tp' has no typed equivalent for a P input: an all-to-all "
        "exchanges per-rank (V) blocks; seed 003 has no all_to_all from P."
    )


# ---------------------------------------------------------------------------
# functional collectives: typed results, seed 003's backward


def _adjoint(mesh, x, y, in_types, out_types, seed=7):
    g = random_value(mesh, {a: spmd.backward_type(t) for a, t in out_types.items()}, tuple(y.shape), seed)
    with CommCounter() as comms:
        (gx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(pair(y, g, mesh, out_types), pair(x, gx, mesh, in_types), rtol=1e-5, atol=1e-5)
    return comms.counts


@pytest.mark.parametrize("src", [P, V])
def test_functional_all_reduce(tp4, src):
    x = _typed(tp4, {"tp": src}, grad=True)
    with CommCounter() as comms:
        y = fc.all_reduce(x, "sum", _group(tp4))
    assert comms.counts == {"all_reduce": 1}
    assert spmd.get_type(y) == {"tp": R}
    meaning = denote(x, tp4, {"tp": P}) if src is P else denote(x, tp4, {"tp": V}).sum(0)
    torch.testing.assert_close(denote(y, tp4, {"tp": R}), meaning)
    assert _adjoint(tp4, x, y, {"tp": src}, {"tp": R}) == {"all_reduce": 1}


def test_functional_all_reduce_avg_and_max(tp4):
    x = _typed(tp4, {"tp": P}, grad=True)
    y = fc.all_reduce(x, "avg", _group(tp4))
    torch.testing.assert_close(denote(y, tp4, {"tp": R}), denote(x, tp4, {"tp": P}) / 4)
    assert _adjoint(tp4, x, y, {"tp": P}, {"tp": R}) == {"all_reduce": 1}
    r = _typed(tp4, {"tp": R})
    assert spmd.get_type(fc.all_reduce(r, "max", _group(tp4))) == {"tp": R}
    err = _raises(fc.all_reduce, r, "sum", _group(tp4))
    assert err.rule.startswith("torch.ops._c10d_functional.all_reduce on axis 'tp' has no typed equivalent")


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_functional_all_gather(tp4, gather_dim):
    x = _typed(tp4, {"tp": V}, shape=(2, 3), grad=True)
    y = fc.all_gather_single(x, gather_dim, _group(tp4))
    assert spmd.get_type(y) == {"tp": R}
    torch.testing.assert_close(denote(y, tp4, {"tp": R}), denote(x, tp4, {"tp": S(gather_dim)}))
    assert _adjoint(tp4, x, y, {"tp": V}, {"tp": R}) == {"reduce_scatter": 1}


def test_functional_reduce_scatter(tp4):
    x = _typed(tp4, {"tp": P}, shape=(8, 3), grad=True)
    y = fc.reduce_scatter_single(x, "sum", 0, _group(tp4))
    assert spmd.get_type(y) == {"tp": S(0)}
    torch.testing.assert_close(denote(y, tp4, {"tp": S(0)}), denote(x, tp4, {"tp": P}))
    assert _adjoint(tp4, x, y, {"tp": P}, {"tp": V}) == {"all_gather": 1}


@pytest.mark.parametrize("uneven", [False, True])
def test_functional_all_to_all(tp4, uneven):
    x = _typed(tp4, {"tp": V}, shape=(8, 3), grad=True)
    sizes = [1, 3, 2, 2] if uneven else [2, 2, 2, 2]  # every rank sends sizes[j] rows to rank j
    if uneven:  # so rank j receives sizes[j] rows from every rank: a per-rank output split
        out_splits = [torch.SymInt(LocalIntNode({j: sizes[j] for j in range(4)}))] * 4
        y = fc.all_to_all_single(x, out_splits, sizes, _group(tp4))
    else:
        y = fc.all_to_all_single(x, None, None, _group(tp4))
    assert spmd.get_type(y) == {"tp": V}
    xs, ys = rank_values(x), rank_values(y)
    for j in range(4):  # rank j gets piece j of every rank, in rank order
        torch.testing.assert_close(ys[j], torch.cat([xs[r].split(sizes)[j] for r in range(4)]))
    if not uneven:
        assert _adjoint(tp4, x, y, {"tp": V}, {"tp": V}) == {"all_to_all": 1}
        return
    gen = torch.Generator().manual_seed(3)
    with maybe_disable_local_tensor_mode():
        gs = {r: torch.randn(v.shape, generator=gen) for r, v in ys.items()}  # shapes differ per rank
    g = per_rank(lambda r: gs[r].clone())
    with CommCounter() as comms:
        (gx,) = torch.autograd.grad(y, x, g)
    assert comms.counts == {"all_to_all": 1}
    gxs = rank_values(gx)
    lhs = sum((ys[r].double() * gs[r].double()).sum() for r in range(4))
    rhs = sum((xs[r].double() * gxs[r].double()).sum() for r in range(4))
    torch.testing.assert_close(lhs, rhs)


def test_functional_broadcast_of_r_passes_the_gradient_through(tp4):
    x = _typed(tp4, {"tp": R}, grad=True)
    y = fc.broadcast(x, 0, _group(tp4))
    assert spmd.get_type(y) == {"tp": R}
    assert _adjoint(tp4, x, y, {"tp": R}, {"tp": R}) == {}


def test_functional_op_called_directly(tp4):
    x = _typed(tp4, {"tp": P})
    y = torch.ops._c10d_functional.all_reduce(x, "sum", _group(tp4).group_name)
    assert spmd.get_type(torch.ops._c10d_functional.wait_tensor(y)) == {"tp": R}


# ---------------------------------------------------------------------------
# everything else is rejected


def test_list_forms_and_c10d_ops_are_rejected(tp4):
    x = _typed(tp4, {"tp": V})
    err = _raises(dist.all_gather, [torch.empty(4, 2) for _ in range(4)], x, group=_group(tp4))
    assert err.rule == (
        "torch.distributed.all_gather on a typed tensor is not typed by spmd_types, so it would leave a wrong "
        "type behind."
    )
    assert err.fixes == ("spmd.all_gather(x, axis, src=spmd.V, dst=spmd.R).unbind(0)",)
    err = _raises(torch.ops.c10d.barrier.default, [x], _group(tp4), [], 0)
    assert err.fixes == ("the typed ops: spmd.all_reduce, spmd.all_gather, spmd.reduce_scatter, spmd.all_to_all",)


def test_group_outside_the_mesh(tp4):
    pair_group = dist.new_group([0, 1])
    err = _raises(dist.all_reduce, _typed(tp4, {"tp": P}), group=pair_group)
    assert err.rule == (
        "torch.distributed.all_reduce runs on a process group that is not an axis of the current mesh (nor a "
        "flattening of some of its axes), so what it does to the types is unknown."
    )
    assert err.seen[1:] == (("group", "ranks [0, 1]"), ("mesh", "tp"))


def test_outside_typecheck_raw_collectives_run_plainly():
    mesh = fake_mesh((4,), ("tp",))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh):
        with spmd.typecheck():
            x = _typed(mesh, {"tp": P})
        with CommCounter() as comms:
            dist.all_reduce(x, group=mesh.get_group("tp"))
        assert comms.counts == {"all_reduce": 1}


def test_the_table_names_every_form():
    assert {r.form for r in RAW_OPS.values()} == set(Form)
    assert all(r.display.startswith(("torch.distributed.", "torch.ops._c10d_functional.")) for r in RAW_OPS.values())


_NO_EQUIVALENT = " on axis 'tp' has no typed equivalent for a "
# (call, input type, rule after the op's name, fixes): every "no typed equivalent" reason, pinned
NO_EQUIVALENT_CASES = {
    "broadcast-P": (lambda x, g: dist.broadcast(x, 0, group=g), P,
                    "P input: a broadcast keeps one rank's summand of a pending sum, which is not its value.",
                    ("spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)",)),
    "all_gather-P": (lambda x, g: fc.all_gather_single(x, 0, g), P,
                     "P input: an all-gather takes per-rank (V) values, and a P value is one pending sum.",
                     ("spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R)",)),
    "all_gather-R": (lambda x, g: fc.all_gather_single(x, 0, g), R,
                     "R input: an all-gather takes per-rank (V) values; gathering the copies of an R value is not a "
                     "typed all_gather.",
                     ("spmd.all_gather(spmd.reinterpret(x, 'tp', src=spmd.R, dst=spmd.V), 'tp', src=spmd.S(0), "
                      "dst=spmd.R)",)),
    "reduce_scatter-max": (lambda x, g: fc.reduce_scatter_single(x, "max", 0, g), P,
                           "P input: op=max has no typed reduce_scatter.", ()),
    "reduce_scatter-I": (lambda x, g: fc.reduce_scatter_single(x, "avg", 0, g), I,
                         "I input: every rank holds the same I value, so their avg is not a typed reduce_scatter "
                         "(seed 003 reduces P or V values).",
                         ("spmd.reduce_scatter(spmd.reinterpret(spmd.reinterpret(x, 'tp', src=spmd.I, dst=spmd.R), "
                          "'tp', src=spmd.R, dst=spmd.P), 'tp', src=spmd.P, dst=spmd.S(0), op=\"avg\")",)),
    "all_to_all-R": (lambda x, g: fc.all_to_all_single(x, None, None, g), R,
                     "R input: an all-to-all exchanges per-rank (V) blocks; seed 003 has no all_to_all from R.",
                     ("spmd.all_to_all(spmd.reinterpret(x, 'tp', src=spmd.R, dst=spmd.V), 'tp', src=spmd.V, "
                      "dst=spmd.V, split_dim=0, concat_dim=0)",)),
    "all_reduce-product": (lambda x, g: dist.all_reduce(x, op=dist.ReduceOp.PRODUCT, group=g), V,
                           "V input: op=product has no typed all_reduce.",
                           ("spmd.all_gather(x, 'tp', src=spmd.V, dst=spmd.R), then reduce its dim 0 locally",)),
}


@pytest.mark.parametrize("case", list(NO_EQUIVALENT_CASES))
def test_no_typed_equivalent(tp4, case):
    call, t, rule, fixes = NO_EQUIVALENT_CASES[case]
    err = _raises(call, _typed(tp4, {"tp": t}, shape=(8, 2)), _group(tp4))
    assert err.rule.split(_NO_EQUIVALENT, 1)[1] == rule
    assert err.rule.startswith(("torch.distributed.", "torch.ops._c10d_functional."))
    assert err.fixes == fixes


def test_input_untyped_on_the_group_axis():
    mesh1 = fake_mesh((4,), ("tp",))
    with LocalTensorMode(4):
        with spmd.set_current_mesh(mesh1), spmd.typecheck():
            x = _typed(mesh1, {"tp": P})
        mesh2 = fake_mesh((2, 2), ("dp", "tp"))
        with spmd.set_current_mesh(mesh2), spmd.typecheck():
            err = _raises(dist.all_reduce, x, group=mesh2.get_group("dp"))
    assert err.rule == "torch.distributed.all_reduce: the input has no type on axis 'dp'."
    assert err.fixes == ("spmd.assert_type(x, {'dp': ...})",)


def test_functional_all_gather_in_global_spmd():
    mesh = fake_mesh((4,), ("tp",))
    with LocalTensorMode(4), spmd.set_current_mesh(mesh), spmd.typecheck(local=False):
        x = spmd.assert_type(random_value(mesh, {"tp": V}, (2, 3)), {"tp": S(0)})
        y = fc.all_gather_single(x, 0, mesh.get_group("tp"))
        assert spmd.get_type(y) == {"tp": R}
        assert spmd.get_partition_spec(y) == spmd.get_partition_spec(spmd.assert_type(torch.zeros(8, 3), {"tp": R}))
    torch.testing.assert_close(denote(y, mesh, {"tp": R}), denote(x, mesh, {"tp": S(0)}))


def test_functional_op_with_keyword_input(tp4):
    x = _typed(tp4, {"tp": R}, grad=True)
    with CommCounter() as comms:
        y = torch.ops._c10d_functional.broadcast(input=x, src=0, group_name=_group(tp4).group_name)
    assert comms.counts == {"broadcast": 1}
    assert spmd.get_type(y) == {"tp": R}
    assert all(torch.equal(v, rank_values(x)[r]) for r, v in rank_values(y).items())


# ---------------------------------------------------------------------------
# real processes: 4 gloo ranks on a (dp=2, tp=2) mesh, where each rank resolves its own groups


def _gloo_worker(rank: int, init_method: str, out_dir: str) -> None:
    import datetime
    import json
    import os
    import traceback

    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    row: dict = {}
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=4,
                                timeout=datetime.timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with spmd.set_current_mesh(mesh), spmd.typecheck():
            x = spmd.assert_type(torch.full((2,), float(rank + 1)), {"dp": P, "tp": P})
            everywhere = fc.all_reduce(x, "sum", dist.group.WORLD)  # the default group: both axes
            along_dp = fc.all_reduce(x, "sum", mesh.get_group("dp"))
            try:
                dist.all_reduce(x)
            except spmd.SpmdTypeError as err:
                row["in_place_fix"] = err.fixes[0]
            w = spmd.assert_type(torch.full((2,), float(rank)), {"dp": I, "tp": I})
            with torch.no_grad():
                dist.broadcast(w, 0)
        row.update(everywhere=[everywhere.tolist(), str(spmd.get_type(everywhere))],
                   along_dp=[along_dp.tolist(), str(spmd.get_type(along_dp))], broadcast=w.tolist())
        dist.barrier()  # every rank done before gloo is torn down
        dist.destroy_process_group()
    except Exception:
        row["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)


def test_on_gloo_processes(tmp_path):
    import json

    import torch.multiprocessing as mp

    if not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    mp.start_processes(_gloo_worker, args=("file://" + str(tmp_path / "store"), str(tmp_path)), nprocs=4,
                       join=True, start_method="spawn")
    rows = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    for r, row in rows.items():
        assert "error" not in row, row.get("error")
        assert row["everywhere"] == [[10.0, 10.0], "{'dp': R, 'tp': R}"]
        dp_sum = (r + 1) + ((r + 2) % 4 + 1)  # the dp line through rank r: ranks r and (r + 2) % 4
        assert row["along_dp"] == [[float(dp_sum)] * 2, "{'dp': R, 'tp': P}"]
        assert row["in_place_fix"] == "x = spmd.all_reduce(x, ('dp', 'tp'), src=spmd.P, dst=spmd.R)"
        assert row["broadcast"] == [0.0, 0.0]


def test_functional_in_place_ops_and_async(tp4):
    name = _group(tp4).group_name
    err = _raises(torch.ops._c10d_functional.all_reduce_, _typed(tp4, {"tp": P}), "sum", name)
    assert err.rule == (
        "torch.ops._c10d_functional.all_reduce_ writes its input in place, and an in-place op cannot change its "
        "tensor's type: on axis 'tp' it takes P to R."
    )
    r = _typed(tp4, {"tp": R})
    with CommCounter() as comms:
        torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.broadcast_(r, 0, name))
        work = dist.all_reduce(r, op=dist.ReduceOp.MIN, group=_group(tp4), async_op=True)
        work.wait()
    assert comms.counts == {"broadcast": 1, "all_reduce": 1}
    assert spmd.get_type(r) == {"tp": R}


def test_error_points_at_the_callers_line_through_a_deprecated_name(tp4):
    x = _typed(tp4, {"tp": S(0)}, shape=(2, 3))
    err = _raises(dist.all_gather_into_tensor, torch.empty(8, 3), x, group=_group(tp4))  # deprecated: calls _single
    assert err.source is not None and "test_raw_collectives.py" in err.source
    assert err.rule.startswith("torch.distributed.all_gather_single writes a typed result")
