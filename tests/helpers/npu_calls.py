"""Every torch_npu call a package makes, found statically, and checked against the wheel's schemas.

The backend rarely writes ``torch_npu.npu_x(...)``: the module comes from
``load_torch_npu()`` (a tuple), is handed to lambdas through ``_fused``, and
arrives in ``npu_ops`` as a parameter ``tn``. So the extractor is a small
flow-insensitive analysis over the package's ``ast``: abstract values (torch_npu,
its ``npu`` namespace, an op, a function or lambda of the package, an instance,
a tuple, a dict of known keys, a string) flow through assignments, tuple
unpacking, ``getattr``, returns, call arguments into parameters (positional and
keyword, bound methods, lambdas passed as arguments) and instance attributes,
until nothing changes. Then every call whose callee is a torch_npu member is
recorded with its file:line, positional count and keyword names.

A call ``<x>.npu_*(...)`` whose receiver the analysis cannot trace to torch_npu is
recorded as unresolved rather than skipped, so a refactor that hides the module
from the analysis fails the check instead of emptying it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from .npu_schemas import NpuApi, Signature

# ---- records -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceFile:
    """One module of the package analysed: its dotted name, the path shown in messages, its text."""

    module: str
    path: str
    text: str
    is_package: bool = False


@dataclass(frozen=True)
class NpuCall:
    """One use of torch_npu: ``call`` (arity checked), ``attr`` (existence only) or ``unresolved``.

    ``target`` is ``npu_rms_norm`` (an op; ``npu_grouped_matmul.List`` for an
    explicit overload) or ``npu.get_soc_version`` (the ``torch_npu.npu`` namespace).
    ``positional``/``keywords`` are None where ``*args``/``**kwargs`` hide them.
    """

    path: str
    line: int
    target: str
    kind: str
    positional: int | None = 0
    keywords: tuple[str, ...] | None = ()

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Problem:
    """A call that does not fit torch_npu, as one line naming file:line, op and argument."""

    call: NpuCall
    message: str

    def __str__(self) -> str:
        return f"{self.call.where}: torch_npu.{self.call.target}: {self.message}"


# ---- abstract values ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Root:
    """torch_npu itself (``ops_only``: ``torch.ops.npu``, which has no ``npu`` namespace)."""

    ops_only: bool = False


@dataclass(frozen=True)
class _Ns:
    """``torch_npu.npu``."""


@dataclass(frozen=True)
class _Member:
    """``torch_npu.<name>`` (ns ``""``) or ``torch_npu.npu.<name>`` (ns ``"npu"``)."""

    ns: str
    name: str

    @property
    def target(self) -> str:
        return f"{self.ns}.{self.name}" if self.ns else self.name


@dataclass(frozen=True)
class _Ext:
    """A name from outside the package (``torch``, ``importlib.import_module``, a builtin)."""

    dotted: str


@dataclass(frozen=True)
class _Mod:
    name: str


@dataclass(frozen=True)
class _Func:
    key: str


@dataclass(frozen=True)
class _Bound:
    key: str


@dataclass(frozen=True)
class _Inst:
    cls: str


@dataclass(frozen=True)
class _Cls:
    cls: str


@dataclass(frozen=True)
class _Tup:
    items: tuple[frozenset, ...]


@dataclass(frozen=True)
class _Dict:
    keys: frozenset[str]


@dataclass(frozen=True)
class _Str:
    value: str


_EMPTY: frozenset = frozenset()


def _ext(dotted: str) -> frozenset:
    """An outside name, with the spellings of torch_npu mapped to its atoms."""
    if dotted == "torch_npu":
        return frozenset({_Root()})
    if dotted in ("torch_npu.npu", "torch.npu"):
        return frozenset({_Ns()})
    if dotted == "torch.ops.npu":
        return frozenset({_Root(ops_only=True)})
    for prefix, ns in (("torch_npu.npu.", "npu"), ("torch.npu.", "npu"), ("torch_npu.", ""), ("torch.ops.npu.", "")):
        if dotted.startswith(prefix):
            return frozenset({_Member(ns, dotted[len(prefix):])})
    return frozenset({_Ext(dotted)})


# ---- scopes ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Scope:
    key: str
    kind: str  # module, function, class
    node: ast.AST
    source: SourceFile
    parent: "_Scope | None"
    cls: str | None = None  # the class a method belongs to
    params: list[str] = field(default_factory=list)  # positional parameters, bound self excluded
    bound_self: bool = False
    vars: dict[str, set] = field(default_factory=dict)
    returns: set = field(default_factory=set)
    own: list[ast.AST] = field(default_factory=list)


@dataclass(eq=False)
class _Class:
    key: str
    scope: _Scope
    methods: dict[str, str] = field(default_factory=dict)
    bases: list[ast.expr] = field(default_factory=list)
    attrs: dict[str, set] = field(default_factory=dict)


class _Analysis:
    def __init__(self, files: list[SourceFile]) -> None:
        self.files = files
        self.modules: dict[str, _Scope] = {}
        self.scopes: list[_Scope] = []
        self.funcs: dict[str, _Scope] = {}
        self.classes: dict[str, _Class] = {}
        self.lambdas: dict[int, str] = {}
        self.parents: dict[int, ast.AST] = {}
        self.changed = False
        for f in files:
            tree = ast.parse(f.text, filename=f.path)
            for node in ast.walk(tree):
                for child in ast.iter_child_nodes(node):
                    self.parents[id(child)] = node
            scope = _Scope(f.module, "module", tree, f, None)
            self.modules[f.module] = scope
            self._index(scope, tree.body)

    # -- indexing ----------------------------------------------------------------------

    def _new_scope(self, node: ast.AST, parent: _Scope, kind: str, cls: str | None = None) -> _Scope:
        name = getattr(node, "name", "<lambda>")
        scope = _Scope(f"{parent.key}.{name}@{node.lineno}:{node.col_offset}", kind, node, parent.source, parent, cls)
        if kind == "function":
            a = node.args
            positional = [p.arg for p in (*a.posonlyargs, *a.args)]
            decorators = {ast.unparse(d) for d in getattr(node, "decorator_list", [])}
            if cls is not None and "staticmethod" not in decorators and positional:
                first = positional.pop(0)
                atom = _Cls(cls) if "classmethod" in decorators else _Inst(cls)
                scope.vars[first] = {atom}
                scope.bound_self = True
            scope.params = positional
            for p in (*positional, *(k.arg for k in a.kwonlyargs)):
                scope.vars.setdefault(p, set())
            for extra in (a.vararg, a.kwarg):
                if extra is not None:
                    scope.vars[extra.arg] = set()
            self.funcs[scope.key] = scope
        self.scopes.append(scope)
        return scope

    def _index(self, scope: _Scope, body: list) -> None:
        """Collect ``scope``'s own nodes; nested defs, lambdas and classes get scopes of their own."""
        if scope not in self.scopes:
            self.scopes.append(scope)
        stack = list(reversed(body)) if isinstance(body, list) else [body]
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = scope.key if scope.kind == "class" else None
                lexical = scope.parent if scope.kind == "class" else scope
                child = self._new_scope(node, scope, "function", cls=owner)
                child.parent = lexical
                if owner is not None:
                    self.classes[owner].methods[node.name] = child.key
                else:
                    scope.vars.setdefault(node.name, set()).add(_Func(child.key))
                self._index(child, node.body)
                stack.extend(reversed([*node.decorator_list, *node.args.defaults, *[d for d in node.args.kw_defaults if d]]))
                continue
            if isinstance(node, ast.Lambda):
                child = self._new_scope(node, scope if scope.kind != "class" else scope.parent, "function")
                self.lambdas[id(node)] = child.key
                self._index(child, [ast.Return(value=node.body, lineno=node.lineno, col_offset=node.col_offset)])
                scope.own.append(node)
                continue
            if isinstance(node, ast.ClassDef):
                child = self._new_scope(node, scope, "class")
                self.classes[child.key] = _Class(child.key, child, bases=list(node.bases))
                scope.vars.setdefault(node.name, set()).add(_Cls(child.key))
                self._index(child, node.body)
                stack.extend(reversed(node.bases))
                continue
            scope.own.append(node)
            stack.extend(reversed(list(ast.iter_child_nodes(node))))

    # -- lookup ------------------------------------------------------------------------

    def _lookup(self, scope: _Scope, name: str) -> frozenset:
        s: _Scope | None = scope
        while s is not None:
            if name in s.vars:
                return frozenset(s.vars[name])
            s = s.parent
            while s is not None and s.kind == "class":
                s = s.parent
        return _ext(name)

    def _mro(self, cls: str) -> list[_Class]:
        out, todo = [], [cls]
        while todo:
            c = self.classes.get(todo.pop(0))
            if c is None or c in out:
                continue
            out.append(c)
            for base in c.bases:
                todo.extend(a.cls for a in self.eval(base, c.scope.parent) if isinstance(a, _Cls))
        return out

    def _attr(self, atom, name: str) -> frozenset:
        if isinstance(atom, _Root):
            return frozenset({_Ns()}) if name == "npu" and not atom.ops_only else frozenset({_Member("", name)})
        if isinstance(atom, _Ns):
            return frozenset({_Member("npu", name)})
        if isinstance(atom, _Member) and not atom.ns and "." not in atom.name:
            return frozenset({_Member("", f"{atom.name}.{name}")})
        if isinstance(atom, _Ext):
            return _ext(f"{atom.dotted}.{name}")
        if isinstance(atom, _Mod):
            sub = f"{atom.name}.{name}"
            if sub in self.modules:
                return frozenset({_Mod(sub)})
            mod = self.modules.get(atom.name)
            return frozenset(mod.vars.get(name, ())) if mod else _EMPTY
        if isinstance(atom, (_Inst, _Cls)):
            out: set = set()
            for c in self._mro(atom.cls):
                if name in c.methods:
                    out.add(_Bound(c.methods[name]) if isinstance(atom, _Inst) else _Func(c.methods[name]))
                out |= c.scope.vars.get(name, set())
                if isinstance(atom, _Inst):
                    out |= c.attrs.get(name, set())
            return frozenset(out)
        return _EMPTY

    # -- evaluation ----------------------------------------------------------------------

    def eval(self, node: ast.AST | None, scope: _Scope) -> frozenset:
        if node is None:
            return _EMPTY
        if isinstance(node, ast.Name):
            return self._lookup(scope, node.id)
        if isinstance(node, ast.Constant):
            return frozenset({_Str(node.value)}) if isinstance(node.value, str) else _EMPTY
        if isinstance(node, ast.Attribute):
            return frozenset().union(*(self._attr(a, node.attr) for a in self.eval(node.value, scope)))
        if isinstance(node, ast.Call):
            return self._call(node, scope)
        if isinstance(node, ast.Subscript):
            index = node.slice.value if isinstance(node.slice, ast.Constant) else None
            if not isinstance(index, int):
                return _EMPTY
            return frozenset().union(*(a.items[index] for a in self.eval(node.value, scope)
                                       if isinstance(a, _Tup) and -len(a.items) <= index < len(a.items)))
        if isinstance(node, ast.IfExp):
            return self.eval(node.body, scope) | self.eval(node.orelse, scope)
        if isinstance(node, ast.BoolOp):
            return frozenset().union(*(self.eval(v, scope) for v in node.values))
        if isinstance(node, (ast.Tuple, ast.List)):
            if any(isinstance(e, ast.Starred) for e in node.elts):
                return _EMPTY
            return frozenset({_Tup(tuple(self.eval(e, scope) for e in node.elts))})
        if isinstance(node, ast.Dict):
            if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
                return frozenset({_Dict(frozenset(k.value for k in node.keys))})
            return _EMPTY
        if isinstance(node, ast.Lambda):
            key = self.lambdas.get(id(node))
            return frozenset({_Func(key)}) if key else _EMPTY
        if isinstance(node, ast.NamedExpr):
            value = self.eval(node.value, scope)
            self._bind(node.target, value, scope)
            return value
        return _EMPTY

    def _call(self, node: ast.Call, scope: _Scope) -> frozenset:
        callee = self.eval(node.func, scope)
        args = [self.eval(a, scope) for a in node.args if not isinstance(a, ast.Starred)]
        out: set = set()
        for atom in callee:
            if isinstance(atom, (_Func, _Bound)):
                target = self.funcs[atom.key]
                self._bind_args(target, node, args, scope)
                out |= target.returns
            elif isinstance(atom, _Cls):
                out.add(_Inst(atom.cls))
                for init in self._attr(_Inst(atom.cls), "__init__"):
                    if isinstance(init, _Bound):
                        self._bind_args(self.funcs[init.key], node, args, scope)
            elif isinstance(atom, _Ext):
                out |= self._builtin(atom.dotted, node, args)
        return frozenset(out)

    def _builtin(self, name: str, node: ast.Call, args: list[frozenset]) -> frozenset:
        if name == "importlib.import_module" and args:
            return frozenset().union(*(_ext(a.value) for a in args[0] if isinstance(a, _Str)))
        if name == "getattr" and len(args) >= 2:
            got = frozenset().union(*(self._attr(o, n.value) for o in args[0] for n in args[1] if isinstance(n, _Str)))
            return got | (args[2] if len(args) > 2 else _EMPTY)
        if name == "type" and args:
            return frozenset(_Cls(a.cls) for a in args[0] if isinstance(a, _Inst))
        if name == "dict" and not node.args and all(k.arg for k in node.keywords):
            return frozenset({_Dict(frozenset(k.arg for k in node.keywords))})
        return _EMPTY

    def _bind_args(self, target: _Scope, node: ast.Call, args: list[frozenset], scope: _Scope) -> None:
        if any(isinstance(a, ast.Starred) for a in node.args):
            return
        for name, value in zip(target.params, args):
            self._add(target.vars.setdefault(name, set()), value)
        for kw in node.keywords:
            if kw.arg is not None and kw.arg in target.vars:
                self._add(target.vars[kw.arg], self.eval(kw.value, scope))

    def _add(self, into: set, value) -> None:
        before = len(into)
        into |= value
        if len(into) != before:
            self.changed = True

    def _bind(self, target: ast.AST, value: frozenset, scope: _Scope) -> None:
        if isinstance(target, ast.Name):
            if target.id not in scope.vars:
                scope.vars[target.id] = set()
                self.changed = True
            self._add(scope.vars[target.id], value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if any(isinstance(e, ast.Starred) for e in target.elts):
                return
            for i, element in enumerate(target.elts):
                items = frozenset().union(*(a.items[i] for a in value if isinstance(a, _Tup) and len(a.items) == len(target.elts)))
                self._bind(element, items, scope)
        elif isinstance(target, ast.Attribute):
            for atom in self.eval(target.value, scope):
                if isinstance(atom, _Inst) and atom.cls in self.classes:
                    self._add(self.classes[atom.cls].attrs.setdefault(target.attr, set()), value)

    def _elements(self, value: frozenset) -> frozenset:
        return frozenset().union(*(frozenset().union(*a.items) for a in value if isinstance(a, _Tup)))

    def _step(self, scope: _Scope) -> None:
        for node in scope.own:
            if isinstance(node, ast.Assign):
                value = self.eval(node.value, scope)
                for t in node.targets:
                    self._bind(t, value, scope)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._bind(node.target, self.eval(node.value, scope), scope)
            elif isinstance(node, (ast.For, ast.comprehension)):
                self._bind(node.target, self._elements(self.eval(node.iter, scope)), scope)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self._bind(ast.Name(alias.asname), self._module(alias.name), scope)
                    else:
                        top = alias.name.split(".")[0]
                        self._bind(ast.Name(top), self._module(top), scope)
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(scope.source, node.level, node.module)
                for alias in node.names:
                    if alias.name != "*":
                        self._bind(ast.Name(alias.asname or alias.name), self._attr_of_module(base, alias.name), scope)
            elif isinstance(node, ast.Return):
                self._add(scope.returns, self.eval(node.value, scope))
            elif isinstance(node, ast.Call):
                self._call(node, scope)

    def _module(self, dotted: str) -> frozenset:
        """A module of the package (or a package folder above some), else an outside name."""
        if dotted in self.modules or any(m.startswith(dotted + ".") for m in self.modules):
            return frozenset({_Mod(dotted)})
        return _ext(dotted)

    def _attr_of_module(self, module: str, name: str) -> frozenset:
        return frozenset().union(*(self._attr(a, name) for a in self._module(module)))

    @staticmethod
    def _absolute(source: SourceFile, level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        parts = source.module.split(".")
        base = parts if source.is_package else parts[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def run(self, limit: int = 100) -> None:
        for _ in range(limit):
            self.changed = False
            for scope in self.scopes:
                self._step(scope)
            if not self.changed:
                return
        raise RuntimeError("the torch_npu call analysis did not settle")

    # -- collection ----------------------------------------------------------------------

    def _positional(self, node: ast.Call, scope: _Scope) -> int | None:
        count = 0
        for a in node.args:
            if isinstance(a, ast.Starred):
                lengths = {len(t.items) for t in self.eval(a.value, scope) if isinstance(t, _Tup)}
                if len(lengths) != 1:
                    return None
                count += lengths.pop()
            else:
                count += 1
        return count

    def _keywords(self, node: ast.Call, scope: _Scope) -> tuple[str, ...] | None:
        names: list[str] = []
        for kw in node.keywords:
            if kw.arg is not None:
                names.append(kw.arg)
                continue
            dicts = {d.keys for d in self.eval(kw.value, scope) if isinstance(d, _Dict)}
            if len(dicts) != 1:
                return None
            names.extend(sorted(dicts.pop()))
        return tuple(names)

    def calls(self) -> list[NpuCall]:
        found: dict[tuple, NpuCall] = {}

        def record(node: ast.AST, call: NpuCall) -> None:
            found.setdefault((call.path, node.lineno, node.col_offset, call.target, call.kind), call)

        for scope in self.scopes:
            path = scope.source.path
            for node in scope.own:
                if isinstance(node, ast.Call):
                    callee = self.eval(node.func, scope)
                    members = [a for a in callee if isinstance(a, _Member)]
                    for m in members:
                        record(node, NpuCall(path, node.lineno, m.target, "call",
                                             self._positional(node, scope), self._keywords(node, scope)))
                    if any(isinstance(a, _Ext) and a.dotted in ("hasattr", "getattr") for a in callee) and len(node.args) >= 2:
                        objs, names = self.eval(node.args[0], scope), self.eval(node.args[1], scope)
                        for o in objs:
                            for n in names:
                                if isinstance(n, _Str):
                                    for m in self._attr(o, n.value):
                                        if isinstance(m, _Member):
                                            record(node, NpuCall(path, node.lineno, m.target, "attr"))
                    if not members and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("npu_"):
                        record(node, NpuCall(path, node.lineno, node.func.attr, "unresolved"))
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    parent = self.parents.get(id(node))
                    if (isinstance(parent, ast.Call) and parent.func is node) or isinstance(parent, ast.Attribute):
                        continue
                    for m in self.eval(node, scope):
                        if isinstance(m, _Member):
                            record(node, NpuCall(path, node.lineno, m.target, "attr"))
        return sorted(found.values(), key=lambda c: (c.path, c.line, c.target))


def extract_calls(files: list[SourceFile]) -> list[NpuCall]:
    """Every torch_npu call and attribute use in ``files`` (one package), aliases followed."""
    analysis = _Analysis(files)
    analysis.run()
    return analysis.calls()


def package_sources(package_dir: Path, package: str, root: Path) -> list[SourceFile]:
    """The .py files of one package folder as ``SourceFile`` records (paths relative to ``root``)."""
    out = []
    for path in sorted(package_dir.glob("*.py")):
        is_package = path.name == "__init__.py"
        module = package if is_package else f"{package}.{path.stem}"
        out.append(SourceFile(module, str(path.relative_to(root)), path.read_text(), is_package))
    return out


# ---- checking ----------------------------------------------------------------------------


def _fit(call: NpuCall, overloads: list[Signature]) -> list[str]:
    """Problems of the overload that fits best (empty when one fits), each ending in the schema it read."""
    results = [(sig, sig.problems(call.positional, call.keywords)) for sig in overloads]
    if any(not probs for _, probs in results):
        return []
    sig, probs = min(results, key=lambda r: len(r[1]))
    return [f"{p} (schema: {sig.text})" for p in probs]


def check_calls(calls: list[NpuCall], api: NpuApi) -> list[Problem]:
    """What does not fit ``api``: a missing op or name, too many positionals, an unknown keyword, a missing argument.

    Root attributes other than ops (dtype symbols such as ``float8_e8m0fnu``, read through a guarded
    ``getattr``) are not in the schemas and are not checked.
    """
    problems: list[Problem] = []
    for call in calls:
        if call.kind == "unresolved":
            problems.append(Problem(call, "the receiver of this npu_* call could not be traced to torch_npu, so it "
                                          "cannot be checked (pass the module as the others do)"))
            continue
        ns, _, name = call.target.rpartition(".") if call.target.startswith("npu.") else ("", "", call.target)
        if ns == "npu":
            if name not in api.npu:
                problems.append(Problem(call, f"torch_npu {api.version} has no torch_npu.npu.{name}"))
                continue
            sig = api.npu[name]
            overloads = [sig] if sig is not None else []
        else:
            base, _, overload = name.partition(".")
            overloads = api.ops.get(base, [])
            if not overloads:
                if call.kind == "call" or base.startswith("npu_"):
                    problems.append(Problem(call, f"no op '{base}' is registered in torch_npu {api.version}"))
                continue
            if overload:
                wanted = base if overload == "default" else f"{base}.{overload}"
                overloads = [s for s in overloads if s.target == wanted]
                if not overloads:
                    problems.append(Problem(call, f"'{base}' has no overload '{overload}' in torch_npu {api.version}"))
                    continue
        if call.kind != "call" or not overloads:
            continue
        if call.positional is None or call.keywords is None:
            problems.append(Problem(call, "*args/**kwargs of unknown contents: the arguments cannot be checked"))
            continue
        problems.extend(Problem(call, p) for p in _fit(call, overloads))
    return problems
