"""The import graph of the project's packages: no module imports one that imports it back,
and no folder imports one that imports it back.

Every `import` counts, also those inside functions, under TYPE_CHECKING or in a `__main__`
block: a circle there still ties two modules' designs together. Cycles that must stay for a
while are listed in KNOWN with their owners (none today); the test fails on a new one and on a
listed one that is gone (then remove it from the list).

    python -m tests.test_import_cycles   # print the cycles
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("llm_server", "converters", "replay")

# Known cycles, each for its package's owners to open: a cycle is known when all its modules
# match one entry's patterns (fnmatch), so a module joining its family's circle is no news.
KNOWN = ()


def _known(cycle: tuple[str, ...], entry: tuple[str, ...]) -> bool:
    return all(any(fnmatch.fnmatchcase(m, pattern) for pattern in entry) for m in cycle)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, known) -> set[str]:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        nodes = ast.walk(ast.parse(path.read_text(), str(path)))
        graph[module] = set().union(
            *(
                _imported(module, path, n, modules)
                for n in nodes
                if isinstance(n, ast.Import | ast.ImportFrom)
            )
        )
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), names sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_but_the_known_ones():
    found = cycles(import_graph())
    new = [c for c in sorted(found) if not any(_known(c, entry) for entry in KNOWN)]
    assert not new, f"new import cycles: {new}"
    gone = [e for e in KNOWN if not any(_known(c, e) for c in found)]
    assert not gone, f"no such cycle any more, remove it from KNOWN: {gone}"


def folder(module: str) -> str:
    """The part of the layout a module belongs to: its folder under `llm_server/` (api,
    engines, scheduler, ...), a top-level module itself (cli, server, service, ...), or its
    top package (converters, replay)."""
    parts = module.split(".")
    if parts[0] != "llm_server" or len(parts) == 1:
        return parts[0]
    return parts[1]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the folders its modules import (itself left out)."""
    out: dict[str, set[str]] = {}
    for module, imported in graph.items():
        out.setdefault(folder(module), set()).update(
            folder(m) for m in imported if folder(m) != folder(module)
        )
    return out


def test_no_folder_imports_a_folder_that_imports_it_back():
    loops = cycles(folder_graph(import_graph()))
    assert not loops, f"folders importing each other: {sorted(loops)}"


def allowed_imports() -> dict[str, set[str] | None]:
    """docs/ARCHITECTURE.md's table "Folders and what each may import": folder -> the folders it
    may import (None: any)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- folder-imports: begin -->")[1].split("<!-- folder-imports: end -->")[0]
    rules: dict[str, set[str] | None] = {}
    for line in table.strip().splitlines()[2:]:
        names, _, may = (cell.strip() for cell in line.strip("|").split("|"))
        named = set(re.findall(r"`([\w.]+)`", may))
        if may.startswith("anything"):
            allowed = None if not named else {f for f in folder_graph(import_graph())} - named
        elif may.startswith("nothing"):
            allowed = set()
        else:
            allowed = named
        for name in re.findall(r"`([\w.]+)`", names):
            rules[name] = allowed
    return rules


def test_every_folder_imports_only_what_the_architecture_allows():
    rules = allowed_imports()
    graph = folder_graph(import_graph())
    unlisted = sorted(set(graph) - set(rules) - {"llm_server"})
    assert not unlisted, f"folders missing from docs/ARCHITECTURE.md's import table: {unlisted}"
    broken = {
        f: sorted(imported - rules[f])
        for f, imported in sorted(graph.items())
        if f in rules and rules[f] is not None and imported - rules[f]
    }
    assert not broken, f"imports the architecture does not allow: {broken}"


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == {("a", "b", "c")}
    assert cycles({"a": {"b"}, "b": set()}) == set()
    assert _known(("x.mlx_a", "x.mlx_b"), ("x.mlx_*",)) and not _known(
        ("x.mlx_a", "x.y"), ("x.mlx_*",)
    )


if __name__ == "__main__":
    for cycle in sorted(cycles(import_graph())):
        print(" <-> ".join(cycle))
    for loop in sorted(cycles(folder_graph(import_graph()))):
        print("folders:", " <-> ".join(loop))
