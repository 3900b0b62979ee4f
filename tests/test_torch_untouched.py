"""Installing this package never breaks torch: torch's own features on plain tensors work exactly as without it.

torch 2.14 imports ``spmd_types`` from FSDP2 whenever it is installed, and
DTensor and ``torch._dynamo`` import FSDP2, so an import error or a side effect
here would break ``fully_shard``, ``DTensor.from_local`` and ``torch.compile``
for every user of the environment. The same script runs with the package seen
and with torch told it is absent; both must print the same.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist
from conftest import torch_calls_spmd_types

HERE = pathlib.Path(__file__).resolve().parent


def _run(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "_torch_untouched.py"), mode], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed (gloo)")
def test_fsdp_dtensor_and_compile_are_unchanged_by_the_package():
    seen, hidden = _run("seen"), _run("hidden")
    import torch

    calls_us = torch_calls_spmd_types()  # torch 2.14 and later import the package from FSDP2
    assert seen.pop("spmd_types imported") is calls_us, torch.__version__
    assert hidden.pop("spmd_types imported") is False
    assert seen == hidden
    assert seen["from_local"] == {"placements": ["R"],
                                  "full": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]}
    assert seen["compile"] == [[2.0, 2.0, 2.0]] * 3
