"""Low-precision communication: every error, with its exact message, raised before any communication.

The missing backward ``op_dtype`` (for every row whose backward sums, read
from the table), a bad dtype value, an option an op does not take; and the
choices where we differ from the published package (docs/index.md, choice 29).
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_mesh
from test_low_precision import BF16, F16, F32, N, backward_reduces, grid_value
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd
from spmd_types._local.transitions import TRANSITIONS
from spmd_types.testing import CommCounter, denote

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


@pytest.fixture(scope="module")
def mesh():
    return fake_mesh((N,), ("tp",))

# ---------------------------------------------------------------------------
# errors: exact messages, raised before any communication


def _raises(exc, fn, *args, **kwargs) -> BaseException:
    with CommCounter() as comms, pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert comms.total == 0, "an error must come before any communication"
    return info.value


@pytest.fixture
def on_mesh(mesh):
    with spmd.set_current_mesh(mesh):
        yield mesh


def _x(dtype=F32, shape=(4, 4)):
    return torch.ones(shape, dtype=dtype, requires_grad=True)


def test_missing_backward_op_dtype_all_gather(on_mesh):
    err = _raises(ValueError, spmd.all_gather, _x(), "tp", src=S(0), dst=R, op_dtype=BF16)
    assert str(err) == (
        "spmd.all_gather(x, 'tp', src=spmd.S(0), dst=spmd.R): a call in reduced precision whose backward sums the "
        "gradient over ranks must say the dtype of that sum with backward_options={'op_dtype': ...}. Seen: "
        "op_dtype=torch.bfloat16, and the backward is reduce_scatter(src=P, dst=V). Fix: "
        "backward_options={'op_dtype': torch.float32} (FSDP's norm: bf16 all-gather, fp32 reduce-scatter), or "
        "backward_options={'op_dtype': torch.bfloat16} to sum in torch.bfloat16 on purpose."
    )


def test_missing_backward_op_dtype_convert_out_dtype(on_mesh):
    err = _raises(ValueError, spmd.convert, _x(), "tp", src=I, dst=R, out_dtype=F16)
    assert str(err) == (
        "spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R): a call in reduced precision whose backward sums the "
        "gradient over ranks must say the dtype of that sum with backward_options={'op_dtype': ...}. Seen: "
        "out_dtype=torch.float16, and the backward is all_reduce(src=P, dst=I). Fix: "
        "backward_options={'op_dtype': torch.float32} (FSDP's norm: bf16 all-gather, fp32 reduce-scatter), or "
        "backward_options={'op_dtype': torch.float16} to sum in torch.float16 on purpose."
    )


def test_missing_backward_op_dtype_bf16_input(on_mesh):
    """A bf16 input is a reduced-precision call too (as in the peer): all_reduce(dst=R) of bf16 needs it."""
    err = _raises(ValueError, spmd.all_reduce, _x(BF16), "tp", src=P, dst=R)
    assert str(err) == (
        "spmd.all_reduce(x, 'tp', src=spmd.P, dst=spmd.R): a call in reduced precision whose backward sums the "
        "gradient over ranks must say the dtype of that sum with backward_options={'op_dtype': ...}. Seen: "
        "x is torch.bfloat16, and the backward is all_reduce(src=P, dst=R). Fix: "
        "backward_options={'op_dtype': torch.float32} (FSDP's norm: bf16 all-gather, fp32 reduce-scatter), or "
        "backward_options={'op_dtype': torch.bfloat16} to sum in torch.bfloat16 on purpose."
    )


def test_missing_backward_op_dtype_all_reduce_max(on_mesh):
    err = _raises(ValueError, spmd.all_reduce, _x(BF16), "tp", src=V, dst=R, op="max")
    assert "Seen: x is torch.bfloat16, and the backward is all_reduce(src=P, dst=R)." in str(err)
    spmd.all_reduce(_x(BF16), "tp", src=V, dst=I, op="max")  # dst=I: the gradient is not summed


@pytest.mark.parametrize("row", [t for t in TRANSITIONS if backward_reduces(t)], ids=lambda t: f"{t.op}-{t.src}-{t.dst}")
def test_missing_backward_op_dtype_every_row(on_mesh, row):
    """Every row whose backward sums (read from the table) needs it; with it, or without grad, the call runs."""
    x = _x()
    err = _raises(ValueError, getattr(spmd, row.op), x, "tp", src=row.src, dst=row.dst, op_dtype=BF16)
    assert str(err).startswith(f"spmd.{row.op}(x, 'tp', src={row.src.code()}, dst={row.dst.code()}): a call in ")
    with LocalTensorMode(N):
        x = grid_value(row.src, (N, N), seed=21).requires_grad_()
        getattr(spmd, row.op)(x, "tp", src=row.src, dst=row.dst, op_dtype=BF16, backward_options={"op_dtype": F32})
        getattr(spmd, row.op)(x.detach(), "tp", src=row.src, dst=row.dst, op_dtype=BF16)
        with torch.no_grad():
            getattr(spmd, row.op)(x, "tp", src=row.src, dst=row.dst, op_dtype=BF16)


def test_redistribute_routes_the_rule(on_mesh):
    err = _raises(ValueError, spmd.redistribute, _x(BF16), "tp", src=S(0), dst=R)
    assert str(err).startswith("spmd.all_gather(x, 'tp', src=spmd.S(0), dst=spmd.R): a call in reduced precision")


def test_missing_nested_op_dtype_in_a_double_backward(mesh):
    """The backward's own call is checked when its gradient is differentiated again (create_graph=True)."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(P, (4,), seed=22).requires_grad_()
        y = spmd.all_reduce(x, "tp", src=P, dst=R, op_dtype=BF16, backward_options={"op_dtype": BF16})
        g = grid_value(P, (4,), seed=23).to(BF16).requires_grad_()
        with pytest.raises(ValueError) as info:
            torch.autograd.grad(y, x, g, create_graph=True)
        torch.autograd.grad(y, x, g.detach())  # a first-order backward is fine
    assert str(info.value) == (
        "the backward's spmd.all_reduce(g, 'tp', src=spmd.P, dst=spmd.R): a call in reduced precision whose "
        "backward sums the gradient over ranks must say the dtype of that sum with backward_options={'op_dtype': "
        "...}. Seen: op_dtype=torch.bfloat16, the gradient is torch.bfloat16, and the backward is "
        "all_reduce(src=P, dst=R). Fix: backward_options={..., 'backward_options': {'op_dtype': torch.float32}} "
        "(FSDP's norm: bf16 all-gather, fp32 reduce-scatter), or backward_options={..., 'backward_options': "
        "{'op_dtype': torch.bfloat16}} to sum in torch.bfloat16 on purpose."
    )


def test_op_dtype_not_a_dtype(on_mesh):
    err = _raises(TypeError, spmd.all_reduce, _x(), "tp", src=P, dst=I, op_dtype="bf16")
    assert str(err) == (
        "spmd.all_reduce: op_dtype= takes a torch.dtype such as torch.bfloat16 or torch.float32, got 'bf16' of "
        "type str"
    )


def test_out_dtype_a_python_type(on_mesh):
    err = _raises(TypeError, spmd.reduce_scatter, _x(), "tp", src=P, dst=S(0), out_dtype=float)
    assert str(err) == (
        "spmd.reduce_scatter: out_dtype= takes a torch.dtype such as torch.bfloat16 or torch.float32, got "
        "<class 'float'> of type type"
    )


def test_backward_options_not_a_dict(on_mesh):
    err = _raises(TypeError, spmd.all_gather, _x(), "tp", src=S(0), dst=R, backward_options=F32)
    assert str(err) == (
        "spmd.all_gather: backward_options= takes a dict such as {'op_dtype': torch.float32}, got torch.float32 "
        "of type dtype"
    )


def test_backward_options_unknown_key(on_mesh):
    err = _raises(ValueError, spmd.all_gather, _x(), "tp", src=S(0), dst=R,
                  backward_options={"op_dtype": F32, "scatter_dim": 0})
    assert str(err) == (
        "spmd.all_gather: backward_options takes the keys 'op_dtype', 'out_dtype' and 'backward_options' (the "
        "options of the call the backward runs), got 'scatter_dim'. Dims and sizes follow from the forward call."
    )


def test_nested_backward_options_checked_up_front(on_mesh):
    err = _raises(ValueError, spmd.all_to_all, _x(), "tp", src=S(0), dst=S(1),
                  backward_options={"backward_options": {"inplace": True}})
    assert str(err) == (
        "spmd.all_to_all: backward_options['backward_options'] takes the keys 'op_dtype', 'out_dtype' and "
        "'backward_options' (the options of the call the backward runs), got 'inplace'. Dims and sizes follow "
        "from the forward call."
    )


def test_backward_op_dtype_not_a_dtype(on_mesh):
    err = _raises(TypeError, spmd.convert, _x(), "tp", src=R, dst=S(0), backward_options={"op_dtype": "fp32"})
    assert str(err) == (
        "spmd.convert: backward_options['op_dtype']= takes a torch.dtype such as torch.bfloat16 or torch.float32, "
        "got 'fp32' of type str"
    )


def test_backward_op_dtype_integer(on_mesh):
    err = _raises(TypeError, spmd.all_gather, _x(), "tp", src=S(0), dst=I,
                  backward_options={"op_dtype": torch.int32})
    assert str(err) == (
        "spmd.all_gather: backward_options['op_dtype']=torch.int32 is not a floating-point dtype, and gradients "
        "are; use torch.float32 or torch.bfloat16"
    )


def test_integer_op_dtype_would_cut_the_gradient(on_mesh):
    err = _raises(TypeError, spmd.all_reduce, _x(), "tp", src=P, dst=I, op_dtype=torch.int32)
    assert str(err) == (
        "spmd.all_reduce: op_dtype=torch.int32 is not a floating-point dtype, so the result could not carry the "
        "gradient of x, which requires grad. Use a floating dtype (torch.bfloat16, torch.float32), or pass "
        "x.detach() (or run under torch.no_grad()) for data that needs no gradient."
    )


def test_redistribute_with_partition_specs_takes_no_dtype_options(on_mesh):
    spec = spmd.PartitionSpec("tp")
    err = _raises(TypeError, spmd.redistribute, _x(), spec, spmd.PartitionSpec(None), op_dtype=BF16)
    assert str(err) == (
        "spmd.redistribute(x, src_spec, dst_spec) takes no op_dtype=: it plans several collectives, and the "
        "options belong to one. Redistribute one axis at a time, spmd.redistribute(x, axis, src=, dst=, "
        "op_dtype=...), or cast x before and after."
    )


def test_max_takes_no_nested_backward_options(on_mesh):
    err = _raises(ValueError, spmd.all_reduce, _x(), "tp", src=V, dst=I, op="max",
                  backward_options={"backward_options": {}})
    assert str(err) == (
        "spmd.all_reduce(op='max'): backward_options cannot hold 'backward_options': its backward is not "
        "differentiable (a double backward through it is an error), so there is no call for them."
    )


# ---------------------------------------------------------------------------
# where we differ from the peer (docs/index.md, choice 29)


def test_choice_reinterpret_i_to_v_in_bf16_needs_the_backward_op_dtype(on_mesh):
    """Its backward all-reduces (the table says so); the peer does not check this row."""
    err = _raises(ValueError, spmd.reinterpret, _x(), "tp", src=I, dst=V, op_dtype=BF16)
    assert "and the backward is all_reduce(src=V, dst=I)." in str(err)


def test_choice_redistribute_to_the_same_type_casts(mesh):
    """redistribute(src=X, dst=X, out_dtype=bf16) gives bf16 (the peer returns x unchanged, still fp32)."""
    with LocalTensorMode(N), spmd.set_current_mesh(mesh):
        x = grid_value(R, (4,), seed=24).requires_grad_()
        with CommCounter() as comms:
            y = spmd.redistribute(x, "tp", src=R, dst=R, out_dtype=BF16, backward_options={"op_dtype": BF16})
            (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert comms.total == 0 and y.dtype == BF16 and gx.dtype == F32
        assert torch.equal(denote(y, mesh, {"tp": R}), denote(x.detach(), mesh, {"tp": R}).to(BF16))
        assert spmd.redistribute(x, "tp", src=R, dst=R) is x
        with spmd.typecheck():
            xt = spmd.assert_type(x.detach().clone(), {"tp": R})
            assert spmd.get_type(spmd.redistribute(xt, "tp", src=R, dst=R, op_dtype=BF16)) == {"tp": R}


def test_choice_integer_op_dtype_on_a_differentiable_value_is_an_error(on_mesh):
    """The peer returns an integer tensor and the gradient silently stops; we refuse (see the pinned message)."""
    _raises(TypeError, spmd.all_to_all, _x(), "tp", src=S(0), dst=S(1), op_dtype=torch.int8)


def test_the_docs_page_shows_the_message_as_it_is():
    """docs/low_precision.md quotes the missing-backward-op_dtype error; it must be the real text."""
    from pathlib import Path

    with spmd.set_current_mesh(fake_mesh((N,), ("dp",))):
        err = _raises(ValueError, spmd.all_gather, _x(), "dp", src=S(0), dst=R, op_dtype=BF16)
    page = (Path(__file__).resolve().parents[1] / "docs" / "low_precision.md").read_text()
    assert str(err) in page
