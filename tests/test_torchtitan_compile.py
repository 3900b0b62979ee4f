"""torchtitan 0.3.0 with its own per-block compile and checking on (issue 23, item 4).

torchtitan compiles each transformer block with ``block.compile(backend=..., fullgraph=True)`` when
``--compile.enable`` is set; its spmd_types test recipes turn compile off whenever typechecking is on.
Here both are on, with ``backend="aot_eager"`` (torchtitan's ``compile.backend``; inductor's CPU
backend takes minutes per block on this machine): every block graph is checked when it compiles, the
step runs on the fake process group, and sharding mistakes planted in the blocks raise
``SpmdTypeError`` at compile time, at the torchtitan line eager checking names.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import _torchtitan_mistakes as tm  # noqa: E402
import _torchtitan_support as tt  # noqa: E402
import torch  # noqa: E402

import spmd_types as spmd  # noqa: E402
from spmd_types._compile.backend import CHECKS  # noqa: E402

BACKEND = "aot_eager"
# the MoE experts' grouped matmul is a dense sum when compiled on CPU (tests/_torchtitan_shims.py): float32
# reduction order; the same tolerances as test_torchtitan.py's one-device comparison
GRAD_ATOL, GRAD_RTOL = 2e-4, 1e-3


@pytest.mark.parametrize("name", ["llama3 dp4 x tp2 (SP)", "qwen3-MoE tp2 x ep2"])
def test_compiled_blocks_are_checked_and_step(name):
    c = tt.case(name)
    before = len(CHECKS)
    compiled = tt.run(c, "fake", compile_backend=BACKEND)
    assert len(CHECKS) > before, "no block graph was checked: the blocks did not compile"
    eager = tt.run(c, "fake")
    torch.testing.assert_close(compiled.loss[0], eager.loss[0])
    assert set(compiled.grads) == set(eager.grads)
    for n, g in compiled.grads.items():
        torch.testing.assert_close(g[0], eager.grads[n][0], atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda m, n=n: f"gradient of {n}: {m}")


# The planted mistakes that surface inside a transformer block (the others surface in eager code around
# the blocks: the embedding and the loss), and where eager checking reports them.
IN_BLOCKS = ["norm weight I under SP", "row-wise output declared I, not P",
             "tokens-per-expert counts claimed replicated"]


@pytest.mark.parametrize("name", IN_BLOCKS)
def test_planted_mistake_is_refused_when_the_block_compiles(name):
    m = tm.mistake(name)
    exc = tm.plant(m, compile_backend=BACKEND)
    assert isinstance(exc, spmd.SpmdTypeError), f"{m.name}: expected SpmdTypeError, got {exc!r}"
    assert type(exc).__name__ == "SpmdCompileError", "raised while running, not when the block compiled"
    eager = tm.plant(m)
    assert exc.plain == eager.plain  # eager's own message, at the same torchtitan line
    traced = [f.split("/torchtitan/", 1)[-1] for f in exc.traced_stack]
    for line in m.lines:
        assert any(t.startswith(line + ":") for t in traced) or line in str(exc), (m.name, line, traced)


def test_a_mistake_that_breaks_shapes_fails_dynamos_shape_check_first():
    """This mistake also breaks the erased program's shapes: dynamo's fake-tensor run of the trace stops where the
    shapes first disagree (the residual add, torch's error at that torchtitan line) before the graph reaches the
    checker, which eager checking reports earlier, at the FFN's linear."""
    from torch._dynamo.exc import TorchRuntimeError

    m = tm.mistake("FFN skips its all-gather")
    exc = tm.plant(m, compile_backend=BACKEND)
    assert isinstance(exc, TorchRuntimeError)
    assert 'models/llama3/model.py", line 49, in forward' in str(exc)
    assert "Attempting to broadcast a dimension of length 4" in str(exc)
    eager = tm.plant(m)
    assert isinstance(eager, spmd.SpmdTypeError) and "models/common/feed_forward.py:54" in tm.torchtitan_frames(eager)
