"""Both engines provide every member of ``EngineClient``: each method with the protocol's parameter names and
kinds, each property as a property or an attribute their ``__init__`` sets. Checked on the classes, without
building an engine."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from deepinfer.engine import Engine
from deepinfer.engine_client import EngineClient
from deepinfer.ranks.front import ExpertParallelEngine


def _protocol_members(protocol: type) -> dict[str, object]:
    """The protocol's own methods and properties, by name."""
    return {
        name: value for name, value in vars(protocol).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


def _init_attributes(cls: type) -> set[str]:
    """The ``self.<name>`` attributes ``cls.__init__`` assigns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def _shape(fn: object) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def mismatches(cls: type, protocol: type = EngineClient) -> list[str]:
    """What ``cls`` lacks of ``protocol``, or provides with another signature, one line each."""
    attributes = _init_attributes(cls)
    out = []
    for name, member in _protocol_members(protocol).items():
        mine = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            if not isinstance(mine, property) and name not in attributes:
                out.append(f"{cls.__name__} has no property or attribute {name!r}")
        elif not inspect.isfunction(mine):
            out.append(f"{cls.__name__} has no method {name!r}")
        elif _shape(mine) != _shape(member):
            out.append(f"{cls.__name__}.{name}{inspect.signature(mine)} differs from EngineClient.{name}{inspect.signature(member)}")
    return out


def test_the_protocol_names_what_callers_use():
    members = _protocol_members(EngineClient)
    assert {"add_request", "step", "output", "abort", "release", "get_metrics", "stats_line", "close"} <= set(members)
    assert {"tokenizer", "requests", "model_config", "max_model_len", "has_unfinished"} <= set(members)


@pytest.mark.parametrize("cls", [Engine, ExpertParallelEngine], ids=lambda c: c.__name__)
def test_every_engine_provides_every_member_with_its_signature(cls):
    assert mismatches(cls) == []


def test_both_engines_share_each_method_signature():
    for name, member in _protocol_members(EngineClient).items():
        if inspect.isfunction(member):
            assert _shape(getattr(Engine, name)) == _shape(getattr(ExpertParallelEngine, name)), name


def test_a_missing_or_different_member_is_reported():
    class Partial:
        def __init__(self) -> None:
            self.tokenizer = None

        def step(self, budget):  # an extra parameter
            return []

    problems = mismatches(Partial)
    assert "Partial has no method 'add_request'" in problems
    assert "Partial has no property or attribute 'requests'" in problems
    assert any(p.startswith("Partial.step(self, budget)") for p in problems)
    assert not any("'tokenizer'" in p for p in problems)
