"""The KV cache's bytes per token: what the planner budgets is what the pools allocate, for every
``kv_cache_dtype``; ``deepinfer inspect`` reports the same geometry's figures at the releases' configs; the
engine's start-up line names how rows are stored and what a token costs."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer import LLM
from deepinfer.cli import main as cli_main
from deepinfer.engine import BUNDLED_MODEL
from deepinfer.kv_memory import default_step_tokens, kv_memory
from deepinfer.model_runner import plan_cache
from deepinfer.models.common.cache import ModelCache
from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for
from deepinfer.models.registry import parse_config
from tests.helpers.published import V4_FLASH, V41_FLASH
from tests.helpers.tiny_v41 import QUANTIZATION, TEXT, _engram_fields

KV_CACHE_DTYPES = ("model", "fp8", "auto")


def _tiny(family: str, quantized: bool) -> dict:
    """The bundled V4 model's config, or the tiny V4.1 checkpoint's; with a release's quantization_config when
    ``quantized`` (``auto`` then resolves to the packed records)."""
    if family == "v4":
        raw = json.loads((BUNDLED_MODEL / "config.json").read_text())
    else:
        text = {**TEXT, **_engram_fields(TEXT, BUNDLED_MODEL)}
        raw = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text}
    if quantized:
        raw["quantization_config"] = V4_FLASH["quantization_config"] if family == "v4" else QUANTIZATION
    return raw


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("quantized", [False, True], ids=["unquantized", "quantized"])
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_planned_bytes_are_the_bytes_the_pools_allocate(family, quantized, kv_cache_dtype):
    config = parse_config(_tiny(family, quantized))
    dtype, max_len = torch.float32, 256
    geometry = CacheGeometry.build(config, block_size_for(config, 16), 40, max_len, kv_cache_dtype)
    packed = kv_cache_dtype == "fp8" or (kv_cache_dtype == "auto" and quantized)
    assert geometry.formats.packed == packed and geometry.formats.name == ("fp8" if packed else "model")
    plan = plan_cache(geometry, 3 << 20, 3, max_len, dtype, kv_cache_dtype=kv_cache_dtype)

    def cache(slots: int, blocks: int) -> ModelCache:
        return ModelCache(geometry, slots, blocks, geometry.blocks_for(max_len), dtype, "cpu")

    held = cache(plan.num_slots, plan.num_blocks)
    pools = held.pools()
    assert plan.budget == held.pool_bytes() == sum(t.numel() * t.element_size() for t in pools)
    assert any(t.dtype == torch.uint8 for t in pools) == packed
    base = held.pool_bytes()
    assert cache(plan.num_slots + 1, plan.num_blocks).pool_bytes() - base == plan.bytes_per_slot == geometry.bytes_per_slot(dtype)
    assert cache(plan.num_slots, plan.num_blocks + 1).pool_bytes() - base == plan.bytes_per_block == geometry.bytes_per_block(dtype)
    line = plan.describe()
    assert f"kv_cache_dtype {kv_cache_dtype}: {geometry.formats.describe()}" in line
    assert f"{geometry.bytes_per_token(dtype):,.1f} B of compressed state per token" in line
    if packed:
        assert geometry.bytes_per_token(dtype) < CacheGeometry.build(config, geometry.block_size, 40, max_len).bytes_per_token(dtype) / 2


def test_the_engines_start_up_line_names_the_cache_format():
    plan = LLM(backend="cpu", kv_cache_dtype="fp8", speculative_method=None).engine.runner.plan
    line = plan.describe()
    # the bundled model's 32-channel rows: 16 FP8 codes, 16 bf16 rotary channels and one scale, padded to 52 bytes
    assert ("kv_cache_dtype fp8: fp8: window v4.kv.fp8 (52 B, ue8m0 scales), entries v4.kv.fp8 (52 B, ue8m0 scales), "
            "indexer keys v4.index.fp4 (12 B, ue8m0 scales), indexer rotated") in line
    # two CSA layers (ratio 4) keep a 52-byte entry and a 12-byte key, one HCA layer (ratio 16) a 52-byte entry
    assert plan.bytes_per_token == 2 * (52 + 12) / 4 + 52 / 16 and "35.2 B of compressed state per token" in line


def _inspect(tmp_path, config: dict, *args: str, capsys) -> tuple[int, str, str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = cli_main(["inspect", "--model", str(tmp_path), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_gives_v4_flash_kv_bytes_per_token(tmp_path, capsys):
    """V4-Flash (2 sliding layers, 21 CSA of ratio 4 with indexer keys, 20 HCA of ratio 128): 584-byte FP8
    entries and 68-byte FP4 keys at fp8 and auto (the release is quantized), 1,024 and 256 bf16 bytes at model."""
    figures = {}
    for kv in KV_CACHE_DTYPES:
        code, out, err = _inspect(tmp_path, V4_FLASH, "--json", "--kv-cache-dtype", kv, capsys=capsys)
        assert code == 0, err
        figures[kv] = json.loads(out.strip().splitlines()[-1])["kv_bytes_per_token"]
    for kv, (entry, key) in {"fp8": (584, 68), "auto": (584, 68), "model": (1024, 256)}.items():
        got = figures[kv]
        assert got["by_kind"] == {"sliding_attention": 0.0, "compressed_sparse_attention": 21 * (entry + key) / 4,
                                  "heavily_compressed_attention": 20 * entry / 128}
        assert got["total"] == 21 * (entry + key) / 4 + 20 * entry / 128 and got["block_size"] == 128
        window = got["window"]
        assert window["bytes_per_row_by_kind"] == {"sliding_attention": 2 * entry, "compressed_sparse_attention": 21 * entry,
                                                   "heavily_compressed_attention": 20 * entry}
        assert window["bytes_per_row"] == 43 * entry and window["rows_per_slot"] == 127 + default_step_tokens()
        assert window["bytes_per_slot"] == 43 * entry * window["rows_per_slot"]
    assert figures["fp8"]["total"] == figures["auto"]["total"] == 3514.25 <= 3600
    assert figures["model"]["total"] == 6880 and figures["auto"]["formats"] == "fp8" and figures["model"]["formats"] == "model"

    code, out, _ = _inspect(tmp_path, V4_FLASH, capsys=capsys)
    assert code == 0
    assert ("KV cache (--kv-cache-dtype auto -> fp8: window v4.kv.fp8 (584 B, ue8m0 scales), entries v4.kv.fp8 (584 B, ue8m0 scales), "
            "indexer keys v4.index.fp4 (68 B, ue8m0 scales)") in out
    assert "compressed state per token of context: 3,514.25 B" in out and "25,112 B per token row over all layers" in out


def test_inspect_gives_v41_flash_kv_bytes_per_token(tmp_path, capsys):
    """V4.1-Flash keeps compressed state in its four KV sources only (three of ratio 2, one of ratio 1): 288-byte
    FP4 entries and 68-byte FP4 keys at fp8, under 900 bytes a token without the window rows (528-byte FP8)."""
    code, out, err = _inspect(tmp_path, V41_FLASH, "--json", capsys=capsys)
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])["kv_bytes_per_token"]
    assert got["total"] == 3 * (288 + 68) / 2 + (288 + 68) == 890 <= 900
    assert got["window"]["bytes_per_row"] == 40 * 528
    model = kv_memory(parse_config(dict(V41_FLASH)), "model")
    assert model.total == 3 * (1024 + 256) / 2 + (1024 + 256) == 3200 and model.window.bytes_per_row == 40 * 1024


def test_inspect_refuses_fp8_for_rows_the_records_do_not_fit(tmp_path, capsys):
    code, _, err = _inspect(tmp_path, {**V4_FLASH, "index_head_dim": 96}, "--kv-cache-dtype", "fp8", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "kv_cache_dtype 'fp8' cannot be honoured: index_head_dim 96 is not a power of two" in err and "use kv_cache_dtype 'model'" in err
