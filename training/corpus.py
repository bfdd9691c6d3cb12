"""The training corpus: docstrings of Python's standard library, read from its sources with ``ast``.

Every machine with Python has this text, so the corpus needs no download. Sources
are parsed, never imported. Each documented function or class becomes a short
record shaped like code (its signature, then its docstring), each module docstring
a record of its own. Records are deduplicated and split into train / held-out by a
hash of their text, so the split does not depend on file order or on Python's hash seed.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

#: top-level stdlib folders left out: vendored packages, the test suite, the IDE
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    heldout: list[str]


def stdlib_dir() -> Path:
    """The directory holding this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{prefix} {node.name}({ast.unparse(node.args)}):"


def _quoted(doc: str) -> str:
    body = doc.replace('"""', "'''")
    return '    """' + body.replace("\n", "\n    ") + '"""'


def records_of_source(text: str) -> list[str]:
    """The records of one module's source: module docstring, then each documented def/class."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(doc)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            head = _signature(node) if not isinstance(node, ast.ClassDef) else f"class {node.name}:"
            out.append(f"{head}\n{_quoted(doc)}")
    return out


def source_files(root: Path) -> list[Path]:
    """The stdlib's ``.py`` files in a fixed order, skipping ``SKIPPED_DIRS``."""
    files = []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        files.append(path)
    return files


def _bucket(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "little") % 1000


def build_corpus(root: Path | None = None, heldout_per_mille: int = 50, max_files: int | None = None) -> Corpus:
    """Deduplicated records of the stdlib under ``root``; ``heldout_per_mille`` of them held out by text hash."""
    root = stdlib_dir() if root is None else Path(root)
    seen: set[str] = set()
    train: list[str] = []
    heldout: list[str] = []
    for path in source_files(root)[:max_files]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for rec in records_of_source(text):
            rec = rec.strip()
            if len(rec) < 16 or rec in seen:
                continue
            seen.add(rec)
            (heldout if _bucket(rec) < heldout_per_mille else train).append(rec)
    if not train or not heldout:
        raise RuntimeError(f"the corpus from {root} is too small ({len(train)} train / {len(heldout)} held-out records)")
    return Corpus(train, heldout)
