"""The package's modules import only downwards: no cycles, and LTensor knows nothing of collectives."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "spmd_types"


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.glob("*.py"):
        if path.name == "__init__.py":
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module)
        graph[path.stem] = deps
    return graph


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        for dep in graph.get(mod, ()):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(stack + [dep])
            if dep not in state:
                visit(dep, stack + [dep])
        state[mod] = 2

    for mod in graph:
        if mod not in state:
            visit(mod, [mod])


def test_lower_layers_do_not_import_upper_ones():
    graph = _imports()
    comm_layer = {"_local", "_collectives", "testing"}
    for low in ("_types", "_state", "_mesh", "_errors", "_rules_table", "_op_registry", "_rules", "_tensor"):
        assert not (graph[low] & comm_layer), f"{low} imports {graph[low] & comm_layer}"
    assert graph["_types"] == set(), "type values depend on nothing"
