"""The import graph of the project's modules, read with ``ast`` (nothing is imported), and its cycles.

Run ``python tests/import_graph.py`` from the repository root to print every cycle with the import
statements that close it (file:line), or ``--edges`` for the whole graph. ``tests/test_import_graph.py``
holds the rules it checks.

What counts as an edge ``A -> B`` (A's source names B, B one of the project's modules):

* ``import B``, ``from B import x`` and ``from P import B`` (B a submodule of package P), relative forms
  resolved against A's package;
* every import is tagged with where it sits: ``top`` (runs when A is imported: module level, class
  bodies, ``try`` blocks), ``function`` (inside a function: runs on first call, and still a dependency —
  counted like ``top``), ``type_checking`` (under ``if TYPE_CHECKING:``; never runs, so it cannot close a
  cycle at run time; reported apart and left out of the cycles);
* an edge points at the module named, not at the packages around it (importing ``ultraep.policies.quota``
  also runs ``policies/__init__.py``; that edge is not drawn, so a cycle only through an ``__init__`` that
  imports its submodules is not reported).

Modules come from ``pyproject.toml``'s ``package-dir`` (the top-level folders install as one ``ultraep``
namespace), so new sub-packages are picked up without editing this file.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("top", "function", "type_checking")


@dataclass(frozen=True)
class Edge:
    """One import statement of ``src`` naming project module ``dst``."""

    src: str
    dst: str
    kind: str       # top | function | type_checking
    path: str       # file, relative to the repository root
    line: int

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}  ({self.kind}, {self.path}:{self.line})"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{package name: folder}`` from ``pyproject.toml``'s ``[tool.setuptools] package-dir``."""
    import tomllib

    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = cfg["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """``{module name: file}`` for every ``.py`` file of the installed packages (sub-folders with an
    ``__init__.py`` included; a package's ``__init__`` is named after the package)."""
    out: dict[str, Path] = {}
    for pkg, folder in package_dirs(root).items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            if not all((folder / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
                continue  # a folder that is not a package (e.g. Streamlit's pages/): scripts, not modules
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join((pkg,) + parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """``(node, kind)`` for every import statement of a module."""
    out = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "top":
                k = "function"
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, kind))
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type_checking")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
                continue
            visit(child, k)

    def visit_stmt(stmt: ast.AST, kind: str) -> None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            out.append((stmt, kind))
        else:
            visit(stmt, kind)

    visit(tree, "top")
    return out


def _targets(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return [n for n in names if n in modules]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{mod}.{alias.name}"
        if sub in modules:
            out.append(sub)
        elif mod in modules:
            out.append(mod)
    return list(dict.fromkeys(out))


def build_graph(root: Path = ROOT) -> list[Edge]:
    """Every import edge between the project's modules."""
    modules = project_modules(root)
    names = set(modules)
    edges = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, kind in _imports(tree):
            for dst in _targets(node, mod, is_package, names):
                if dst != mod:
                    edges.append(Edge(mod, dst, kind, str(path.relative_to(root)), node.lineno))
    return edges


def adjacency(edges: list[Edge], kinds=("top", "function")) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        if e.kind in kinds:
            graph[e.src].add(e.dst)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (each one sorted), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    nodes = sorted(set(graph) | {d for ds in graph.values() for d in ds})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _shortest_path(graph: dict[str, set[str]], src: str, dst: str, within: set[str]) -> list[str] | None:
    prev: dict[str, str | None] = {src: None}
    queue = deque([src])
    while queue:
        node = queue.popleft()
        if node == dst:
            path = [node]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt in within and nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    return None


def cycles(edges: list[Edge], kinds=("top", "function")) -> list[list[Edge]]:
    """One shortest cycle through every edge that lies on a cycle (duplicates dropped), each as the list
    of import statements that close it (the first one found per module pair)."""
    graph = adjacency(edges, kinds)
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if e.kind in kinds:
            first.setdefault((e.src, e.dst), e)
    out, seen = [], set()
    for comp in strongly_connected(graph):
        within = set(comp)
        for (a, b), _ in sorted(first.items()):
            if a not in within or b not in within:
                continue
            back = _shortest_path(graph, b, a, within)
            if back is None:
                continue
            nodes = [a] + back
            key = frozenset(zip(nodes, nodes[1:]))
            if key in seen:
                continue
            seen.add(key)
            out.append([first[(u, v)] for u, v in zip(nodes, nodes[1:])])
    return out


def upward(edges: list[Edge], order: tuple[str, ...], kinds=KINDS) -> list[Edge]:
    """The edges between modules of ``order`` that do not point down: a module imports only the modules listed
    before it (every kind of import counts, ``type_checking`` too unless ``kinds`` leaves it out). A package's
    ``__init__`` that re-exports its modules goes last: a module that imports its own package imports them all."""
    rank = {m: i for i, m in enumerate(order)}
    return [e for e in edges if e.kind in kinds and e.src in rank and e.dst in rank and rank[e.dst] >= rank[e.src]]


def format_cycle(cycle: list[Edge]) -> str:
    names = " -> ".join([cycle[0].src] + [e.dst for e in cycle])
    return names + "\n" + "\n".join(f"    {e}" for e in cycle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every edge too")
    parser.add_argument("--with-type-checking", action="store_true",
                        help="count imports under `if TYPE_CHECKING:` as edges too")
    args = parser.parse_args(argv)
    edges = build_graph()
    kinds = KINDS if args.with_type_checking else ("top", "function")
    if args.edges:
        for e in sorted(edges, key=lambda e: (e.src, e.dst, e.line)):
            print(e)
    counts = {k: sum(e.kind == k for e in edges) for k in KINDS}
    print(f"{len(project_modules())} modules, {len(edges)} import edges: " +
          ", ".join(f"{v} {k}" for k, v in counts.items()))
    comps = strongly_connected(adjacency(edges, kinds))
    found = cycles(edges, kinds)
    print(f"{len(comps)} groups of modules that import each other (kinds: {', '.join(kinds)}); "
          f"{len(found)} cycles through them")
    for comp in comps:
        print("group: " + ", ".join(comp))
    for cyc in found:
        print(format_cycle(cyc))
    return 1 if comps else 0


if __name__ == "__main__":
    sys.exit(main())
