"""What torch_npu really offers, read from its wheel: op schemas and the ``torch_npu.npu`` Python API.

**Op schemas** come from the strings torch_npu registers with ``m.def(...)`` in
``TORCH_LIBRARY(npu, m)``: its codegen (``torchnpugen/custom_functions.py``,
``RegisterCustomSchema``) compiles every ``custom`` entry of
``npu_native_functions_by_codegen.yaml`` into a literal schema in
``torch_npu/lib/libtorch_npu.so``, with ``self`` renamed ``input``. Those
literals are what ``torch.ops.npu`` binds calls against, and torch_npu exports
every ``torch.ops.npu.<op>`` as ``torch_npu.<op>`` (``_init/core/_exports.py``).
They are scanned out of the library (NUL-terminated ``name(args) -> returns``)
and parsed with ``torch._C.parse_schema``, torch's own schema parser; the yaml
serves as a cross-check of the scan.

**The ``torch_npu.npu`` namespace** (``get_soc_version``, ``get_device_name``,
streams, graphs) is plain Python: its names are resolved through
``torch_npu/npu/__init__.py``'s imports and re-exports, and each ``def``'s
parameters read with ``ast``.
"""

from __future__ import annotations

import ast
import re
import warnings
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

SCHEMA_LIBRARY = "torch_npu/lib/libtorch_npu.so"
CODEGEN_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"

#: a registered schema: ``\0name[.overload](args) -> returns\0``; args may hold alias sets such as ``Tensor(a!)``
_SCHEMA = re.compile(rb"\x00([A-Za-z_]\w*(?:\.\w+)?)\(((?:[^()\x00]|\([a-z!|*]+\))*)\) -> ([^\x00]+)(?=\x00)")
_CHUNK = 16 << 20


@dataclass(frozen=True)
class Param:
    """One parameter: its name, type, default (source text; None when required) and whether it is keyword-only."""

    name: str
    type: str
    default: str | None
    keyword_only: bool
    positional_only: bool = False


@dataclass(frozen=True)
class Signature:
    """How something callable binds its arguments; ``text`` is the schema or the ``def`` it came from."""

    target: str
    params: tuple[Param, ...]
    text: str
    var_positional: bool = False
    var_keyword: bool = False

    @property
    def positional(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if not p.keyword_only)

    @property
    def keyword_only(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.keyword_only)

    def problems(self, positional: int, keywords: tuple[str, ...]) -> list[str]:
        """Why a call with ``positional`` positional arguments and these keywords cannot bind (empty: it can)."""
        out = []
        pos = self.positional
        if positional > len(pos) and not self.var_positional:
            out.append(f"takes at most {len(pos)} positional arguments, {positional} given")
        by_name = {p.name: p for p in self.params}
        filled = {p.name for p in pos[:positional]}
        for kw in keywords:
            p = by_name.get(kw)
            if p is None or p.positional_only:
                if not self.var_keyword:
                    out.append(f"unknown keyword argument '{kw}'")
            elif kw in filled:
                out.append(f"argument '{kw}' given both by position and by keyword")
            filled.add(kw)
        for p in self.params:
            if p.default is None and p.name not in filled:
                out.append(f"missing required argument '{p.name}'")
        return out


@dataclass
class NpuApi:
    """torch_npu's callable surface as one wheel declares it."""

    version: str
    #: op name -> its overloads (``npu_grouped_matmul`` and ``npu_grouped_matmul.List``)
    ops: dict[str, list[Signature]]
    #: ``torch_npu.npu`` names -> the def's signature (None: a class or value, existence only)
    npu: dict[str, Signature | None]
    #: schema strings found that torch could not parse (custom-class ops of other namespaces)
    unparsed: list[str] = field(default_factory=list)


def _param(arg) -> Param:
    default = repr(arg.default_value) if arg.has_default_value() else None
    return Param(arg.name, str(arg.type), default, bool(arg.kwarg_only))


def parse_schema(text: str) -> Signature:
    """One ``name(args) -> returns`` schema through torch's own parser."""
    schema = torch._C.parse_schema(text)
    target = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    return Signature(target, tuple(_param(a) for a in schema.arguments), text)


def scan_schemas(data_chunks: Iterable[bytes]) -> list[str]:
    """Every schema-shaped NUL-terminated string in a binary given as an iterable of byte chunks.

    Each buffer is cut after its last NUL, so a string split across chunks is scanned whole in the next.
    """
    found: list[str] = []
    tail = b""
    for chunk in data_chunks:
        buf = tail + chunk
        cut = buf.rfind(b"\x00")
        if cut < 0:
            tail = buf
            continue
        found.extend(m.group(0)[1:].decode("utf-8", "replace") for m in _SCHEMA.finditer(buf, 0, cut + 1))
        tail = buf[cut:]
    return found


def registered_ops(wheel: Path) -> tuple[dict[str, list[Signature]], list[str]]:
    """Op name -> overload signatures from the schema literals in ``libtorch_npu.so``, and the unparsable ones."""
    with zipfile.ZipFile(wheel) as zf, zf.open(SCHEMA_LIBRARY) as lib:
        texts = scan_schemas(iter(lambda: lib.read(_CHUNK), b""))
    ops: dict[str, list[Signature]] = {}
    unparsed = []
    for text in texts:
        try:
            sig = parse_schema(text)
        except RuntimeError:
            unparsed.append(text)
            continue
        overloads = ops.setdefault(sig.target.split(".")[0], [])
        if all(o.text != sig.text for o in overloads):
            overloads.append(sig)
    for overloads in ops.values():
        overloads.sort(key=lambda s: "." in s.target)  # the default overload first
    return ops, unparsed


def codegen_schemas(wheel: Path) -> dict[str, str]:
    """``custom`` entries of the codegen yaml as registered: name -> schema with ``self`` renamed ``input``
    (what ``RegisterCustomSchema`` does); multi-output ``.out`` overloads, which it rewrites further, are left out."""
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(CODEGEN_YAML).decode()
    out: dict[str, str] = {}
    section = None
    for line in text.splitlines():
        top = re.match(r"^(\w+):", line)
        if top:
            section = top.group(1)
            continue
        m = re.match(r"^\s*(?:- )?func: (.+)$", line)
        if m and section in ("custom", "custom_autograd"):
            schema = re.sub(r"\bself\b(?=[,\)])", "input", m.group(1).strip())
            name = schema.split("(", 1)[0]
            if not name.endswith(".out"):
                out[name] = schema
    return out


def wheel_requires_torch(wheel: Path) -> str | None:
    """The ``Requires-Dist: torch==...`` line of the wheel's METADATA (the torch it was built for)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        for line in zf.read(meta).decode().splitlines():
            if re.match(r"^Requires-Dist:\s*torch\b", line) and not line.split(":", 1)[1].strip().startswith("torch-"):
                return line.split(":", 1)[1].strip()
    return None


# ---- the torch_npu.npu Python namespace ------------------------------------------------


def _def_signature(target: str, node: ast.FunctionDef, where: str) -> Signature:
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    params = [Param(p.arg, ast.unparse(p.annotation) if p.annotation else "", d, False, i < len(a.posonlyargs))
              for i, (p, d) in enumerate(zip(positional, defaults))]
    params += [Param(p.arg, ast.unparse(p.annotation) if p.annotation else "", None if d is None else ast.unparse(d), True)
               for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    text = f"def {node.name}({ast.unparse(a)})  # {where}:{node.lineno}"
    return Signature(target, tuple(params), text, a.vararg is not None, a.kwarg is not None)


class _PythonNamespace:
    """Resolves the names a torch_npu Python module defines or re-exports, reading only its own .py members."""

    def __init__(self, zf: zipfile.ZipFile) -> None:
        self.zf = zf
        self.files = set(zf.namelist())
        self.memo: dict[str, dict[str, Signature | None]] = {}

    def _parse(self, path: str) -> ast.Module:
        """A member's syntax tree; torch_npu's own invalid escapes (a DeprecationWarning) are not ours to report."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            return ast.parse(self.zf.read(path).decode(), filename=path)

    def _file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for cand in (f"{base}.py", f"{base}/__init__.py"):
            if cand in self.files:
                return cand
        return None

    @staticmethod
    def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
        if level == 0:
            return target or ""
        parts = module.split(".")
        base = parts if is_package else parts[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([target] if target else []))

    def names(self, module: str) -> dict[str, Signature | None]:
        if module in self.memo:
            return self.memo[module]
        self.memo[module] = {}  # an import cycle sees what is known so far
        path = self._file(module)
        if path is None:
            return self.memo[module]
        is_package = path.endswith("__init__.py")
        tree = self._parse(path)
        out: dict[str, Signature | None] = {}
        for node in self._top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = _def_signature(f"{module}.{node.name}", node, path)
            elif isinstance(node, ast.ClassDef):
                out[node.name] = None
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            out.setdefault(name.id, None)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    out[(alias.asname or alias.name).split(".")[0]] = None
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(module, is_package, node.level, node.module)
                for alias in node.names:
                    if alias.name == "*":
                        out.update(self._public(source))
                        continue
                    sub = f"{source}.{alias.name}"
                    found = self.names(source).get(alias.name) if self._file(sub) is None else None
                    out[alias.asname or alias.name] = found
        self.memo[module] = out
        return out

    def _public(self, module: str) -> dict[str, Signature | None]:
        names = self.names(module)
        path = self._file(module)
        declared = None
        if path is not None:
            for node in self._parse(path).body:
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                    try:
                        declared = list(ast.literal_eval(node.value))
                    except ValueError:
                        declared = None
        keep = declared if declared is not None else [n for n in names if not n.startswith("_")]
        return {n: names.get(n) for n in keep}

    @staticmethod
    def _top_level(body: list[ast.stmt]):
        """Statements at module level, including those inside top-level ``if``/``try`` blocks."""
        for node in body:
            if isinstance(node, ast.If):
                yield from _PythonNamespace._top_level(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from _PythonNamespace._top_level(node.body + node.orelse + node.finalbody)
            else:
                yield node


def npu_namespace(wheel: Path) -> dict[str, Signature | None]:
    """The names ``torch_npu.npu`` offers, with each def's signature."""
    with zipfile.ZipFile(wheel) as zf:
        return dict(_PythonNamespace(zf).names("torch_npu.npu"))


def load_api(wheel: Path, version: str) -> NpuApi:
    ops, unparsed = registered_ops(wheel)
    return NpuApi(version, ops, npu_namespace(wheel), unparsed)
