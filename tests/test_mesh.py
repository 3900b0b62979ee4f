"""The current mesh: DeviceMesh or {name: ProcessGroup}, nesting, axis lookup."""

import pytest
import torch
import torch.distributed as dist

import spmd_types as spmd
from spmd_types._core.mesh import current_mesh, resolve_axis


def test_device_mesh_axes(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp) as m:
        assert m.axis_names == ("dp", "tp")
        assert resolve_axis("tp") == "tp"
        assert resolve_axis(mesh_dp_tp.get_group("dp")) == "dp"
        assert resolve_axis(mesh_dp_tp["tp"]) == "tp"
        assert m.size("tp") == 4 and m.size("dp") == 2
    assert current_mesh() is None


def test_dict_of_groups_and_nesting(mesh_dp_tp):
    groups = {"data": mesh_dp_tp.get_group("dp"), "model": mesh_dp_tp.get_group("tp")}
    with spmd.set_current_mesh(mesh_dp_tp):
        with spmd.set_current_mesh(groups):
            assert current_mesh().axis_names == ("data", "model")
        assert current_mesh().axis_names == ("dp", "tp")


def test_a_block_left_by_an_exception_gives_the_outer_mesh_back(mesh_dp_tp):
    groups = {"data": mesh_dp_tp.get_group("dp")}
    with spmd.set_current_mesh(mesh_dp_tp) as outer:
        with pytest.raises(KeyError), spmd.set_current_mesh(groups) as inner:
            assert current_mesh() is inner
            raise KeyError("leaves the inner block")
        assert current_mesh() is outer
    assert current_mesh() is None


def test_unknown_axis_lists_known_ones(mesh_dp_tp):
    with spmd.set_current_mesh(mesh_dp_tp):
        with pytest.raises(ValueError, match=r"unknown mesh axis 'pp'; the current mesh has axes 'dp', 'tp'"):
            resolve_axis("pp")


def test_axis_name_without_mesh_is_an_error():
    with pytest.raises(RuntimeError, match="no mesh is current"):
        resolve_axis("tp")


def test_mesh_needs_names(mesh_dp_tp):
    with pytest.raises(TypeError, match="must map to a ProcessGroup"):
        with spmd.set_current_mesh({"tp": 3}):
            pass
    with pytest.raises(TypeError, match="set_current_mesh: a mesh given as a collection holds MeshAxis"):
        with spmd.set_current_mesh([1, 2]):
            pass


def test_unnamed_process_group_is_an_error(mesh_dp_tp):
    other = dist.new_group([0, 1])
    with spmd.set_current_mesh(mesh_dp_tp):
        with pytest.raises(ValueError, match="is not an axis, nor a flattening of axes, of the current mesh"):
            resolve_axis(other)
    assert torch.is_tensor(torch.zeros(1))
