"""``kv_cache_dtype``: what each value resolves to per family and checkpoint, the records each cache kind
gets, and the one-line errors for values and shapes a model cannot honour."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer import LLM
from deepinfer.engine import BUNDLED_MODEL
from deepinfer.errors import ConfigError
from deepinfer.models.common.cache import ContiguousCache
from deepinfer.models.common.cache_spec import CacheGeometry
from deepinfer.models.registry import parse_config
from deepinfer_interfaces import PackedPool
from tests.helpers.tiny_v41 import QUANTIZATION, TEXT

V4_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}


def _v4(**fields):
    raw = json.loads((BUNDLED_MODEL / "config.json").read_text())
    return parse_config({**raw, **fields})


def _v41(quantized: bool = True, **text):
    raw = {"model_type": "deepseek_v41", "text_config": {**TEXT, "engram_layer_ids": [], **text}}
    if quantized:
        raw["quantization_config"] = QUANTIZATION
    return parse_config(raw)


def test_auto_is_the_model_dtype_for_an_unquantized_checkpoint_and_the_trained_records_for_a_release():
    assert not _v4().kv_cache_formats("auto").packed
    trained = _v4(quantization_config=V4_QUANT).kv_cache_formats("auto")
    assert trained.packed and trained.window == trained.entry and trained.index_rotate
    assert trained.window.code == "e4m3" and trained.window.scale == "ue8m0" and trained.window.rope == 16
    assert trained.index.code == "e2m1" and trained.state_dtype == torch.float32
    # V4-Flash-Base keeps float scales: its records follow them
    base = _v4(quantization_config={**V4_QUANT, "scale_fmt": "float32"}).kv_cache_formats("auto")
    assert base.window.scale == "fp32" and base.index.scale == "ue8m0"
    # fp8 asks for the serving records whatever the checkpoint holds
    assert _v4().kv_cache_formats("fp8").window.scale == "ue8m0"
    assert not _v4(quantization_config=V4_QUANT).kv_cache_formats("model").packed


def test_v41_records_differ_by_kind():
    f = _v41().kv_cache_formats("auto")
    assert (f.window.code, f.window.scale, f.window.rope) == ("e4m3", "ue8m0", 0)
    assert (f.entry.code, f.entry.scale) == ("e2m1", "e4m3")
    assert (f.index.code, f.index.scale) == ("e2m1", "ue8m0") and not f.index_rotate
    assert not _v41(quantized=False).kv_cache_formats("auto").packed


def test_a_v41_source_pool_holds_fp4_entries_then_fp8_window_rows_under_one_numbering():
    config = _v41()
    cache = ContiguousCache(config, 2, 64, dtype=torch.float32, kv_cache_dtype="auto")
    g = cache.geometry
    source = next(i for i, kind in enumerate(g.layer_types) if kind.endswith(".source"))
    pool = cache.kv_pool(source)
    assert isinstance(pool, PackedPool)
    assert [r.format.code for r in pool.regions] == ["e2m1", "e4m3"]
    assert pool.region_of(cache.window_base[source]).format == g.formats.window
    assert pool.region_of(cache.entry_base[source]).format == g.formats.entry


def test_fp8_on_widths_the_records_cannot_split_is_one_line_naming_the_field():
    config = _v4(head_dim=112)  # 56 non-rotary channels: neither whole blocks of 64 nor one block
    assert config.head_dim - config.qk_rope_head_dim == 56
    with pytest.raises(ConfigError) as err:
        config.kv_cache_formats("fp8")
    message = str(err.value)
    assert "kv_cache_dtype 'fp8'" in message and "56 channels does not split into blocks of 64" in message and "'model'" in message and "\n" not in message
    # auto never refuses: a release whose widths do not fit keeps the model dtype
    assert not _v4(head_dim=112, quantization_config=V4_QUANT).kv_cache_formats("auto").packed


def test_unknown_values_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="kv_cache_dtype") as err:
        LLM(kv_cache_dtype="int4")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'int4' is not one of auto, fp8, model"):
        _v4().kv_cache_formats("int4")


@pytest.mark.parametrize("kv_cache_dtype", ["model", "fp8"])
def test_pools_hold_what_the_geometry_counts(kv_cache_dtype):
    for config in (_v4(), _v41()):
        cache = ContiguousCache(config, 3, 96, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype)
        g = cache.geometry
        assert cache.pool_bytes() == g.pool_bytes(cache.num_slots, cache.num_blocks, torch.bfloat16)


def test_packed_records_shrink_the_per_token_bytes_of_both_families():
    for config in (_v4(), _v41()):
        plain = CacheGeometry.build(config, 64, 64, 4096, "model")
        packed = CacheGeometry.build(config, 64, 64, 4096, "fp8")
        assert packed.bytes_per_token(torch.bfloat16) < 0.75 * plain.bytes_per_token(torch.bfloat16)
        assert packed.window_bytes_per_slot(torch.bfloat16) < plain.window_bytes_per_slot(torch.bfloat16)
