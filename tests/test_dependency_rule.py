"""The map's import rule: the engine imports no backend; no backend imports the engine."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
