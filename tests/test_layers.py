"""The architecture: layers, low to high, and the import graph of ``ropekit`` and ``ropekit_studies`` that must
respect them.

A module may import from its own layer and the layers below it, never from a layer above, and no two modules may
import each other, directly or through others; nothing in ``ropekit`` imports ``ropekit_studies``. The layers are
the table of ``docs/architecture.md`` (read here, so the page and the test cannot disagree): a module belongs to
the layer of its longest matching prefix; a ``ropekit`` module named ``cli`` or ``commands`` is a command-line
module, in the tools layer, wherever it lives. The graph is built from the source with ``ast``: every ``import``
and ``from ... import`` (at module level, inside functions, under ``if TYPE_CHECKING``), relative imports
resolved, and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name. ``from pkg import
name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "ropekit"
#: The packages whose modules are checked, and the folder each is imported from.
PACKAGES = {"ropekit": REPO, "ropekit_studies": REPO / "studies"}
ARCHITECTURE = REPO / "docs" / "architecture.md"


def read_layers(text: str) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """(layer name, module prefixes), low to high, from the markdown table under ``## The layers`` of ``text``:
    the first column ``N name`` (numbered from 0, in order), the second the modules in backticks."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # header and rule left out
    layers = []
    for i, row in enumerate(rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        number, _, name = cells[0].partition(" ")
        assert number == str(i) and name, f"docs/architecture.md: layer row {i} starts with {cells[0]!r}"
        modules = tuple(re.findall(r"`([A-Za-z_][\w.]*)`", cells[1]))
        assert modules, f"docs/architecture.md: layer {name} names no module"
        layers.append((name, modules))
    assert layers, "docs/architecture.md has no layer table"
    return tuple(layers)


#: (layer name, module prefixes), low to high. ``"ropekit"`` matches the package's ``__init__`` only.
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = read_layers(ARCHITECTURE.read_text())
#: The layer of ``ropekit``'s command-line modules.
TOOLS = next(i for i, (name, _) in enumerate(LAYERS) if name == "tools")

#: Last components that make a ``ropekit`` module a command-line module (the tools layer) wherever it lives.
COMMAND_MODULES = ("cli", "commands")

Edge = Tuple[str, int]  # (imported module, line)


def module_files() -> Dict[str, Path]:
    """Module name -> source file of both packages; a package is named as it is imported (``ropekit.nn`` for its
    ``__init__``)."""
    mods = {}
    for package, base in PACKAGES.items():
        for path in sorted((base / package).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _target(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The module of :data:`PACKAGES` ``name`` names, or its nearest existing ancestor; ``None`` outside them."""
    if not any(name == p or name.startswith(p + ".") for p in PACKAGES):
        return None
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str, path: Path, modules: Dict[str, Path]) -> Iterator[Edge]:
    """Every ropekit module ``module`` imports, with the line of the import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if _is_package(path) else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                t = _target(alias.name, modules)
                if t:
                    yield t, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            t = _target(name, modules)
            if t is None:
                continue
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                yield (sub if sub in modules else t), node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if fname in ("import_module", "__import__"):
                t = _target(node.args[0].value, modules)
                if t:
                    yield t, node.lineno


def import_graph() -> Dict[str, Dict[str, int]]:
    """Module -> {imported module: first line importing it}, self-imports left out."""
    modules = module_files()
    graph: Dict[str, Dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in imports_of(module, path, modules):
            if target != module:
                edges.setdefault(target, line)
    return graph


def layer_of(module: str, is_package: bool = False) -> int:
    """Index in :data:`LAYERS` of ``module``'s layer (a package is looked up as ``pkg.__init__``)."""
    if module.startswith("ropekit.") and module.rsplit(".", 1)[-1] in COMMAND_MODULES:
        return TOOLS
    key = module + ".__init__" if is_package else module
    hits = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
            if (module == "ropekit" if p == "ropekit" else key == p or key.startswith(p + "."))]
    assert hits, f"{module} is in no layer: add it to the table of docs/architecture.md"
    return max(hits)[1]


def cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected component."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    comps: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan, iterative
        work = [(v, iter(sorted(graph.get(v, {}))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(sorted(c), graph) for c in comps]


def _cycle_in(comp: List[str], graph: Dict[str, Dict[str, int]]) -> List[str]:
    """A shortest cycle through ``comp[0]`` inside the component (breadth-first)."""
    members, start = set(comp), comp[0]
    prev: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def _where(graph: Dict[str, Dict[str, int]], a: str, b: str) -> str:
    path = module_files()[a]
    return f"{path.relative_to(REPO)}:{graph[a][b]}"


def test_every_module_is_in_a_layer():
    for module, path in module_files().items():
        layer_of(module, _is_package(path))


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    report = ["import cycle: " + " -> ".join(c) + "\n    " +
              "\n    ".join(f"{_where(graph, a, b)} imports {b}" for a, b in zip(c, c[1:])) for c in found]
    assert not found, "\n".join(report)


def test_no_import_against_the_layers():
    graph = import_graph()
    files = module_files()
    bad = []
    for a, edges in sorted(graph.items()):
        la = layer_of(a, _is_package(files[a]))
        for b in sorted(edges):
            lb = layer_of(b, _is_package(files[b]))
            if lb > la:
                bad.append(f"{_where(graph, a, b)}: {a} ({LAYERS[la][0]}) imports {b} ({LAYERS[lb][0]})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_library_never_imports_the_studies():
    """``pip install ropekit`` installs no study, so no module of ``ropekit`` may import one (not even inside a
    function or by ``importlib``): the studies reach the command line through entry points only."""
    graph = import_graph()
    bad = [f"{_where(graph, a, b)}: {a} imports {b}" for a, edges in sorted(graph.items())
           if a == "ropekit" or a.startswith("ropekit.") for b in sorted(edges) if b.startswith("ropekit_studies")]
    assert not bad, "the library imports the studies:\n" + "\n".join(bad)


def test_the_studies_are_the_top_layer_and_outside_the_package():
    """The studies are the last row of the table, named by their package alone, and no study file is left in
    ``ropekit/``."""
    assert LAYERS[-1] == ("studies", ("ropekit_studies",))
    assert all(not p.startswith("ropekit_studies") for _, prefixes in LAYERS[:-1] for p in prefixes)
    assert not (ROOT / "experiments").exists()
    assert not any(p.name in ("experiment.py", "recipes.py") for p in ROOT.rglob("*.py"))
    assert layer_of("ropekit_studies.cli") == len(LAYERS) - 1  # a study's cli is a study, not a library tool


def test_the_checker_itself():
    """A cycle is found and printed as a path; imports are resolved (relative, function-level); command-line modules
    are the top layer wherever they live; a package's ``__init__`` has its own layer."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 1}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    graph = import_graph()
    assert "ropekit._optional" in graph["ropekit.cli"]                         # relative, module level
    assert "ropekit_studies.robot" in graph["ropekit_studies.task_studies"]  # inside a function
    assert layer_of("ropekit.data.cli") == TOOLS
    layers = read_layers("## The layers\n\n| layer | modules |\n|---|---|\n| 0 low | `a`, `a.b` |\n"
                         "| 1 high | `c` (and text) |\n\n## Next\n| 7 x | `z` |\n")
    assert layers == (("low", ("a", "a.b")), ("high", ("c",)))
    assert layer_of("ropekit.encodings.fold") == 0
    # the engine's package is the engine, classification a task package like the others
    tasks = next(i for i, (name, _) in enumerate(LAYERS) if name == "tasks")
    assert layer_of("ropekit.train", is_package=True) == layer_of("ropekit.train.engine") == tasks - 1
    assert layer_of("ropekit.classification", is_package=True) == layer_of("ropekit.classification.config") == tasks
