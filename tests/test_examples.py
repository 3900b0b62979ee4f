"""Every example runs as a user would run it, and prints what its docs say (subprocesses, with timeouts)."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import runpy
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


def _run_here(script: str, argv: list[str], monkeypatch) -> tuple[int, str]:
    """Run an example's ``__main__`` in this process (no interpreter start-up): exit code and stdout."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SPMD_TYPES_ERRORS", "plain")
    monkeypatch.setattr(sys, "argv", [script, *argv])
    printed, code = io.StringIO(), 0
    with contextlib.redirect_stdout(printed):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code or 0
    return code, printed.getvalue()


def test_check_at_scale_llama_70b_shape_in_seconds(monkeypatch):
    code, out = _run_here("examples/check_at_scale.py", [], monkeypatch)
    assert code == 0, out
    assert "80 layers, d_model 8192" in out and "dp=8 x tp=8 = 64 ranks" in out
    # Its wall time is printed, not asserted: speed is measured by benchmarks/scale.py, never in tests.
    assert re.search(r"typechecked: one training step, forward and backward, in [0-9.]+ s", out), out


def test_check_at_scale_catches_a_bug_at_its_line(monkeypatch):
    code, out = _run_here("examples/check_at_scale.py", ["--bug-at", "17", "--layers", "24"], monkeypatch)
    assert code == 1, out
    assert "SpmdTypeError: Invariant (I) values only combine with other I values" in out
    assert "  at:       examples/check_at_scale.py:" in out and "qkv = F.linear(h, self.wqkv)" in out
    assert "  fix:      spmd.convert(h, 'tp', src=spmd.I, dst=spmd.R)" in out


def test_fsdp_reduced_counts_and_matches_one_device(monkeypatch):
    code, out = _run_here("examples/fsdp_reduced.py", [], monkeypatch)
    assert code == 0, out
    assert out.count("all_gather: 2, all_reduce: 1, reduce_scatter: 2") == 3
    assert "losses match one device" in out


def test_megatron_tp_sp_dp_under_torchrun_matches_one_device():
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "examples/megatron_tp_sp_dp.py", timeout=180)
    assert "losses match the single-device run, typed and erased" in out
    assert "dp=2 x tp=2" in out


def test_check_equivalence_finds_the_planted_bug_where_it_starts(monkeypatch):
    code, out = _run_here("examples/check_equivalence.py", [], monkeypatch)
    assert code == 0, out
    assert out.startswith("planted bug: ce-local-max (vocab-parallel cross entropy subtracts this rank's max")
    assert re.search(r"^ +14 +output +cross_entropy +[0-9.e+-]+ +[0-9.e+-]+ +DIVERGED <- first$", out, re.M), out
    assert "The first: output of cross_entropy" in out
    assert re.search(r"^  at: examples/check_equivalence\.py:\d+: return total\.log\(\) - target_logit$", out, re.M)
