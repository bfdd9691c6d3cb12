"""DeepSeek V4.1 (``deepseek_v41``): its composite config, derived layer roles, the engine config and ``inspect``.

The config is the release's (tests/helpers/published.py); the byte figures it
must reproduce are the release's own: one routed expert, one Engram row, the
Engram row counts, the parameter counts of the draft and the vision tower, and
the index's ``total_size``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.errors import ConfigError
from deepinfer.loader import read_config
from deepinfer.models.deepseek_v41.config import SHARED
from deepinfer.models.common.config import SLIDING
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.weight_memory import weight_memory

from tests.helpers.published import (
    V41_CHECKPOINT_BYTES,
    V41_DRAFT_PARAMS,
    V41_ENGRAM_NUM_EMBEDDINGS,
    V41_ENGRAM_ROW_BYTES,
    V41_FLASH,
    V41_ROUTED_EXPERT_BYTES,
    V41_VISION_PARAMS,
    v41_norm_elements,
)
from deepinfer.models.registry import load_config, parse_config


def _release(**text: object) -> dict:
    raw = copy.deepcopy(V41_FLASH)
    raw["text_config"].update(text)
    return raw


def _write(directory: Path, raw: dict, total_size: int | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    if total_size is not None:
        index = {"metadata": {"total_size": total_size}, "weight_map": {"embed.weight": "model-00001-of-00048.safetensors"}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_the_release_config_parses_with_its_fields():
    config = DeepseekV41Config.from_hf(V41_FLASH)
    t = config.text_config
    assert (t.num_hidden_layers, t.hidden_size, t.n_routed_experts, t.dspark_n_routed_experts) == (40, 5120, 384, 128)
    assert tuple(t.engram_num_embeddings) == V41_ENGRAM_NUM_EMBEDDINGS
    assert t.engram_pad_token_id == 2
    q = config.quantization
    assert (q.weight_block_size, q.scale_fmt, q.expert_dtype) == ((32, 32), "ue8m0", "fp4")
    assert config.vision_config.patch_size == 14 and config.image_token_id == 129264


def test_layer_roles_follow_the_sources():
    layers = DeepseekV41Config.from_hf(V41_FLASH).text_config.layers()
    modes = [layer.mode for layer in layers]
    assert modes[:2] == ["sliding", "sliding"]
    assert [i for i, m in enumerate(modes) if m == "full"] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m == "reindex"] == [24, 28, 32, 36]
    assert modes.count("reuse") == 30
    assert (layers[7].kv_source, layers[19].kv_source, layers[39].kv_source) == (2, 14, 20)
    assert (layers[23].index_source, layers[27].index_source, layers[39].index_source) == (20, 24, 36)
    assert layers[20].candidates == "source" and layers[24].candidates == "read" and layers[14].candidates is None
    assert [i for i, layer in enumerate(layers) if layer.engram_table is not None] == [1, 14]
    assert layers[14].engram_table == 1


def test_transformers_names_are_accepted_too():
    raw = _release()
    raw["text_config"]["engram_pad_id"] = raw["text_config"].pop("engram_pad_token_id")
    raw["text_config"]["candidate_source_layer_id"] = None  # transformers' default: the last KV source
    t = DeepseekV41Config.from_hf(raw).text_config
    assert t.engram_pad_token_id == 2 and t.candidate_source == 20


def test_compress_ratios_without_the_draft_entries_are_accepted():
    t = DeepseekV41Config.from_hf(_release(compress_ratios=[0, 0] + [2] * 18 + [1] * 20)).text_config
    assert len(t.layers()) == 40


@pytest.mark.parametrize(
    "text, named",
    [
        (dict(compress_ratios=[0, 0] + [2] * 18 + [1] * 19), "compress_ratios"),
        (dict(compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 2, 0]), "compress_ratios"),
        (dict(kv_source_layer_ids=[8, 14, 20]), "kv_source_layer_ids"),
        (dict(kv_source_layer_ids=[1, 2, 8, 14, 20]), "kv_source_layer_ids"),
        (dict(compress_ratios=[0, 0, 2, 2, 2, 4] + [2] * 14 + [1] * 20), "reads kv source layer 2"),
        (dict(index_source_layer_ids=[2, 8, 14, 20, 24, 40]), "index_source_layer_ids"),
        (dict(candidate_source_layer_id=22), "candidate_source_layer_id"),
        (dict(candidate_topk_blocks=0), "candidate_topk_blocks"),
        (dict(engram_num_embeddings=[384006168]), "engram_num_embeddings"),
        (dict(engram_layer_ids=[14, 1]), "engram_layer_ids"),
        (dict(num_key_value_heads=8), "num_key_value_heads"),
        (dict(dspark_num_experts_per_tok=200), "dspark_num_experts_per_tok"),
        (dict(hidden_size="wide"), "hidden_size"),
    ],
)
def test_a_bad_field_is_named_in_one_line(text, named):
    with pytest.raises(ConfigError) as info:
        DeepseekV41Config.from_hf(_release(**text))
    message = str(info.value)
    assert named in message and "\n" not in message and message.startswith("invalid DeepSeek-V4.1 config.json")


def test_a_bad_quantization_config_is_named():
    raw = _release()
    raw["quantization_config"]["expert_dtype"] = "int4"
    with pytest.raises(ConfigError, match="expert_dtype"):
        DeepseekV41Config.from_hf(raw)


def test_the_engine_config_carries_the_roles_after_the_config_validates(tmp_path):
    directory = _write(tmp_path / "v41", V41_FLASH)
    assert read_config(directory)["model_type"] == "deepseek_v41"
    config = parse_config(V41_FLASH)
    assert config.layer_types == [SLIDING] * 2 + [SHARED] * 38
    assert [config.layer_ratio(i) for i in (0, 2, 19, 20, 39)] == [0, 2, 2, 1, 1] and config.ratios == [1, 2]
    assert config.quantization.weight_block_size == (32, 32) and config.quantization.expert_dtype == "fp4"
    assert config.text.kv_source_layer_ids == [2, 8, 14, 20] and config.mlp_layer_types == ["moe"] * 40
    # a broken V4.1 config is named when it is read
    broken = _write(tmp_path / "broken", _release(kv_source_layer_ids=[8, 14, 20]))
    with pytest.raises(ConfigError, match="kv_source_layer_ids"):
        load_config(broken)


def test_a_kv_source_must_run_the_indexer():
    with pytest.raises(ConfigError, match=r"kv_source_layer_ids holds \[14\], which index_source_layer_ids .* lacks"):
        DeepseekV41Config.from_hf(_release(index_source_layer_ids=[2, 8, 20, 24, 28, 32, 36]))


def test_published_byte_figures_reproduce(tmp_path):
    mem = weight_memory(_write(tmp_path / "v41", V41_FLASH))
    assert mem.bytes_per_routed_expert == V41_ROUTED_EXPERT_BYTES
    assert mem.parts["engram"].total_bytes == sum(V41_ENGRAM_NUM_EMBEDDINGS) * V41_ENGRAM_ROW_BYTES
    assert mem.parts["backbone"].routed_expert_bytes == 40 * 384 * V41_ROUTED_EXPERT_BYTES
    assert mem.parts["draft"].routed_expert_bytes == 3 * 128 * V41_ROUTED_EXPERT_BYTES
    # every stored tensor is counted, to the byte, once the norms the engine holds in fp32 (two more bytes each
    # than stored) are taken back: the text's and the vision tower's (two per block and the final one)
    vision_norms = (2 * 32 + 1) * 1024
    assert mem.parts["vision"].total_bytes == 2 * V41_VISION_PARAMS + 2 * vision_norms
    upcast = 2 * sum(v41_norm_elements()) + 2 * vision_norms
    assert mem.total_bytes - upcast == V41_CHECKPOINT_BYTES


def test_dequantized_draft_is_its_parameters_in_bf16_and_f32(tmp_path):
    mem = weight_memory(_write(tmp_path / "v41", V41_FLASH), quantization="dequantize")
    # the draft's F32 tensors (three stages' hyper-connections, sinks, router biases; its norms and
    # confidence head) stay four bytes each
    f32 = 3 * (2 * (24 * 4 * 5120 + 24 + 3) + 64 + 2 * 128) + v41_norm_elements()[1]
    assert mem.parts["draft"].total_bytes == 2 * (V41_DRAFT_PARAMS - f32) + 4 * f32


@pytest.mark.parametrize("ep", [1, 8, 64])
def test_per_rank_split_of_the_experts(tmp_path, ep):
    mem = weight_memory(_write(tmp_path / "v41", V41_FLASH), ep=ep)
    backbone, engram, draft = (mem.parts[p] for p in ("backbone", "engram", "draft"))
    # each of the 40 layers (3 draft stages) keeps its share of 384 (128) experts on the fullest rank
    assert backbone.per_rank_bytes == backbone.total_bytes - backbone.routed_expert_bytes + 40 * -(-384 // ep) * V41_ROUTED_EXPERT_BYTES
    assert draft.per_rank_bytes == draft.total_bytes - draft.routed_expert_bytes + 3 * -(-128 // ep) * V41_ROUTED_EXPERT_BYTES
    assert engram.per_rank_bytes == engram.total_bytes


def _inspect(directory: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "inspect", "--model", str(directory), *extra],
        capture_output=True, text=True, timeout=120,
    )


def test_inspect_reports_the_three_parts(tmp_path):
    directory = _write(tmp_path / "v41", V41_FLASH, total_size=V41_CHECKPOINT_BYTES)
    mem = weight_memory(directory, ep=8)
    proc = _inspect(directory, "--ep", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for part in ("backbone", "engram", "draft", "vision"):
        assert report["parts"][part]["total_bytes"] == mem.parts[part].total_bytes
        assert report["parts"][part]["per_rank_bytes"] == mem.parts[part].per_rank_bytes
    assert report["parts"]["engram"]["total_bytes"] == 202_758_032_400
    assert report["checkpoint_bytes"] == V41_CHECKPOINT_BYTES and report["ep"] == 8
    text = _inspect(directory, "--ep", "8")
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line for line in text.stdout.splitlines() if line.startswith("  ")}
    # the backbone as held: its norms in fp32, a megabyte over the stored 298.62 GB
    assert "202.76 GB" in lines["engram"] and "298.63 GB" in lines["backbone"] and "7.93 GB" in lines["draft"]
    assert "970.67 MB" in lines["vision"]  # 485.27 M parameters in bf16, its 65 norms in fp32


def test_inspect_names_a_bad_v41_field_in_one_line(tmp_path):
    proc = _inspect(_write(tmp_path / "v41", _release(engram_num_embeddings=[1])))
    assert proc.returncode == 2
    assert "engram_num_embeddings" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
