"""Real multi-process runs: 4 gloo processes on a (dp=2, tp=2) mesh (issue 3, item 6).

Three parallel programs (a Megatron TP MLP with data parallelism, a
sequence-parallel block, FSDP x TP), each typed and erased, are checked against
a single-device run of the same model: loss and every parameter gradient. The
programs live in ``_gloo_programs.py``; one spawn runs them all (each spawn
costs ~10 s on 2 cores), and each test reads its program's per-rank result.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from _gloo_programs import MODES, PROGRAMS, WORLD, worker
from torch.multiprocessing.spawn import ProcessException

DEADLINE_S = 240  # the whole spawn; it normally takes ~15 s


def _read_results(out_dir: Path) -> dict[int, dict[str, dict]]:
    """{rank: {key: row}} from the workers' JSON-lines files (missing ranks map to {})."""
    results: dict[int, dict[str, dict]] = {}
    for rank in range(WORLD):
        path = out_dir / f"rank{rank}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        results[rank] = {row["key"]: row for row in rows}
    return results


def _spawn(out_dir: Path) -> str | None:
    """Run the workers to completion; the reason they did not finish cleanly, or None."""
    init_method = "file://" + str(out_dir / "filestore")  # a FileStore: no TCP port to race for
    ctx = mp.start_processes(worker, args=(str(init_method), str(out_dir)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:  # only the processes this fixture started
                    if p.is_alive():
                        p.terminate()
                return f"the workers did not finish within {DEADLINE_S} s (a hang in a collective?)"
    except ProcessException as err:  # a worker died outside the per-program try (its traceback is in err)
        return f"a worker failed: {err}"
    return None


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """Every program's result on every rank, from a single spawn of WORLD gloo processes."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out_dir = tmp_path_factory.mktemp("gloo")
    start = time.perf_counter()
    crash = _spawn(out_dir)
    return _read_results(out_dir), crash, time.perf_counter() - start


def _failures(results: dict, crash: str | None, key: str) -> list[str]:
    """One message per distinct failure, naming the ranks that hit it (usually all ranks fail alike)."""
    by_text: dict[str, list[int]] = {}
    for rank, rows in results.items():
        row = rows.get(key)
        if "__worker__" in rows:
            text = f"worker failed:\n{rows['__worker__']['error']}"
        elif row is None:
            text = f"no result for {key}" + (f" ({crash})" if crash else "")
        elif row["error"]:
            text = f"{key}:\n{row['error']}"
        elif "loss" not in row["checked"] or len(row["checked"]) < 2:
            text = f"{key}: checked only {row['checked']}"
        else:
            continue
        by_text.setdefault(text, []).append(rank)
    return [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}" for text, r in by_text.items()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", PROGRAMS)
def test_gloo_program_matches_single_device(gloo_results, program, mode):
    """Loss and every parameter gradient equal the single-device run's, on every rank."""
    results, crash, _ = gloo_results
    failures = _failures(results, crash, f"{program}-{mode}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def test_gloo_workers_exit_cleanly(gloo_results):
    """The spawn itself finished: no worker died, no hang."""
    _, crash, seconds = gloo_results
    assert crash is None, crash
    assert seconds < DEADLINE_S
