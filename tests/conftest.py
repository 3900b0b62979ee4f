"""Shared fixtures: a fake process group of the size a test needs, and meshes on it."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


def fake_world(size: int) -> None:
    """Make the default process group a fake one of ``size`` ranks (rank 0)."""
    if dist.is_initialized():
        if dist.get_world_size() == size and dist.get_backend() == "fake" and dist.get_rank() == 0:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())


def torch_calls_spmd_types() -> bool:
    """Whether this torch's FSDP2 reads spmd types (torch 2.14 on; 2.13 has the flag but no caller)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "_restore_spmd_types")


def by_region(types: dict) -> dict:
    """``{name: type}`` keyed as ``spmd.get_local_type`` keys it: by the current mesh's region for each name."""
    import spmd_types as spmd

    return {spmd.normalize_axis(a): t for a, t in types.items()}


def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A DeviceMesh of ``shape`` with ``names`` on a fake process group of matching size."""
    fake_world(math.prod(shape))
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


@pytest.fixture
def mesh_dp_tp():
    """The (dp=2, tp=4) mesh on 8 fake ranks."""
    return fake_mesh((2, 4), ("dp", "tp"))


@pytest.fixture
def mesh_tp4():
    return fake_mesh((4,), ("tp",))


# The rules tests' fixtures (typed operands on a (dp=2, tp=4) mesh; a fresh result cache per test).
from rules_support import _fresh_cache, mesh, x  # noqa: E402, F401
