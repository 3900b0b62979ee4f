"""The published package's own test suite, run against this package: the conformance check.

meta-pytorch's ``spmd-types`` keeps its tests public (``tests/`` of its
repository). This script runs them here the way a user of the published API
would, changing nothing but the imports of that package's private modules:

* a private path whose name this package publishes (``spmd_types._checker.assert_type``,
  ``spmd_types._type_attr.get_local_type``, ...) is imported from ``spmd_types``;
* the peer's test utilities (``_test_utils``' test cases, ``_testing.fake_pg``,
  the axis-name registry's ``_reset`` / ``_register_name``) come from
  ``benchmarks/conformance_helpers.py``, written here;
* any other private name becomes a stand-in that raises ``PeerPrivateInternal``
  when a test uses it (the test then counts as testing a private internal).

The tests are copied into a temporary folder and rewritten there; nothing of the
peer's is kept in this repository. Each remaining failure must be classified in
``benchmarks/conformance_status.txt`` (a deliberate difference with its numbered
choice in docs/choices.md, a test of a private internal, or a test that needs a file of
the peer's repository other than its tests, which are all the script copies); tests listed there
as ``fixed`` failed before issue 21 and must pass. The script prints the counts
and exits non-zero on an unclassified failure or a stale row.

Usage::

    python benchmarks/conformance.py PATH/TO/spmd_types/tests [--extra-path DIR] [-k EXPR] [--jobs-file OUT]

``--extra-path`` adds a folder to ``PYTHONPATH`` (the peer's tests need
``expecttest``, which torch's CPU wheels do not install).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STATUS_FILE = HERE / "conformance_status.txt"
HELPERS = "_conformance_helpers"

# Private paths of the peer whose names this package publishes: imported from the public module instead.
PUBLIC = {
    "spmd_types._checker": ("spmd_types", {
        "assert_type", "get_local_type", "get_partition_spec", "mutate_type", "no_typecheck", "typecheck", "trace",
        "register_autograd_function", "register_decomposition", "register_local_autograd_function",
        "reinterpret_mesh", "dtensor_placement_to_spmd_type",
    }),
    "spmd_types._collectives": ("spmd_types", {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                               "redistribute", "unshard"}),
    "spmd_types._local": ("spmd_types", {"reinterpret", "convert", "shard", "invariant_to_replicate"}),
    "spmd_types._state": ("spmd_types", {"is_type_checking", "current_mesh"}),
    "spmd_types._type_attr": ("spmd_types", {"get_local_type", "get_axis_local_type", "maybe_get_axis_local_type"}),
    "spmd_types._traceback": ("spmd_types", {"traceback_filtering"}),
    # a private path that torch 2.14 imports, so this package has it too
    "spmd_types._mesh_axis": ("spmd_types._mesh_axis", {"MeshAxis", "flatten_axes"}),
}
# The peer's test utilities: this package's own versions in conformance_helpers.py.
HELPER_NAMES = {
    ("spmd_types._test_utils", "FakeProcessGroupTestCase"): "FakeProcessGroupTestCase",
    ("spmd_types._test_utils", "LocalTensorTestCase"): "LocalTensorTestCase",
    ("spmd_types._test_utils", "SpmdTypeCheckedTestCase"): "SpmdTypeCheckedTestCase",
    ("spmd_types._testing", "fake_pg"): "fake_pg",
    ("spmd_types._mesh_axis", "_reset"): "reset_axis_names",
    ("spmd_types._mesh_axis", "_register_name"): "register_axis_name",
}
CLASSES = ("fixed", "choice", "private", "environment")


def _is_private(module: str | None) -> bool:
    return bool(module) and module.startswith("spmd_types._")


def _replacement(node: ast.stmt) -> list[str] | None:
    """The statements that replace a private import, or None to keep it."""
    if isinstance(node, ast.Import):
        if not any(_is_private(a.name) for a in node.names):
            return None
        return [f"{a.asname or a.name.split('.')[0]} = {HELPERS}.private({a.name!r})" if _is_private(a.name)
                else f"import {a.name}" + (f" as {a.asname}" if a.asname else "") for a in node.names]
    if not isinstance(node, ast.ImportFrom) or not _is_private(node.module):
        return None
    out = [f"import {HELPERS}"]
    public_module, public = PUBLIC.get(node.module, ("", set()))
    for alias in node.names:
        local = alias.asname or alias.name
        if alias.name in public:
            out.append(f"from {public_module} import {alias.name} as {local}")
        elif (node.module, alias.name) in HELPER_NAMES:
            out.append(f"from {HELPERS} import {HELPER_NAMES[node.module, alias.name]} as {local}")
        else:
            out.append(f"{local} = {HELPERS}.private({node.module + '.' + alias.name!r})")
    return out


def rewrite(source: str) -> str:
    """``source`` with the peer's private imports replaced, line numbers kept (one line, then blank lines)."""
    lines = source.splitlines()
    edits = []
    for node in ast.walk(ast.parse(source)):
        stmts = _replacement(node) if isinstance(node, (ast.Import, ast.ImportFrom)) else None
        if stmts is not None:
            edits.append((node.lineno, node.end_lineno, node.col_offset, stmts))
    for start, end, col, stmts in sorted(edits, reverse=True):
        lines[start - 1:end] = [" " * col + "; ".join(stmts)] + [""] * (end - start)
    return "\n".join(lines) + "\n"


def prepare(tests: Path, into: Path) -> list[str]:
    """Copy and rewrite the peer's test files into ``into``; their names."""
    names = []
    for path in sorted(tests.glob("*.py")):
        (into / path.name).write_text(rewrite(path.read_text()))
        names.append(path.name)
    shutil.copy(HERE / "conformance_helpers.py", into / f"{HELPERS}.py")
    return names


def run_pytest(folder: Path, extra_path: list[str], selection: list[str]) -> Path:
    """Run pytest on the rewritten tests; the JUnit XML report's path."""
    report = folder / "report.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(folder), *extra_path, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--continue-on-collection-errors", "-o", "faulthandler_timeout=300", "--rootdir", str(folder),
           f"--junitxml={report}", *selection]
    subprocess.run(cmd, cwd=folder, env=env, check=False)
    return report


def _test_id(case: ET.Element) -> str:
    module = case.get("classname", "")
    if not module:  # a file that failed to import: one row for the whole file
        return f"{case.get('name')}.py::<import>"
    file, _, cls = module.partition(".")
    return f"{file}.py::{cls}::{case.get('name')}" if cls else f"{file}.py::{case.get('name')}"


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (passed | failed | skipped, failure text)}`` from the JUnit report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            out[_test_id(case)] = ("failed", (bad.get("message") or "") + "\n" + (bad.text or ""))
        elif case.find("skipped") is not None:
            out[_test_id(case)] = ("skipped", "")
        else:
            out[_test_id(case)] = ("passed", "")
    return out


def load_status(path: Path = STATUS_FILE) -> dict[str, tuple[str, str]]:
    """``{test id: (fixed | choice N | private, reason)}`` from the classification file."""
    rows = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        test, status, reason = (line.split("\t") + ["", ""])[:3]
        if status.split(" ")[0] not in CLASSES:
            raise ValueError(f"{path.name}: {test}: unknown status {status!r}")
        rows[test] = (status, reason)
    return rows


def classify(results: dict[str, tuple[str, str]], status: dict[str, tuple[str, str]]) -> dict[str, list[str]]:
    """Tests by verdict: pass, fixed, choice, private, environment, skipped, unclassified, stale (listed, yet not
    as listed)."""
    out: dict[str, list[str]] = {k: [] for k in ("pass", "fixed", "choice", "private", "environment", "skipped",
                                                 "unclassified", "stale")}
    for test, (outcome, text) in sorted(results.items()):
        listed = status.get(test, ("", ""))[0].split(" ")[0]
        if outcome == "skipped":
            out["skipped"].append(test)
        elif outcome == "passed":
            out["fixed" if listed == "fixed" else "pass"].append(test)
            if listed in ("choice", "private", "environment"):
                out["stale"].append(test)
        elif listed in ("choice", "private", "environment"):
            out[listed].append(test)
        elif "PeerPrivateInternal" in text:
            out["private"].append(test)
        else:
            out["unclassified"].append(test)
            if listed == "fixed":
                out["stale"].append(test)
    return out


def summary(verdicts: dict[str, list[str]], results: dict[str, tuple[str, str]]) -> str:
    total = len(results)
    lines = [f"peer tests run: {total}",
             f"  pass: {len(verdicts['pass']) + len(verdicts['fixed'])} (of which fixed in issue 21: "
             f"{len(verdicts['fixed'])})",
             f"  deliberate difference (numbered choice): {len(verdicts['choice'])}",
             f"  tests a private internal of the peer: {len(verdicts['private'])}",
             f"  needs what the runner does not copy (environment): {len(verdicts['environment'])}",
             f"  skipped by the peer's own conditions: {len(verdicts['skipped'])}",
             f"  unclassified failures: {len(verdicts['unclassified'])}"]
    for test in verdicts["unclassified"]:
        first = next((ln for ln in results[test][1].splitlines() if ln.strip()), "")
        lines.append(f"    {test}: {first[:160]}")
    for test in verdicts["stale"]:
        lines.append(f"  stale row in {STATUS_FILE.name}: {test} ({results[test][0]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="the peer's tests/ folder")
    parser.add_argument("--extra-path", action="append", default=[], help="a folder added to PYTHONPATH")
    parser.add_argument("-k", default=None, help="pytest's -k selection")
    parser.add_argument("--keep", type=Path, default=None, help="rewrite into this folder and keep it")
    parser.add_argument("--failures", type=Path, default=None, help="write each failure's text here")
    args = parser.parse_args(argv)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="spmd_conformance_"))
    folder.mkdir(parents=True, exist_ok=True)
    prepare(args.tests, folder)
    results = outcomes(run_pytest(folder, args.extra_path, ["-k", args.k] if args.k else []))
    verdicts = classify(results, load_status())
    print(summary(verdicts, results))
    if args.failures:
        args.failures.write_text("".join(f"=== {t}\n{results[t][1]}\n" for t in sorted(results)
                                         if results[t][0] == "failed"))
    counts = Counter({k: len(v) for k, v in verdicts.items()})
    if args.keep is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if counts["unclassified"] or counts["stale"] else 0


if __name__ == "__main__":
    sys.exit(main())
