"""Every example runs as a user would run it, and prints what its docs say (subprocesses, with timeouts)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int = 240) -> str:
    env = {**os.environ, "SPMD_TYPES_ERRORS": "plain", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_quickstart():
    out = _run("examples/quickstart.py")
    assert "SpmdTypeError: Invariant (I) values only combine with other I values" in out
    assert "fix:      spmd.convert(x, 'tp', src=spmd.I, dst=spmd.R)" in out
    assert "output is a torch.Tensor" in out


def test_check_at_scale_llama_70b_shape_in_seconds():
    out = _run("examples/check_at_scale.py")
    assert "80 layers, d_model 8192" in out and "dp=8 x tp=8 = 64 ranks" in out
    seconds = float(re.search(r"forward and backward, in ([0-9.]+) s", out).group(1))
    assert seconds < 10, out


def test_check_at_scale_catches_a_bug_at_its_line():
    env = {**os.environ, "SPMD_TYPES_ERRORS": "plain"}
    run = subprocess.run([sys.executable, "examples/check_at_scale.py", "--bug-at", "17", "--layers", "24"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "SpmdTypeError: Invariant (I) values only combine with other I values" in run.stdout
    assert "  at:       examples/check_at_scale.py:" in run.stdout and "qkv = F.linear(h, self.wqkv)" in run.stdout
    assert "  fix:      spmd.convert(h, 'tp', src=spmd.I, dst=spmd.R)" in run.stdout


def test_fsdp_reduced_counts_and_matches_one_device():
    out = _run("examples/fsdp_reduced.py")
    assert out.count("all_gather: 2, all_reduce: 1, reduce_scatter: 2") == 3
    assert "losses match one device" in out


def test_megatron_tp_sp_dp_under_torchrun_matches_one_device():
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "examples/megatron_tp_sp_dp.py", timeout=180)
    assert "losses match the single-device run, typed and erased" in out
    assert "dp=2 x tp=2" in out
