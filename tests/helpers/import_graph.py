"""The project's module import graph, read from the source (no imports run), and its cycles.

Every ``import`` and ``from ... import`` counts, at any depth: lazy imports in
functions and those under ``if TYPE_CHECKING:`` too (a type-only cycle is still
a layering knot).
``from pkg import name`` points at ``pkg.name`` when that is a module, else at
``pkg`` itself.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: import name -> the folder holding that package
PACKAGES = {
    "deepinfer": ROOT / "deepinfer",
    "deepinfer_interfaces": ROOT / "interfaces" / "deepinfer_interfaces",
    "deepinfer_cpu": ROOT / "backends" / "cpu" / "deepinfer_cpu",
    "deepinfer_cuda": ROOT / "backends" / "cuda" / "deepinfer_cuda",
    "deepinfer_ascend": ROOT / "backends" / "ascend" / "deepinfer_ascend",
    "deepinfer_conformance": ROOT / "conformance" / "deepinfer_conformance",
}


@dataclass
class ImportGraph:
    """Modules (dotted names) and the modules each one imports, ours only."""

    files: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, set[str]] = field(default_factory=dict)

    def imports(self, module: str) -> set[str]:
        return self.edges.get(module, set())

    def cycles(self) -> list[list[str]]:
        """Each strongly connected group of two or more modules, sorted."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        counter = 0

        def visit(root: str) -> None:
            nonlocal counter
            work = [(root, iter(sorted(self.imports(root))))]
            index[root] = low[root] = counter
            counter += 1
            stack.append(root)
            on_stack.add(root)
            while work:
                node, children = work[-1]
                child = next(children, None)
                if child is not None:
                    if child not in index:
                        index[child] = low[child] = counter
                        counter += 1
                        stack.append(child)
                        on_stack.add(child)
                        work.append((child, iter(sorted(self.imports(child)))))
                    elif child in on_stack:
                        low[node] = min(low[node], index[child])
                    continue
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))

        for module in sorted(self.edges):
            if module not in index:
                visit(module)
        return sorted(found)


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = [package, *path.relative_to(folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def build_graph(packages: dict[str, Path] = PACKAGES) -> ImportGraph:
    """The import graph of ``packages`` (import name -> folder)."""
    graph = ImportGraph()
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            graph.files[_module_name(package, folder, path)] = path
    known = set(graph.files)
    for module, path in graph.files.items():
        is_package = path.name == "__init__.py"
        here = module if is_package else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
                targets.update(subs)
                if len(subs) < len(node.names):
                    targets.add(source)
        graph.edges[module] = {t for t in targets if t in known and t != module}
    return graph
