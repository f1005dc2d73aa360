"""The package's import graph has no circle: no two rlframe modules import each other, however indirectly.

Every import between rlframe's own modules is an edge, wherever it is written: at the top of a file, inside a
function (a lazy import only delays the circle to the first call), or under `if TYPE_CHECKING:` (an editor and a
reader follow it all the same). `from rlframe.a import b` is an edge to the module `rlframe.a.b` when `b` is a
submodule, else to `rlframe.a` itself; relative imports are resolved against the importing module's package.

A package's `__init__` is a module of its own (named by the package, `rlframe.workers.rollout`): what it imports
counts like any other module's imports, and `from rlframe.workers.rollout import X` is an edge to it. The implicit
running of parent `__init__`s when `rlframe.a.b` is imported is *not* an edge: counting it would make a circle of
every package whose `__init__` re-exports its submodules, a layout Python imports without trouble.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlframe"

# Circles still standing, each named by its exact set of modules: none. The test fails if a circle appears that is
# not listed here, or if a listed one grows, shrinks or splits (update or delete it then).
KNOWN_CIRCLES: list[frozenset[str]] = []


def module_name(path: Path) -> str:
    """`rlframe/workers/actor.py` → "rlframe.workers.actor"; `rlframe/workers/__init__.py` → "rlframe.workers"."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    """Every rlframe module by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, is_package: bool, source: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, rlframe module) for every import of an rlframe module in the module `name`, lazy ones included."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if not (origin == "rlframe" or origin.startswith("rlframe.")):
                continue
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                if submodule in modules:
                    found.append((node.lineno, submodule))
                elif origin in modules:
                    found.append((node.lineno, origin))
    return found


def import_graph() -> dict[str, dict[str, list[int]]]:
    """importer → {imported module: [lines]}, self-imports left out."""
    modules = all_modules()
    graph: dict[str, dict[str, list[int]]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, target in imported_modules(name, path.name == "__init__.py", path.read_text(), set(modules)):
            lines = edges.setdefault(target, []) if target != name else []
            if target != name and line not in lines:
                lines.append(line)
    return graph


def strongly_connected_components(graph: dict[str, dict[str, list[int]]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph is a few hundred modules, but recursion depth is not ours to spend)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def circles() -> list[frozenset[str]]:
    """Every set of two or more modules that import each other, however indirectly."""
    return [frozenset(c) for c in strongly_connected_components(import_graph()) if len(c) > 1]


def describe(circle: frozenset[str], graph: dict[str, dict[str, list[int]]]) -> str:
    """The circle's modules and each import line between two of them (file:line), the ones that close it."""
    modules = all_modules()
    lines = [f"circle of {len(circle)} modules: {', '.join(sorted(circle))}"]
    for importer in sorted(circle):
        for target, numbers in sorted(graph[importer].items()):
            if target in circle:
                where = ", ".join(f"{modules[importer].relative_to(ROOT)}:{n}" for n in numbers)
                lines.append(f"  {importer} -> {target}  ({where})")
    return "\n".join(lines)


def test_the_parser_reads_every_form_of_import():
    # the parser is the test's weak point: check it on each form it must read
    modules = {"rlframe", "rlframe.a", "rlframe.a.b", "rlframe.a.c", "rlframe.d"}
    source = """
import rlframe.a.b
from rlframe.a import c, not_a_module
from rlframe import d
import os

def later():
    from . import c
    from .b import something
    from .. import d
"""
    found = imported_modules("rlframe.a.x", False, source, modules)
    assert found == [
        (2, "rlframe.a.b"),
        (3, "rlframe.a.c"),
        (3, "rlframe.a"),
        (4, "rlframe.d"),
        (8, "rlframe.a.c"),
        (9, "rlframe.a.b"),
        (10, "rlframe.d"),
    ]
    # in a package's `__init__`, `.` is the package itself
    assert imported_modules("rlframe.a", True, "from .b import y", modules) == [(1, "rlframe.a.b")]


def test_the_graph_holds_lazy_and_reexporting_imports():
    graph = import_graph()
    assert "rlframe.workers.rollout.base" in graph["rlframe.workers.rollout"]  # an `__init__` re-exporting
    assert "rlframe.trainer.entry" in graph["rlframe"]  # a lazy import inside a function of `rlframe/__init__.py`
    sandbox = graph["rlframe.workers.rollout.sandbox"]
    assert "rlframe.workers.rollout.sandbox.isolation" in sandbox  # `from package import submodule`


def test_the_component_finder_on_a_small_graph():
    graph = {"a": {"b": [1]}, "b": {"c": [1]}, "c": {"a": [1]}, "d": {"a": [1]}, "e": {"e": [1]}}
    found = sorted(sorted(c) for c in strongly_connected_components(graph) if len(c) > 1)
    assert found == [["a", "b", "c"]]


def test_no_import_circle():
    graph = import_graph()
    found = circles()
    unexpected = [c for c in found if c not in KNOWN_CIRCLES]
    gone = [c for c in KNOWN_CIRCLES if c not in found]
    message = "\n\n".join(describe(c, graph) for c in unexpected)
    assert not unexpected, "rlframe's modules import each other in a circle; break it:\n\n" + message
    assert not gone, "a known circle changed or is gone; update KNOWN_CIRCLES:\n" + "\n".join(
        ", ".join(sorted(c)) for c in gone
    )
