"""torchtitan's own trainer, run as docs/torchtitan.md tells a user to: torchrun, gloo, checking on, 2 steps.

``torchrun -m``-style: ``examples/torchtitan_cpu_train.py`` is the launcher the
docs name (its CPU accommodations are listed there); everything after it is
torchtitan's own command line. The tokenizer and the dataset are made by the
launcher's ``prepare`` (nothing fetched). Each layout trains twice with
``--debug.seed 42``, with and without ``--debug.spmd_typechecking``: the typed
run must check ops (``SPMD_TYPES_TRACE`` logs each checked op) and both must
print the same losses. torch 2.14 only: torch 2.13's FSDP2 refuses typed
parameters (it cannot read spmd types).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import torch_calls_spmd_types

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "examples" / "torchtitan_cpu_train.py"

if not torch_calls_spmd_types():
    pytest.skip("torchtitan's FSDP path needs torch 2.14 (2.13's FSDP2 cannot read spmd types)",
                allow_module_level=True)
for needed in ("tokenizers", "datasets", "tyro", "torchtitan"):
    pytest.importorskip(needed, reason=f"torchtitan's trainer imports {needed} (make setup214 installs it)")

LAYOUTS = {
    "fsdp_tp": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "hsdp_tp": (8, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                    "2", "--parallelism.tensor_parallel_degree", "2"]),
}


def command(nproc: int, assets: pathlib.Path, extra: list[str]) -> list[str]:
    """The documented command (docs/torchtitan.md), with this test's assets and sizes."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), str(LAUNCHER),
            "--module", "llama3", "--config", "llama3_debugmodel",
            "--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset_path", str(assets / "c4_test"),
            "--dump_folder", str(assets / "outputs"), "--parallelism.spmd_backend", "spmd_types",
            "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--metrics.no-enable-tensorboard", "--debug.seed", "42", *extra, "activation-checkpoint:none"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torchtitan_assets")
    subprocess.run([sys.executable, str(LAUNCHER), "prepare", str(folder)], check=True, timeout=300)
    return folder


def _train(assets: pathlib.Path, layout: str, typed: bool) -> str:
    nproc, flags = LAYOUTS[layout]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    extra = list(flags)
    if typed:
        extra.append("--debug.spmd_typechecking")
        env["SPMD_TYPES_TRACE"] = "1"
    done = subprocess.run(command(nproc, assets, extra), capture_output=True, text=True, env=env, timeout=900,
                          cwd=assets)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    return log


def _losses(log: str) -> list[tuple[int, str]]:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    return sorted(set((int(s), loss) for s, loss in re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", plain)))


# HSDP's run is eight torchrun processes on CI's two cores (about 3.5 minutes): nightly size, as the FSDP matrix's
# slow rows (HSDP itself is typechecked and compared in tests/test_torchtitan_fsdp.py on every run).
NIGHTLY = {"hsdp_tp"}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow) if n in NIGHTLY else n for n in sorted(LAYOUTS)])
def test_the_documented_command_trains_two_steps_typed_as_untyped(request, assets, layout):
    if layout in NIGHTLY and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("nightly size: select with -m slow")
    typed, untyped = _train(assets, layout, typed=True), _train(assets, layout, typed=False)
    losses = _losses(typed)
    assert [step for step, _ in losses] == [1, 2]  # every rank printed the same loss at each step
    assert losses == _losses(untyped)
    checked = [line for line in typed.splitlines() if "spmd_types.trace" in line and "site-packages/torchtitan/" in line]
    assert any("F.linear(" in line for line in checked), "checking was not on: no torchtitan op was checked"
    assert "spmd_types.trace" not in untyped
