"""``deepinfer inspect``'s figures are the bytes the loaded model and draft hold, for every family."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import BUNDLED_MODEL
from deepinfer.loader import read_config
from deepinfer.models.common.dspark import DSparkDraft
from deepinfer.models.registry import load_model
from deepinfer.weight_memory import weight_memory
from deepinfer_interfaces import Kernels
from tests.helpers.tiny_v41 import write_tiny_v41


def _bytes(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bundled_model_and_draft_hold_what_inspect_counts(dtype):
    model = load_model(BUNDLED_MODEL, Kernels(), dtype=dtype)
    draft = DSparkDraft.from_target(model, read_config(BUNDLED_MODEL))
    mem = weight_memory(BUNDLED_MODEL, dtype=dtype)
    assert set(mem.parts) == {"backbone", "draft"}
    assert mem.parts["backbone"].total_bytes == _bytes(model.named_parameters())
    assert mem.parts["draft"].total_bytes == _bytes(draft.named_parameters())
    assert mem.total_bytes == mem.parts["backbone"].total_bytes + mem.parts["draft"].total_bytes


def test_a_v41_model_holds_what_inspect_counts(tmp_path):
    ckpt = write_tiny_v41(tmp_path / "v41")
    model = load_model(ckpt, Kernels(), dtype=torch.float32)
    mem = weight_memory(ckpt, dtype=torch.float32)
    held = model.named_parameters()
    # the loaded model maps its Engram tables from the files; inspect counts them as their own part
    tables = sum(e.table.codes.numel() * e.table.codes.element_size()
                 + (e.table.scales.numel() * e.table.scales.element_size() if e.table.scales is not None else 0)
                 for e in model.engram_layers)
    assert tables > 0 and mem.parts["engram"].total_bytes == tables
    assert mem.parts["backbone"].total_bytes == _bytes(held)
    assert mem.bytes_per_routed_expert * model.config.n_routed_experts * model.config.num_hidden_layers == mem.parts["backbone"].routed_expert_bytes
