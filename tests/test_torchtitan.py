"""torchtitan 0.3.0's own models, annotated for spmd_types, trained one step with checking on.

torchtitan's ``spmd_backend = "spmd_types"`` calls the spmd_types API (written
against meta-pytorch's spmd-types 0.2.3) from its models, sharding configs and
trainer. These tests build llama3, qwen3, qwen3-MoE, deepseek_v3 and gpt_oss
from torchtitan's configs and parallelize code, on CPU, and check: the trainer
imports; one step with checking on runs on a fake process group; on simulated
ranks (``LocalTensorMode``) loss and gradients equal the same run with checking
off and the same model on one device; and planted sharding-config mistakes
raise ``spmd.SpmdTypeError`` at the torchtitan line where they surface. The
harness, its mistakes and its CPU shims: ``_torchtitan_support.py``, ``_torchtitan_mistakes.py``,
``_torchtitan_shims.py``;
the same matrix as a table: ``torchtitan_peer_check.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import _torchtitan_mistakes as tm  # noqa: E402
import _torchtitan_support as tt  # noqa: E402
import torch  # noqa: E402

CASES = [c.name for c in tt.CASES]

# Observed with the peer package: checking on and off agree bit for bit; the
# one-device loss within 1e-6 and gradients within 7e-5 (gpt_oss's experts,
# largest |gradient| 0.37: reduction order in the token exchange).
LOSS_ATOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 2e-4, 1e-3


def test_trainer_imports_and_version():
    tt.load()
    import torchtitan
    import torchtitan.trainer

    assert torchtitan.__version__ == "0.3.0", "the planted-mistake lines below are torchtitan 0.3.0's"
    assert callable(torchtitan.trainer.Trainer._forward_backward_body)


@pytest.mark.parametrize("name", CASES)
def test_step_with_checking_on_fake_group(name):
    step = tt.run(tt.case(name), "fake")  # raises on any type error; every parameter must get a gradient
    assert torch.isfinite(step.loss[0]).all()
    assert step.grads and all(torch.isfinite(g[0]).all() for g in step.grads.values())


@pytest.mark.parametrize("name", CASES)
def test_simulated_ranks_match_checking_off_and_one_device(name):
    c = tt.case(name)
    on = tt.run(c, "local", checking=True, one_device=True)
    off = tt.run(c, "local", checking=False)
    assert set(on.loss) == set(range(c.world))
    assert tt.max_abs_diff(on.loss, off.loss) == 0.0, "checking changed a rank's loss"
    changed = {n: tt.max_abs_diff(g, off.grads[n]) for n, g in on.grads.items()}
    assert not any(changed.values()), f"checking changed gradients: {changed}"

    ref = tt.run_one_device(c, {n: v[0] for n, v in on.global_weights.items()})
    assert set(ref.grads) == set(on.global_grads)
    for rank, loss in on.global_loss.items():
        torch.testing.assert_close(loss, ref.loss[0], atol=LOSS_ATOL, rtol=0, msg=f"loss on rank {rank}")
    for n, per_rank in on.global_grads.items():
        for rank, grad in per_rank.items():
            torch.testing.assert_close(grad, ref.grads[n][0], atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                       msg=lambda m, n=n, rank=rank: f"gradient of {n} on rank {rank}: {m}")


@pytest.mark.parametrize("name", [m.name for m in tm.MISTAKES])
def test_planted_mistake_raises_at_torchtitan_line(name):
    import spmd_types as spmd

    m = tm.mistake(name)
    exc = tm.plant(m)
    assert isinstance(exc, spmd.SpmdTypeError), f"{m.name}: expected SpmdTypeError, got {exc!r}"
    frames = tm.torchtitan_frames(exc)
    for line in m.lines:
        assert line in frames or line in str(exc), f"{m.name}: the error does not point at {line}; torchtitan frames {frames}"
