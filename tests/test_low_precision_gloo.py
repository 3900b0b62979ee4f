"""FSDP in low precision end to end: bf16 all-gather forward, fp32 reduce-scatter backward.

The same step (``tests/_low_precision_gloo.py``) runs on 2 simulated ranks in
this process and on 2 real gloo processes, erased and typed. Every number is
exact by construction, so the gloo run must equal the simulated one bit for
bit, and both must equal the single-device meaning (float64, the weight
rounded to bf16 as gathered); the collectives must have run in bf16 (the
gather) and fp32 (the loss's all-reduce, the gradient's reduce-scatter).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _low_precision_gloo import MODES, WORLD, fsdp_step, reference, to_json, worker
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode
from torch.multiprocessing.spawn import ProcessException

import spmd_types as spmd
from spmd_types.testing import CommCounter, per_rank, rank_values

DEADLINE_S = 180  # the whole spawn; it normally takes ~10 s
EXPECTED_COMMS = [["all_gather_into_tensor", "torch.bfloat16"], ["all_reduce", "torch.float32"],
                  ["reduce_scatter_tensor", "torch.float32"]]


def _spawn(out_dir: Path) -> str | None:
    """Run the workers to completion; the reason they did not finish cleanly, or None."""
    ctx = mp.start_processes(worker, args=("file://" + str(out_dir / "filestore"), str(out_dir)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:  # only the processes this fixture started
                    if p.is_alive():
                        p.terminate()
                return f"the workers did not finish within {DEADLINE_S} s (a hang in a collective?)"
    except ProcessException as err:
        return f"a worker failed: {err}"
    return None


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> dict:
    """{(rank, mode): row} from one spawn of WORLD gloo processes."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out_dir = tmp_path_factory.mktemp("lowp_gloo")
    crash = _spawn(out_dir)
    rows = {}
    for rank in range(WORLD):
        path = out_dir / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            rows[(rank, row["key"])] = row
    assert crash is None and not any(k[1] == "__worker__" for k in rows), (crash, rows)
    return rows


@pytest.fixture(scope="module")
def simulated() -> dict:
    """{(rank, mode): row} of the same step on simulated ranks."""
    mesh = fake_mesh((WORLD,), ("dp",))
    results = {}
    with LocalTensorMode(WORLD), spmd.set_current_mesh(mesh):
        for mode in MODES:
            with CommCounter() as comms:
                results[mode] = fsdp_step(mode == "typed", per_rank)
            assert comms.counts == {"all_gather": 1, "all_reduce": 1, "reduce_scatter": 1}
            results[mode]["per_rank"] = {k: rank_values(results[mode][k]) for k in ("loss", "grad")}
    return {(rank, mode): to_json({**result, **{k: v[rank] for k, v in result["per_rank"].items()}}, lambda t: t)
            for mode, result in results.items() for rank in range(WORLD)}


@pytest.mark.parametrize("mode", MODES)
def test_simulated_step_is_the_single_device_meaning(simulated, mode):
    loss, grad = reference()
    shards = grad.chunk(WORLD, 0)
    for rank in range(WORLD):
        row = simulated[(rank, mode)]
        assert row["loss"] == loss.item()
        assert torch.equal(torch.tensor(row["grad"], dtype=torch.float64), shards[rank])
        assert row["gathered_dtype"] == "torch.bfloat16" and row["grad_dtype"] == "torch.float32"
        assert row["comms"] == EXPECTED_COMMS
        assert row["grad_type"] == ("{'dp': S(0)}" if mode == "typed" else "None")
    # The fp32 reduce-scatter matters here: the gradient summed in bf16 would differ.
    assert not torch.equal(grad.to(torch.bfloat16).double(), grad)


@pytest.mark.parametrize("mode", MODES)
def test_gloo_step_matches_the_simulated_one(gloo_results, simulated, mode):
    for rank in range(WORLD):
        got = gloo_results[(rank, mode)]
        assert got["error"] is None, got["error"]
        want = simulated[(rank, mode)]
        assert {k: got[k] for k in want} == want
