"""The model registry: a checkpoint's ``model_type`` (or ``architectures``) picks its family, whose small
contract (config, model and draft, prompt rules, chat encoder) is all the engine asks of it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from deepinfer.engine import BUNDLED_MODEL
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.models.common.causal_lm import CausalLM
from deepinfer.models.common.config import ModelConfig
from deepinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from deepinfer.models.deepseek_v41 import DeepseekV41Model, V41ModelConfig
from deepinfer.models.registry import FAMILIES, chat_encoder, check_prompt, family_of, image_reader, load_config, load_model, parse_config
from deepinfer.loader import read_config
from deepinfer_interfaces import Kernels
from tests.helpers.published import V4_FLASH, V41_FLASH

ROOT = Path(__file__).resolve().parents[2]


def test_model_type_picks_the_family():
    assert type(parse_config(dict(V4_FLASH))) is DeepseekV4Config
    assert type(parse_config(V41_FLASH)) is V41ModelConfig
    assert family_of(V41_FLASH).model_class is DeepseekV41Model


def test_architectures_pick_the_family_when_model_type_is_missing():
    raw = {k: v for k, v in V4_FLASH.items() if k != "model_type"}
    assert family_of(raw).model_class is DeepseekV4Model
    assert parse_config(raw).model_type == "deepseek_v4"
    assert family_of({"architectures": ["LlamaForCausalLM"]}) is None


def test_an_unknown_model_type_is_one_line_naming_what_runs(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_config({"model_type": "llama", "hidden_size": 8})
    assert str(info.value) == ("config.json has model_type 'llama', which this engine does not run; "
                               "use a checkpoint with model_type 'deepseek_v4' or 'deepseek_v41'")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="unknown model_type 'llama': deepinfer runs deepseek_v4 and deepseek_v41"):
        load_config(tmp_path)


def test_every_family_keeps_the_contract():
    types = [t for f in FAMILIES for t in f.model_types]
    archs = [a for f in FAMILIES for a in f.architectures]
    assert len(types) == len(set(types)) and len(archs) == len(set(archs))
    for family in FAMILIES:
        assert issubclass(family.config_class, ModelConfig) and family.config_class is not ModelConfig
        assert issubclass(family.model_class, CausalLM) and family.model_class.config_class is family.config_class
        assert family.model_class.draft_class is not None
        assert family.config_class.model_fields["model_type"].default in family.model_types


def test_load_model_builds_the_checkpoints_family():
    model = load_model(BUNDLED_MODEL, Kernels(), dtype=torch.float32)
    assert type(model) is DeepseekV4Model and model.config == load_config(BUNDLED_MODEL)
    assert type(model.config) is DeepseekV4Config and model.config == parse_config(read_config(BUNDLED_MODEL))
    with pytest.raises(TypeError, match="load_model"):
        CausalLM.from_pretrained(BUNDLED_MODEL, Kernels())


def test_prompt_rules_image_readers_and_chat_encoders_are_the_familys():
    image = {"prompt": "x", "multi_modal_data": {"image": b"..."}}
    check_prompt("deepseek_v4", "text")
    with pytest.raises(ConfigError, match="DeepSeek-V4 is a text-only model"):
        check_prompt("deepseek_v4", image)
    check_prompt("deepseek_v41", image)  # V4.1 refuses nothing up front: its image reader decides
    assert image_reader(read_config(BUNDLED_MODEL)) is None
    assert chat_encoder("deepseek_v4") == "deepseek_v4" and chat_encoder("deepseek_v41") is None and chat_encoder("llama") is None


def family_branches(root: Path) -> list[str]:
    """Where code under ``root/deepinfer`` outside the family packages and the registry names the second
    family (``v41``) or compares a ``model_type`` with a string (docstrings may describe families)."""
    skip = ("deepinfer/models/deepseek_v4/", "deepinfer/models/deepseek_v41/", "deepinfer/models/registry.py")
    found = []
    for path in sorted((root / "deepinfer").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(skip):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(ast.unparse(x).endswith("model_type") for x in sides) and any(
                        isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            text = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else (
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings else "")
            if "v41" in text.lower():
                found.append(f"{rel}:{node.lineno}: {text[:60]!r}")
    return found


def test_no_shared_file_branches_on_a_family():
    assert family_branches(ROOT) == []


def test_the_branch_finder_sees_a_branch(tmp_path):
    (tmp_path / "deepinfer" / "models" / "deepseek_v41").mkdir(parents=True)
    (tmp_path / "deepinfer" / "x.py").write_text('def f(c):\n    return c.model_type == "deepseek_v4"\n')
    (tmp_path / "deepinfer" / "y.py").write_text('def g(c):\n    """About V4.1 (v41)."""\n    return c.v41\n')
    (tmp_path / "deepinfer" / "models" / "deepseek_v41" / "z.py").write_text("v41 = 1\n")
    assert family_branches(tmp_path) == ["deepinfer/x.py:2: c.model_type == 'deepseek_v4'", "deepinfer/y.py:3: 'v41'"]
