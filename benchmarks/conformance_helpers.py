"""Stand-ins for the peer's private test modules, used by ``benchmarks/conformance.py``.

The published package's own tests import a few of its private modules: test
base classes (``spmd_types._test_utils``), a fake process group
(``spmd_types._testing.fake_pg``), the axis-name registry's reset
(``spmd_types._mesh_axis._reset`` / ``_register_name``). The conformance runner
rewrites those imports to the names below, written for this package on its
public API (and, for the axis-name registry, its own registry). A private name
that this package has no counterpart for is replaced by :func:`private`, an
object that raises :class:`PeerPrivateInternal` as soon as a test uses it, so the
test fails with a reason the runner classifies as "tests a private internal".
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

import spmd_types as spmd


class PeerPrivateInternal(Exception):
    """Raised by a stand-in for a private name of the peer package that this package does not have."""


class _Private:
    """A private peer name with no counterpart here: any use raises :class:`PeerPrivateInternal`."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise PeerPrivateInternal(f"the peer's private internal {self._name} has no counterpart in this package")

    __call__ = _fail
    __enter__ = _fail
    __iter__ = _fail
    __getitem__ = _fail
    __contains__ = _fail
    __len__ = _fail
    __bool__ = _fail

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return self._fail()

    def __setattr__(self, attr: str, value: Any) -> None:
        self._fail()

    def __repr__(self) -> str:
        return f"<peer private {self._name}>"


def private(name: str) -> Any:
    """The stand-in for the peer's private ``name`` (``'spmd_types._checker._OP_REGISTRY'``)."""
    return _Private(name)


def reset_axis_names() -> None:
    """Forget the names meshes gave regions (the peer's ``_mesh_axis._reset``: between test classes)."""
    from spmd_types._core import axes

    axes._NAMES.clear()


def register_axis_name(axis: spmd.MeshAxis, name: str) -> None:
    """Name a region for display (the peer's ``_mesh_axis._register_name``)."""
    from spmd_types._core import axes

    axes.name_region(axis, name)


@contextlib.contextmanager
def fake_pg(world_size: int = 4) -> Iterator[dist.ProcessGroup]:
    """A fake default process group of ``world_size`` ranks, torn down on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend="fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()


def _test_case_base() -> type:
    from torch.testing._internal.common_utils import TestCase

    return TestCase


class FakeProcessGroupTestCase(_test_case_base()):  # type: ignore[misc]
    """A fake world per test class: ``cls.pg`` (the default group) and ``cls.mesh``.

    ``MESH_SHAPE`` / ``MESH_DIM_NAMES`` choose the mesh; without a shape it is
    one axis ``tp`` of ``WORLD_SIZE`` ranks.
    """

    MESH_SHAPE: tuple[int, ...] | None = None
    MESH_DIM_NAMES: tuple[str, ...] = ("tp",)
    WORLD_SIZE: int = 3

    @classmethod
    def setUpClass(cls) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        super().setUpClass()
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_axis_names()
        shape = cls.MESH_SHAPE if cls.MESH_SHAPE is not None else (cls.WORLD_SIZE,)
        cls.WORLD_SIZE = math.prod(shape)
        dist.init_process_group(backend="fake", rank=0, world_size=cls.WORLD_SIZE, store=FakeStore())
        cls.pg = dist.distributed_c10d._get_default_group()
        cls.mesh = init_device_mesh("cpu", shape, mesh_dim_names=cls.MESH_DIM_NAMES)

    @classmethod
    def tearDownClass(cls) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_axis_names()
        super().tearDownClass()


class LocalTensorTestCase(FakeProcessGroupTestCase):
    """Every test inside torch's ``LocalTensorMode`` over the class's world, with per-rank helpers."""

    def setUp(self) -> None:
        from torch.distributed._local_tensor import LocalTensorMode

        super().setUp()
        self.mode = LocalTensorMode(self.WORLD_SIZE)
        self.mode.__enter__()
        self.addCleanup(self.mode.__exit__, None, None, None)  # also when a later setUp step fails

    def rank_map(self, cb: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return self.mode.rank_map(cb)

    @staticmethod
    def _local(typ: Any) -> Any:
        return spmd.V if isinstance(typ, spmd.Shard) else typ

    def _typed_random(self, shape_of: Callable[[int], Any], typ: Any, axis: Any, dtype: Any = None) -> torch.Tensor:
        """Random values of ``typ`` on ``axis``: one value on every rank for R and I, one per rank otherwise."""
        local = self._local(typ)
        if local is spmd.R or local is spmd.I:
            one = torch.randn(shape_of(0), dtype=dtype)
            out = self.rank_map(lambda r: one.clone())
        else:
            out = self.rank_map(lambda r: torch.randn(shape_of(r), dtype=dtype))
        spmd.assert_type(out, {axis: local})
        return out

    def _generate_inputs(self, shape: Any, axis: Any, typ: Any, dtype: Any = None) -> torch.Tensor:
        return self._typed_random(lambda r: shape, typ, axis, dtype)

    def _make_random_typed(self, like_lt: torch.Tensor, typ: Any, axis: Any) -> torch.Tensor:
        shapes = {r: v.shape for r, v in like_lt._local_tensors.items()}
        dtype = next(iter(like_lt._local_tensors.values())).dtype
        return self._typed_random(lambda r: shapes[r], typ, axis, dtype)

    def _values(self, lt: torch.Tensor) -> list[torch.Tensor]:
        return [lt._local_tensors[r] for r in sorted(lt._local_tensors)]

    def _assert_all_ranks_equal(self, lt: torch.Tensor, msg: str = "") -> None:
        values = self._values(lt)
        for r, v in enumerate(values[1:], start=1):
            torch.testing.assert_close(values[0], v, msg=f"{msg}: rank 0 vs rank {r}")

    def _assert_ranks_different(self, lt: torch.Tensor, msg: str = "") -> None:
        values = self._values(lt)
        self.assertFalse(all(torch.allclose(values[0], v) for v in values[1:]),
                         f"{msg}: expected different values per rank")

    def _gradient_type(self, typ: Any) -> Any:
        return spmd.backward_type(self._local(typ))

    def _dual_inner(self, grad: torch.Tensor, perturbation: torch.Tensor, typ: Any) -> float:
        """The pairing of a cotangent of ``typ`` with a tangent of ``typ``, over the ranks' values.

        R pairs the sum of the (P) cotangents with the one value; P the one (R)
        cotangent with the sum of the values; I the one value with the one
        cotangent; V rank by rank.
        """
        local = self._local(typ)
        g, p = self._values(grad), self._values(perturbation)
        if local is spmd.R:
            return float((sum(g) * p[0]).sum())
        if local is spmd.P:
            return float((g[0] * sum(p)).sum())
        if local is spmd.I:
            return float((g[0] * p[0]).sum())
        return float(sum((a * b).sum() for a, b in zip(g, p)))

    def spmd_gradcheck(self, fn: Callable, x: torch.Tensor, axis: Any, src_type: Any, dst_type: Any) -> None:
        """The adjoint identity ``<A^T g, dx> == <g, A dx>`` for a linear SPMD op ``fn`` from ``src_type`` to ``dst_type``."""
        x.requires_grad_(True)
        y = fn(x)
        g = self._make_random_typed(y, self._gradient_type(dst_type), axis)
        y.backward(g)
        dx = self._make_random_typed(x, src_type, axis)
        with torch.no_grad():
            a_dx = fn(dx)
        lhs = self._dual_inner(x.grad, dx, src_type)
        rhs = self._dual_inner(g, a_dx, dst_type)
        torch.testing.assert_close(torch.tensor(lhs), torch.tensor(rhs),
                                   msg=f"adjoint identity: <A^T g, dx> = {lhs}, <g, A dx> = {rhs}")


class SpmdTypeCheckedTestCase(LocalTensorTestCase):
    """LocalTensorTestCase with every test inside ``spmd.typecheck()``; ``rank_map`` runs unchecked."""

    def setUp(self) -> None:
        super().setUp()
        self._type_checking_cm = spmd.typecheck()
        self._type_checking_cm.__enter__()
        self.addCleanup(self._type_checking_cm.__exit__, None, None, None)

    def rank_map(self, cb: Callable[[int], torch.Tensor]) -> torch.Tensor:
        with spmd.no_typecheck():
            return self.mode.rank_map(cb)
