"""SpmdTypeError: plain text off a terminal, rich on one, and the user's expressions in fixes."""

import pickle

import pytest
import torch
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types._core.source import operand_expressions


@pytest.mark.parametrize(
    "code, name, params, expected",
    [
        ("h = x @ self.w1", "__matmul__", ("input", "other"), {"input": "x", "other": "self.w1"}),
        ("y = 1 + p", "__radd__", ("input", "other"), {"input": "p", "other": "1"}),
        ("acc += p", "__iadd__", ("input", "other"), {"input": "acc", "other": "p"}),
        ("h = F.linear(x, w, bias=b)", "linear", ("input", "weight", "bias"), {"input": "x", "weight": "w", "bias": "b"}),
        ("y = x.view(2, 8)", "view", ("input", "other"), {"input": "x", "other": "2"}),
        ("y = torch.cat([a, b])", "cat", ("tensors",), {"tensors": "[a, b]", "tensors[0]": "a", "tensors[1]": "b"}),
        ("y = f(x) + g(x) + h", "__add__", ("input", "other"), {}),  # two candidates: no guess
        ("if x", "__add__", ("input", "other"), {}),
    ],
)
def test_operand_expressions(code, name, params, expected):
    assert operand_expressions(code, name, params) == expected


def _error(mesh):
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        x = spmd.assert_type(torch.randn(2, 4, requires_grad=True), {"dp": spmd.V, "tp": spmd.I})
        w = spmd.assert_type(torch.randn(4, 4), {"dp": spmd.R, "tp": spmd.V})
        with pytest.raises(spmd.SpmdTypeError) as info:
            F.linear(x, w)
    return info.value


def test_message_is_plain_and_pinned_off_a_terminal(mesh_dp_tp):
    err = _error(mesh_dp_tp)
    assert isinstance(err, TypeError)
    assert str(err) == err.plain == (
        "Invariant (I) values only combine with other I values: F.linear combines input (I) with "
        "weight (V). Convert the I operand to R, so that its gradient is all-reduced in backward.\n"
        "  op:       F.linear\n"
        "  operands: input (x): {dp: V, tp: I}\n"
        "            weight (w): {dp: R, tp: V}\n"
        "  axis:     'tp': input is I and weight is V\n"
        "  at:       tests/test_errors.py:35: F.linear(x, w)\n"
        "  fix:      spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)"
    )
    assert err.fixes == ("spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)",)
    assert err.source == "tests/test_errors.py:35: F.linear(x, w)"


def test_rich_rendering_when_asked(mesh_dp_tp, monkeypatch):
    monkeypatch.setenv("SPMD_TYPES_ERRORS", "rich")
    err = _error(mesh_dp_tp)
    text = str(err)
    assert "\x1b[" in text  # ANSI styling from rich
    assert "spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)" in text
    assert err.plain.startswith("Invariant (I) values only combine")
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in str(_error(mesh_dp_tp))


def test_errors_pickle(mesh_dp_tp):
    err = _error(mesh_dp_tp)
    again = pickle.loads(pickle.dumps(err))
    assert again.plain == err.plain and again.fixes == err.fixes
