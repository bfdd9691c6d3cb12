"""The EP cost model (benchmarks/ep_plan.py): its decode step grows with the batch, overlap stays within its
parts, the KV-bound batch grows with the EP degree, chosen batches are the largest that meet the step bound,
and --json ends with one object holding every system's plan. The disaggregated deployment: prefill groups
narrower than decode groups, the cache a request moves sized as the engine sizes it, balanced pools that feed
decode, the seed's 64 + 64 against colocated for every model and system, and V4.1's shapes as the engine has
them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import load_script
from deepinfer.models.registry import parse_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ep():
    return load_script("ep_plan")


def test_the_model_counts_v4_flash_layers_and_weights(ep):
    assert ep.LAYER_KINDS == {(0, True): 2, (4, True): 1, (4, False): 20, (128, False): 20}
    assert ep.REPLICATED_BYTES == 8845959388.0
    assert ep.FP8_KV_ENTRY_BYTES == 584 and ep.FP4_INDEX_KEY_BYTES == 68


def test_decode_step_time_grows_with_the_batch(ep):
    fmt = ep.KV_FORMATS["fp8"]
    for hw in ep.HARDWARE.values():
        for n in ep.DEGREES:
            for mb in (1, 2):
                times = [ep.decode_step(hw, n, b, 32768, mb, fmt, load_cv=0.2, fp4_math=False).step_s for b in range(2, 4000, 97)]
                assert times == sorted(times)


def test_overlap_is_within_its_parts_and_never_slower_than_serial(ep):
    rng = random.Random(0)
    for _ in range(5000):
        p = ep.DecodeParts(*[rng.expovariate(1) for _ in range(6)])
        q = ep.DecodeParts(*[rng.expovariate(1) for _ in range(6)])
        t = ep.overlapped_layer_s(p, q)
        assert t >= max(p.compute_s + q.compute_s, p.comm_s + q.comm_s) - 1e-12
        assert t <= ep.serial_layer_s(p) + ep.serial_layer_s(q) + 1e-12


def test_chosen_decode_batches_fit_and_are_the_largest_meeting_the_bound(ep):
    fmt = ep.KV_FORMATS["fp8"]
    for hw in ep.HARDWARE.values():
        rows = ep.decode_table(hw, 131072, fmt, load_cv=0.2, fp4_math=False)
        kv_max = [r.batch_kv_max for r in rows]
        assert kv_max == sorted(kv_max)  # fewer experts per device leave more HBM for KV
        for r in rows:
            assert r.batch <= r.batch_kv_max
            if r.feasible:
                assert r.step_ms <= ep.DECODE_STEP_SLO_S * 1e3 + 1e-9
            if r.feasible and r.bound == "slo":
                assert ep.best_decode_step(hw, r.ep, r.batch + 1, 131072, fmt, load_cv=0.2, fp4_math=False).step_s > ep.DECODE_STEP_SLO_S


@pytest.fixture(scope="module")
def json_out():
    """The last line of ``ep_plan.py --json``, parsed."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ep_plan.py"), "--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_json_ends_with_every_systems_plan(json_out):
    last = json_out
    assert set(last["hardware"]) == {"b200", "gb200-nvl72", "ascend950pr", "ascend950dt"}
    for v in last["hardware"].values():
        assert v["plan"]["decode"]["degrees"] and v["plan"]["prefill"]["degrees"]
    assert last["hardware"]["b200"]["plan"]["prefill"]["degrees"][0] >= 2


# ---- the disaggregated deployment -------------------------------------------------------------------------

SEED_SYSTEMS = ("b200", "gb200-nvl72", "ascend950")


@pytest.fixture(scope="module")
def pd(ep):
    """Every model on every default system at the seed workload, in the engine's bf16 cache: (scenario, result)."""
    keys = [k for key in SEED_SYSTEMS for k in ep.ALIASES.get(key, (key,))]
    found = {}
    for system in ep.pd_systems(keys):
        for model in ep.MODELS.values():
            sc = ep.PdScenario(model, system, ep.SEED_WORKLOAD, ep.KV_FORMATS["bf16"], ep.KV_LINKS[system.decode],
                               ep.EXPERT_LOAD_CV, False)
            found[system.key, model.name] = (sc, ep.pd_result(sc))
    return found


def test_every_model_runs_on_every_seed_system(ep, pd):
    assert {key for key, _ in pd} == set(SEED_SYSTEMS)
    assert {name for _, name in pd} == {"DeepSeek-V4-Flash", "DeepSeek-V4.1-Flash"}
    assert pd["ascend950", "DeepSeek-V4-Flash"][0].system == ep.PdSystem("ascend950", "ascend950pr", "ascend950dt",
                                                                          "ascend950dt")


def test_prefill_groups_are_narrower_than_decode_groups_for_the_seed_workload(pd):
    for (system, model), (_, res) in pd.items():
        assert res.choice is not None, (system, model)
        assert res.choice.prefill_ep < res.choice.decode_ep, (system, model, res.choice)
        chosen = {r.ep: r for r in res.prefill}[res.choice.prefill_ep]
        assert chosen.feasible and chosen.tokens_per_s_per_gpu >= 0.9 * max(r.tokens_per_s_per_gpu for r in res.prefill)
        assert res.choice.decode_tokens_per_s_per_card == max(r.tokens_per_s_per_gpu for r in res.decode)


def _cache_bytes_per_token(config: dict) -> float:
    """bf16 compressed entries (head_dim) and indexer keys (index_head_dim) per token of context, from config.json:
    V4 keeps them in every compressed layer (keys in the ratio-4 ones); V4.1 only in its KV source layers."""
    text = config.get("text_config", config)
    ratios = text["compress_ratios"][: text["num_hidden_layers"]]
    if "kv_source_layer_ids" in text:
        owners = {i: True for i in text["kv_source_layer_ids"]}
    else:
        owners = {i: r == 4 for i, r in enumerate(ratios) if r}
    return sum(2 * (text["head_dim"] + (text["index_head_dim"] if keys else 0)) / ratios[i] for i, keys in owners.items())


def test_kv_bytes_per_request_are_the_prompt_times_the_cache_per_token(ep, pd):
    import torch

    from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for
    from tests.helpers.published import V4_FLASH, V41_FLASH

    configs = {"DeepSeek-V4-Flash": V4_FLASH, "DeepSeek-V4.1-Flash": V41_FLASH}
    assert _cache_bytes_per_token(V4_FLASH) == 6880 and _cache_bytes_per_token(V41_FLASH) == 3200
    for (system, name), (sc, res) in pd.items():
        per_token = _cache_bytes_per_token(configs[name])
        t = res.kv_transfer
        assert t.prompt_len == ep.SEED_WORKLOAD.prompt_len
        assert t.per_token_bytes == per_token
        assert t.entry_bytes == ep.SEED_WORKLOAD.prompt_len * per_token
        assert t.total_bytes == pytest.approx(t.entry_bytes + t.ring_bytes, rel=1e-12)
        assert t.transfer_ms == pytest.approx(t.total_bytes / (sc.link.bw * ep.LINK_EFFICIENCY) * 1e3)
    for name, config in configs.items():  # the engine's cache planner sizes the same state, ring for ring, in either layout
        mc = parse_config(config)
        model = next(m for m in ep.MODELS.values() if m.name == name)
        for fmt, kv_cache_dtype in (("bf16", "model"), ("fp8", "fp8")):
            geometry = CacheGeometry.build(mc, block_size_for(mc, 256), 1, 1 << 20, kv_cache_dtype)
            assert ep.kv_bytes_per_token(ep.KV_FORMATS[fmt], model) == geometry.bytes_per_token(torch.bfloat16), (name, fmt)
            assert ep.kv_ring_bytes(ep.KV_FORMATS[fmt], model) == geometry.bytes_per_slot(torch.bfloat16), (name, fmt)
    v4, v41 = (ep.KV_FORMATS["fp8"].of(m) for m in (ep.V4_FLASH, ep.V41_FLASH))
    assert (v4.window_bytes, v4.entry_bytes, v4.index_key_bytes) == (584, 584, 68)  # DeepSeek's FlashMLA / DeepGEMM layout
    assert (v41.window_bytes, v41.entry_bytes, v41.index_key_bytes) == (528, 288, 68)
    assert ep.kv_bytes_per_token(ep.KV_FORMATS["fp8"], ep.V4_FLASH) == 3514.25 and ep.kv_bytes_per_token(ep.KV_FORMATS["fp8"], ep.V41_FLASH) == 890


def test_v41_shapes_match_the_engines_config_and_weight_count(ep, tmp_path):
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer.weight_memory import weight_memory
    from tests.helpers.published import V41_FLASH, v41_norm_elements

    layers = DeepseekV41Config.from_hf(V41_FLASH).text_config.layers()
    assert len(layers) == ep.V41_FLASH.n_layers
    for kind, layer in zip(ep.V41_FLASH.layers, layers):
        assert (kind.ratio, kind.owns_entries, bool(kind.scores), kind.engram) == (
            layer.compress_ratio, layer.owns_kv, layer.runs_indexer, layer.engram_table is not None)
        assert (kind.scores == "candidates") == (layer.candidates == "read")
    (tmp_path / "config.json").write_text(json.dumps(V41_FLASH))
    backbone = weight_memory(tmp_path).parts["backbone"]
    assert ep.V41_FLASH.routed_bytes == backbone.routed_expert_bytes
    # the plan counts the norms as stored (BF16); the engine holds them in fp32
    upcast = 2 * v41_norm_elements()[0]
    assert ep.replicated_weight_bytes(ep.V41_FLASH) == backbone.total_bytes - backbone.routed_expert_bytes - upcast
    assert ep.V41_FLASH.degrees == (1, 2, 4, 8, 16, 32, 64, 128)  # 384 experts split evenly


def test_balanced_pools_make_prefill_supply_meet_decode_demand(ep, pd):
    for (system, model), (sc, res) in pd.items():
        wl, prefill = sc.workload, {r.ep: r for r in res.prefill}[res.choice.prefill_ep]
        supply = res.choice.prefill_cards_per_decode_card * res.choice.prefill_tokens_per_s_per_card
        assert supply == pytest.approx(res.choice.decode_tokens_per_s_per_card / wl.output_len * wl.prompt_len)
        for decode in (r for r in res.decode if r.feasible):
            for total in (64, 128, 512):
                np_, nd = ep.balanced_pools(sc, prefill, decode, total)
                if not nd:
                    continue
                demand = nd * decode.tokens_per_s_per_gpu / wl.output_len * wl.prompt_len  # prompt tokens/s
                assert np_ * prefill.tokens_per_s_per_gpu >= demand, (system, model, decode.ep, total)
                assert (np_ - prefill.ep) * prefill.tokens_per_s_per_gpu < demand  # no prefill group to spare
                assert np_ % prefill.ep == 0 and nd % decode.ep == 0 and np_ + nd <= total
        balanced = next(d for d in res.deployments if d.label.startswith("balanced"))
        assert balanced.bound == "decode" and balanced.cards <= 128


def test_the_seed_64_plus_64_row_exists_for_each_model_and_system(ep, pd):
    for (system, model), (sc, res) in pd.items():
        colocated, seed = res.deployments[0], res.deployments[1]
        assert colocated.label == "colocated 128" and colocated.bound == "colocated" and colocated.cards == 128
        assert colocated.tpot_ms <= sc.workload.tpot_slo_s * 1e3 + 1e-9 and colocated.vs_colocated == 1
        assert seed.label == "64+64, seed's degrees", (system, model)
        assert (seed.prefill_cards, seed.decode_cards, seed.decode_ep) == (64, 64, 64)
        assert seed.prefill_ep in ep.SEED_PREFILL_DEGREES and seed.bound in ("prefill", "decode")
        assert seed.vs_colocated == pytest.approx(seed.output_tokens_per_s_per_card
                                                  / colocated.output_tokens_per_s_per_card)
        assert 0 < seed.vs_colocated and seed.tpot_ms <= sc.workload.tpot_slo_s * 1e3 + 1e-9


def test_json_holds_the_disaggregated_deployment(json_out):
    pd = json_out["disaggregated"]
    assert set(pd["systems"]) == set(SEED_SYSTEMS)
    assert pd["workload"]["prompt_len"] == 4096 and pd["kv_format"]["key"] == "bf16"
    assert pd["links"]["ascend950"]["assumed"] and not pd["links"]["b200"]["assumed"]
    for system in pd["systems"].values():
        assert set(system["models"]) == {"DeepSeek-V4-Flash", "DeepSeek-V4.1-Flash"}
        for m in system["models"].values():
            assert m["seed_vs_colocated"] > 0 and m["kv_transfer"]["total_bytes"] > 0
            assert m["choice"]["prefill_ep"] < m["choice"]["decode_ep"]
            assert [d["label"] for d in m["deployments"]][:2] == ["colocated 128", "64+64, seed's degrees"]
