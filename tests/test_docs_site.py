"""The documentation site: every page in the nav, pictures current, docstrings present, and the code on the pages runs.

`make docs` (run by `make test`) builds the site with `mkdocs build --strict`; these tests check
what the build cannot: that the code shown on the pages runs and prints what the pages say.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import linecache
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(text: str) -> list[tuple[str, str]]:
    """``[(language, body)]`` of the fenced code blocks in a Markdown text."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def _nav_files() -> list[str]:
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r":\s*(\S+\.md)\s*$", nav, flags=re.M)


def _committed_pages() -> list[str]:
    """The docs pages git tracks (a page still being written, untracked, is not held to the nav yet)."""
    run = subprocess.run(["git", "ls-files", "docs/*.md"], cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0 or not run.stdout.strip():
        return sorted(p.name for p in DOCS.glob("*.md"))
    return sorted(pathlib.Path(line).name for line in run.stdout.split() if line.count("/") == 1)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = _committed_pages()
    nav = _nav_files()
    assert [p for p in pages if p not in nav] == [], "add these pages to the nav in mkdocs.yml"
    assert [p for p in nav if not (DOCS / p).exists()] == []
    assert len(nav) == len(set(nav))


def test_make_test_builds_the_site_strictly():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\bdocs\b", makefile, flags=re.M)
    assert "mkdocs build --strict" in makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "site" in (ROOT / ".gitignore").read_text().split()


def test_public_names_have_docstrings():
    assert _load("hooks").undocumented() == []


def test_a_public_name_without_a_docstring_fails_the_build(monkeypatch):
    from mkdocs.exceptions import PluginError

    import spmd_types.testing as testing

    monkeypatch.setattr(testing, "undocumented_helper", lambda: None, raising=False)
    monkeypatch.setattr(testing, "__all__", [*testing.__all__, "undocumented_helper"])
    hooks = _load("hooks")
    assert hooks.undocumented() == ["spmd_types.testing.undocumented_helper"]
    with pytest.raises(PluginError) as err:
        hooks.on_pre_build({})
    assert str(err.value) == "public names without a docstring: spmd_types.testing.undocumented_helper"


SEED_TITLES = (
    "The SPMD type system for PyTorch",
    "JAX's sharding in types: Invariant, Varying, Unreduced, Reduced, and their transposes",
    "A Reduced placement for DTensor",
    "Efficient transposition of replication-inducing collectives (shard_map)",
)


def test_the_site_names_the_design_documents_and_sends_nobody_outside_the_repository():
    """Issue 14 item 5: a reader of the site does not have shared/seeds/; the home page says what each one is."""
    pages = {p.name: p.read_text() for p in DOCS.glob("*.md")}
    assert [name for name, text in pages.items() if "shared/seeds" in text] == []
    section = " ".join(pages["index.md"].split("## The design documents", 1)[1].split("\n## ", 1)[0].split())
    for number, title in zip(("003", "000", "001", "002"), SEED_TITLES):
        assert f'**Seed {number}, "{title}".**' in section


def test_the_api_page_drops_sphinx_roles_and_literal_colons():
    """Docstrings use :func:`x` and Example::, which mkdocstrings leaves as written: the hook reads them as prose."""

    class Page:
        class file:
            src_uri = "api.md"

    hooks = _load("hooks")
    html = "<p>Made by :func:<code>spmd.assert_type</code>.</p><p>Example::</p><p>::</p><p>all-gather::</p>"
    assert hooks.on_page_content(html, Page, None, None) == (
        "<p>Made by <code>spmd.assert_type</code>.</p><p>Example:</p><p>all-gather:</p>")
    Page.file.src_uri = "concepts.md"
    assert hooks.on_page_content(html, Page, None, None) == html  # other pages are Markdown, left alone
    assert "stylesheets/extra.css" in (ROOT / "mkdocs.yml").read_text() and (DOCS / "stylesheets" / "extra.css").exists()


def test_pictures_equal_a_fresh_drawing():
    diagrams = _load("diagrams")
    want = diagrams.pictures()
    have = {p.name: p.read_text() for p in (DOCS / "img").glob("*.svg")}
    assert sorted(have) == sorted(want), "run python docs/diagrams.py"
    stale = [name for name in want if have[name] != want[name]]
    assert stale == [], "run python docs/diagrams.py"


def test_every_transition_has_a_picture_on_the_concepts_page():
    from spmd_types._local.transitions import TRANSITIONS

    concepts = (DOCS / "concepts.md").read_text()
    for t in TRANSITIONS:
        assert f"(img/{t.op}_{t.src}_{t.dst}.svg)" in concepts
    assert "(img/denotation.svg)" in concepts and "(img/duality.svg)" in concepts


_RECIPES = [body for lang, body in _blocks((DOCS / "recipes.md").read_text()) if lang == "python"]


@pytest.mark.parametrize("code", _RECIPES, ids=[f"recipe{i}" for i in range(len(_RECIPES))])
def test_recipe_runs(code):
    assert "simulate(" in code
    exec(compile(code, "<docs/recipes.md>", "exec"), {"__name__": "__recipe__"})


def _code_and_output(page: str) -> list[tuple[str, str]]:
    blocks = _blocks((DOCS / page).read_text())
    return [(code, out) for (lang, code), (lang2, out) in zip(blocks, blocks[1:]) if lang == "python" and lang2 == "text"]


_ERRORS = _code_and_output("errors.md")


@pytest.mark.parametrize("code, output", _ERRORS, ids=[f"error{i}" for i in range(len(_ERRORS))])
def test_error_page_shows_the_real_message(code, output, tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_TYPES_ERRORS", "plain")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(code)
    linecache.clearcache()  # every snippet is "model.py": forget the previous one's lines
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path("model.py", run_name="__main__")
    assert printed.getvalue() == output


def test_errors_page_has_examples():
    assert len(_ERRORS) >= 4


def test_testing_guide_test_runs():
    code = next(body for lang, body in _blocks((DOCS / "testing.md").read_text()) if body.startswith("def test_"))
    head = "import torch\nimport torch.nn.functional as F\nimport spmd_types as spmd\n"
    head += "from spmd_types.testing import CommCounter, denote, per_rank, simulate\n"
    scope: dict = {}
    exec(compile(head + code, "<docs/testing.md>", "exec"), scope)
    scope["test_row_parallel_matches_one_device"]()


@pytest.fixture(scope="module")
def first_error_output() -> str:
    env = {**os.environ, "SPMD_TYPES_ERRORS": "plain"}
    run = subprocess.run([sys.executable, "examples/first_error.py"], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("page", ["README.md", "docs/getting_started.md"])
def test_first_example_and_its_output_are_the_real_ones(page, first_error_output):
    example = (ROOT / "examples" / "first_error.py").read_text()
    body = example.split('"""\n', 1)[1].lstrip("\n")
    pairs = [(c, o) for c, o in _code_and_output_text((ROOT / page).read_text()) if c.startswith("# examples/first_error.py")]
    assert len(pairs) == 1, f"{page} shows examples/first_error.py once, with its output"
    code, output = pairs[0]
    assert code.split("\n", 1)[1] == body
    assert output == first_error_output


def _code_and_output_text(text: str) -> list[tuple[str, str]]:
    blocks = _blocks(text)
    return [(code, out) for (lang, code), (lang2, out) in zip(blocks, blocks[1:]) if lang == "python" and lang2 == "text"]
