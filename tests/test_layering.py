"""The package is rooms by layer, and a room imports only from the rooms below it (and its own).

Bottom to top (CONTRIBUTING.md has the map):

    _torch < _core < _local < _global < _guards < _checker < _comm < _boundaries < _compile < integrations < public modules

Within a room, modules may import each other, with no cycles anywhere.
"""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "spmd_types"
ROOMS = ["_torch", "_core", "_local", "_global", "_guards", "_checker", "_comm", "_boundaries", "_compile",
         "integrations"]
PUBLIC = {"__init__", "megatron", "testing", "types", "runtime", "checker", "rules", "rulecheck",
          "_mesh_axis"}  # a private path of the published package that torch 2.14 imports
# The core's one door upwards: a DTensor met by a core op is handed to the DTensor integration, loaded lazily
# (the core never imports DTensor itself; see _core/dtensor_hook.py).
ALLOWED_UPWARD = {("_core.dtensor_hook", "integrations.dtensor.bridge")}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    path = PKG / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (module-level and lazy), as dotted names under spmd_types."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                target = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:  # from x import y: y may be a module of x
                    sub = f"{target}.{alias.name}" if target else alias.name
                    deps.add(sub if _is_module(sub) else target)
        graph[name] = deps
    return graph


def _room(module: str) -> int:
    head = module.split(".")[0]
    if head in ROOMS:
        return ROOMS.index(head)
    return len(ROOMS)  # the public modules sit on top


def test_every_private_module_lives_in_a_room():
    loose = sorted(p.stem for p in PKG.glob("*.py") if p.stem not in PUBLIC)
    assert loose == [], f"modules outside the rooms: {loose} (put each in the room of its layer)"
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ROOMS + ["testing"])


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        for dep in graph.get(mod, ()):
            if dep == mod or dep not in graph:
                continue
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(stack + [dep])
            if dep not in state:
                visit(dep, stack + [dep])
        state[mod] = 2

    for mod in graph:
        if mod not in state:
            visit(mod, [mod])


def test_rooms_import_only_downwards():
    upward = []
    for mod, deps in _imports().items():
        for dep in deps:
            if dep and _room(dep) > _room(mod) and (mod, dep) not in ALLOWED_UPWARD:
                upward.append(f"{mod} imports {dep}")
    assert upward == []


def test_the_type_values_depend_on_nothing():
    assert _imports()["_core.types"] == set()
