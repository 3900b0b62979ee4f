"""Every private torch name the package uses (``spmd_types/_torch/private.py``) exists on this torch.

The test suite runs on each supported release (2.13.0 and 2.14.1), so a release
that moves one of them fails here, by name, instead of as an import error in a
user's job; and no module outside the room reaches into torch's private names.
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest

from spmd_types._torch.private import NAMES

PKG = pathlib.Path(__file__).resolve().parents[1] / "spmd_types"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_private_name_exists_on_this_torch(name):
    assert NAMES[name]() is not None, name


# torch's private names as code reaches them: torch._X or a private module of torch (also through ``dist``, and
# imported by name), Function.apply's __func__, private fields of torch objects (a DTensor's _local_tensor and
# _spec, a LocalTensor's _local_tensors, a storage's _cdata, an op's _schema, the process-group world's...)
_FIELDS = ("_spec", "_cdata", "_schema", "_parameters", "_execution_engine", "_is_compiling_flag", "_world",
           "_default_pg", "_base", "_LocalDist", "_int_on_rank")
_PRIVATE = re.compile(r"\btorch(\.\w+)*\._[A-Za-z]|\bfrom torch(\.\w+)* import .*\b_[A-Za-z]|\bdist(\.\w+)*\._[A-Za-z]"
                      r"|\bapply\.__func__|\b_local_tensors?\b|\.(" + "|".join(_FIELDS) + r")\b")
# a private field named as a string (getattr, hasattr): a string that is only such a name
_PRIVATE_STRING = re.compile(r"_local_tensors?|" + "|".join(_FIELDS))

# (module, what it reads) -> why it reads a private field of a torch object itself, not through the room: a read on
# a hot path, where a function call per read would cost more than the read (the room's NAMES still checks the name)
EXCEPTIONS = {
    ("_checker/latent.py", "._default_pg"): "the erased assert_type records the world's default group per call",
    ("_checker/asserts.py", "._default_pg"): "assert_type's erased path, latent.remember inline (one frame per call)",
    ("_checker/asserts.py", "._is_compiling_flag"): "assert_type's erased path reads torch.compiler's flag, as "
                                                    "torch.compiler.is_compiling() does, without its call",
    ("_checker/tensor.py", "._is_compiling_flag"): "every typed op's __torch_function__ reads torch.compiler's flag "
                                                   "(a module attribute that changes: no alias can hold it)",
    ("_checker/metadata_reads.py", "._is_compiling_flag"): "every metadata read of a typed tensor (shape, dtype, "
                                                           "size()) reads torch.compiler's flag, as tensor.py does",
    ("_checker/run_ops.py", "._base"): "Tensor._base (a view's base, in torch's view docs): every in-place op's "
                                       "destination is read under the dispatch mode",
}


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """Lines of code (not comments, not docstring or string text): what a torch release can break.

    Names and operators are kept, "." glued to its neighbours and other tokens a space apart; a string whose
    whole text is a private name (``getattr(t, "_local_tensors")``) is kept as that name.
    """
    code: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        text = tok.string
        if tok.type == tokenize.STRING:
            inner = text.strip("rbuRBU").strip("'\"")
            if not _PRIVATE_STRING.fullmatch(inner):
                continue
            text = inner
        elif tok.type not in (tokenize.NAME, tokenize.OP):
            continue
        code.setdefault(tok.start[0], []).append(text)
    lines = []
    for n, toks in sorted(code.items()):
        out = ""
        for i, t in enumerate(toks):
            out += t if i == 0 or t == "." or toks[i - 1] == "." else " " + t
        lines.append((n, out))
    return lines


def test_only_the_room_reaches_into_torchs_private_names():
    """No module outside ``spmd_types/_torch/`` names a private torch name in code (comments and docs may)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.parent.name == "_torch":
            continue
        module = str(path.relative_to(PKG))
        for n, line in _code_lines(path):
            for (where, read) in EXCEPTIONS:
                if where == module:
                    line = line.replace(read, "")
            if _PRIVATE.search(line):
                found.append(f"{module}:{n}: {line}")
    assert found == [], "private torch names outside spmd_types/_torch/private.py:\n" + "\n".join(found)
