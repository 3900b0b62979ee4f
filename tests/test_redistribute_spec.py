"""spmd.redistribute with partition specs: planned, run on simulated ranks, typed, global value kept."""

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types.testing import CommCounter

PS = spmd.PartitionSpec


def _shards(lm, mesh, full, spec):
    """Per-rank shards of ``full`` laid out by a 1-entry-per-dim spec of single axes or axis tuples."""
    def shard(r):
        out = full
        coord = dict(zip(mesh.mesh_dim_names, [int(i) for i in (mesh.mesh == r).nonzero()[0]]))
        for d, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            for a in axes:
                n = mesh.size(mesh.mesh_dim_names.index(a))
                size = out.shape[d] // n
                out = out.narrow(d, coord[a] * size, size)
        return out.clone()

    return lm.rank_map(shard)


def test_plan_redistribute_uses_the_current_mesh_and_fuses_axes():
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with spmd.set_current_mesh(mesh):
        plan = spmd.plan_redistribute((8, 4), PS(None, None), PS(None, None), src_partial=("dp", "tp"))
    assert plan.collectives == [("all_reduce", ("dp", "tp"))]
    assert plan.total_bytes < plan.naive_bytes


@pytest.mark.parametrize(
    "src, dst",
    [
        (PS(("dp", "tp"), None), PS(("tp", "dp"), None)),
        (PS("tp", None), PS(None, "tp")),
        (PS("dp", "tp"), PS(None, None)),
    ],
)
def test_typed_spec_redistribute_keeps_the_global_value(src, dst):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    full = torch.arange(32.0).reshape(8, 4)
    with LocalTensorMode(4) as lm:
        x = _shards(lm, mesh, full, src)
        expected = _shards(lm, mesh, full, dst)
        with spmd.set_current_mesh(mesh), spmd.typecheck(local=False):
            x = spmd.assert_type(x, {}, partition_spec=src)
            plan = spmd.plan_redistribute(x, src, dst)
            with CommCounter() as counter:
                y = spmd.redistribute(x, src, dst)
            assert spmd.get_partition_spec(y) == PS(*[None if e is None else e for e in dst])
            placed = {a for e in dst if e is not None for a in ((e,) if isinstance(e, str) else e)}
            assert spmd.get_type(y) == {a: (spmd.V if a in placed else spmd.R) for a in ("dp", "tp")}
    planned: dict[str, int] = {}
    for name, _axes in plan.collectives:
        planned[name] = planned.get(name, 0) + 1
    assert {k: v for k, v in counter.counts.items() if v} == planned
    for r in range(4):
        assert torch.equal(y._local_tensors[r], expected._local_tensors[r])


def test_src_spec_must_describe_the_tensor():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with spmd.set_current_mesh(mesh), spmd.typecheck(local=False):
        x = spmd.assert_type(torch.randn(4, 4), {"tp": spmd.S(0)})
        with pytest.raises(spmd.SpmdTypeError, match="src_spec .* must describe the tensor as it is"):
            spmd.redistribute(x, PS(None, "tp"), PS(None, None))
