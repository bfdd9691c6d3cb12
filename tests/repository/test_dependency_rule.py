"""The map's import rules: the engine imports no backend and no backend the engine; no import cycles; model
families reached only through the registry, never from each other, the loader or shared model code."""

import ast
from pathlib import Path

import pytest

from tests.helpers.import_graph import ImportGraph, build_graph

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"deepinfer_cpu", "deepinfer_cuda", "deepinfer_ascend"}


def _imports(folder: Path):
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, node.module.split(".")[0]


def test_engine_imports_no_backend():
    bad = [(str(p.relative_to(ROOT)), m) for p, m in _imports(ROOT / "deepinfer") if m in BACKENDS]
    assert not bad


def test_backends_do_not_import_engine_or_conformance():
    for name in ("cpu", "cuda", "ascend"):
        bad = [(str(p.relative_to(ROOT)), m) for p, m in _imports(ROOT / "backends" / name) if m in {"deepinfer", "deepinfer_conformance"}]
        assert not bad


def test_interfaces_import_nothing_of_ours_but_themselves():
    ours = BACKENDS | {"deepinfer", "deepinfer_conformance"}
    bad = [(str(p.relative_to(ROOT)), m) for p, m in _imports(ROOT / "interfaces") if m in ours]
    assert not bad


def test_the_rule_checker_sees_imports():
    mods = {m for _, m in _imports(ROOT / "backends" / "cpu")}
    assert "deepinfer_interfaces" in mods


# ------------------------------------------------------------- the module graph

FAMILIES = ("deepinfer.models.deepseek_v4", "deepinfer.models.deepseek_v41")


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph()


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_cycles(graph):
    cycles = graph.cycles()
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n")
    (pkg / "d.py").write_text("from .c import z\n")
    graph = build_graph({"pkg": pkg})
    assert graph.cycles() == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]  # a type-only import closes a cycle too


def test_model_families_do_not_import_each_other(graph):
    bad = [(m, t) for m in graph.files for fam in FAMILIES if _under(m, fam)
           for t in graph.imports(m) for other in FAMILIES if other != fam and _under(t, other)]
    assert not bad


def test_shared_model_code_names_no_family(graph):
    bad = [(m, t) for m in graph.files if _under(m, "deepinfer.models.common")
           for t in graph.imports(m) if any(_under(t, fam) for fam in FAMILIES) or t == "deepinfer.models.registry"]
    assert not bad


def test_the_loader_imports_no_model_code(graph):
    bad = [(m, t) for m in graph.files if _under(m, "deepinfer.loader") for t in graph.imports(m) if _under(t, "deepinfer.models")]
    assert not bad


def test_only_the_registry_reaches_a_family_from_the_engine(graph):
    bad = [(m, t) for m in graph.files if _under(m, "deepinfer") and not _under(m, "deepinfer.models")
           for t in graph.imports(m) if any(_under(t, fam) for fam in FAMILIES)]
    assert not bad, "engine modules reach a model family directly; go through deepinfer.models.registry"
