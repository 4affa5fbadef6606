"""The import graph of engine/, tuner/ and the entry points (colibri/), drawn from the code: no import
circles, nothing imported from a higher layer, engine never imports tuner, neither imports the entry
points, and no reaching into another module's private names.

What is not yet true is listed below as known debt (issue 24); the test fails on anything new
and on any listed item that is gone, so the lists can only shrink.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Low → high. A module may import its own package and any package listed before it. The longest
# matching prefix decides a module's layer: engine.weights is the weight operators the model
# computes with, below engine.arch and engine.format (which reads files and knows the
# architectures' tensor names). colibri/ holds the entry points (the HTTP server, the CLI) above both.
LAYERS = [
    "engine", "tuner", "colibri",  # the root packages hold only __version__
    "engine.base", "engine.native", "engine.weights", "engine.arch", "engine.format",
    "engine.movement", "engine.synth", "engine.run", "engine.api",
    "tuner.base", "tuner.sandbox", "tuner.probe", "tuner.results", "tuner.share", "tuner.costmodel", "tuner.search",
    "tuner.doctor",
    "colibri.serve", "colibri.commands", "colibri.cli",
]

# Known debt: (importer, imported) edges that go up a layer.
KNOWN_UPWARD = set()
# Known debt: the import circles (strongly connected components), each as a sorted tuple.
KNOWN_CYCLES = set()
# Function-level project imports allowed, as (importer, imported): only one that breaks a real
# optional dependency belongs here, with the reason in a comment at the import. None today.
ALLOWED_FUNCTION_LEVEL_IMPORTS = set()


def _modules(packages=("engine", "tuner", "colibri")) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _target(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path):
    """(imported module, imported names, at function level?) for every project import."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".") if is_pkg else module.split(".")[:-1]
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([child.module] if child.module else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    if full in MODULES:
                        yield full, None, in_function
                    elif _target(base):
                        yield _target(base), alias.name, in_function
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if _target(alias.name):
                        yield _target(alias.name), None, in_function
            yield from visit(child, nested)

    yield from visit(tree, False)


GRAPH = {m: [(t, n, f) for t, n, f in _imports(m, p) if t != m] for m, p in MODULES.items()}


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS.index(best)


def _cycles() -> set[tuple[str, ...]]:
    edges = {m: {t for t, _, _ in deps} for m, deps in GRAPH.items()}
    index, low, stack, on, out = {}, {}, [], set(), set()

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    for v in edges:
        if v not in index:
            strong(v)
    return out


def test_engine_never_imports_tuner():
    bad = [(m, t) for m, deps in GRAPH.items() if m.startswith("engine") for t, _, _ in deps if t.startswith("tuner")]
    assert bad == []


def test_engine_and_tuner_never_import_the_entry_points():
    bad = [(m, t) for m, deps in GRAPH.items() if not m.startswith("colibri") for t, _, _ in deps
           if t.startswith("colibri")]
    assert bad == []


def test_no_new_import_circles_and_none_of_the_known_ones_is_gone():
    found = _cycles()
    assert found - KNOWN_CYCLES == set(), "new import circle(s)"
    assert KNOWN_CYCLES - found == set(), "a known circle is gone: remove it from KNOWN_CYCLES"


def test_no_module_imports_from_a_higher_layer():
    upward = {(m, t) for m, deps in GRAPH.items() for t, _, _ in deps if _layer(t) > _layer(m)}
    assert upward - KNOWN_UPWARD == set(), "import(s) from a higher layer"
    assert KNOWN_UPWARD - upward == set(), "a known upward import is gone: remove it from KNOWN_UPWARD"


def test_no_function_level_project_imports():
    found = {(m, t) for m, deps in GRAPH.items() for t, _, fn in deps if fn}
    assert found - ALLOWED_FUNCTION_LEVEL_IMPORTS == set(), "import at module level (no circle to hide)"
    assert ALLOWED_FUNCTION_LEVEL_IMPORTS - found == set(), "an allowed function-level import is gone: unlist it"


def test_the_engine_has_no_function_level_project_imports():
    found = sorted({(m, t) for m, deps in GRAPH.items() if m.startswith("engine") for t, _, fn in deps if fn})
    assert found == [], "import at module level (engine/ has no circle to hide)"


def test_no_module_reaches_another_modules_private_names():
    private = sorted({(m, t, n) for m, deps in GRAPH.items() for t, n, _ in deps
                      if n and n.startswith("_") and not n.startswith("__")})
    assert private == KNOWN_PRIVATE_REACHES, "a private name imported across packages"


# Known debt: private names imported from another module.
KNOWN_PRIVATE_REACHES = []


# The engine's front door (engine/api/__init__.py; engine/api/lab.py its bench-side room): all that
# code outside engine/ may import of the engine. tests/ may reach inside: they test the internals.
DOOR = {"engine.api", "engine.api.lab"}


def _engine_imports_from_outside() -> set[tuple[str, str]]:
    """(importer, engine module) for every import of the engine by tuner/, colibri/ and benchmarks/."""
    outside = {m: p for m, p in _modules(("tuner", "colibri")).items()}
    outside.update({".".join(p.relative_to(ROOT).with_suffix("").parts): p
                    for p in sorted((ROOT / "benchmarks").rglob("*.py"))})
    found = set()
    for module, path in outside.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] if node.module != "engine" else [f"engine.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found |= {(module, n) for n in names if n == "engine" or n.startswith("engine.")}
    return found


def test_outside_code_enters_the_engine_by_its_front_door_only():
    past = sorted((m, t) for m, t in _engine_imports_from_outside() if t not in DOOR | {"engine.__version__"})
    assert past == [], "an import of an engine module past its front door (engine/api): re-export the name there"


def test_the_tuner_and_the_entry_points_use_the_door_not_its_bench_room():
    lab = sorted((m, t) for m, t in _engine_imports_from_outside() if t == "engine.api.lab"
                 and not m.startswith("benchmarks"))
    assert lab == [], "engine/api/lab.py is for benchmarks/: the tuner and colibri/ import engine.api"


def test_every_door_name_resolves_to_an_engine_module():
    import importlib
    for door in DOOR:
        mod = importlib.import_module(door)
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{door}.{name}"
        homes = {m for m in vars(mod)["_HOME"].values()}
        assert all(h == "engine" or h.startswith("engine.") for h in homes), homes
