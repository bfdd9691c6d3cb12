"""The EP cost model (benchmarks/ep_plan.py): its decode step grows with the batch, overlap stays within its
parts, the KV-bound batch grows with the EP degree, chosen batches are the largest that meet the step bound,
and --json ends with one object holding every system's plan."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import load_script

ROOT = Path(__file__).resolve().parents[1]


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


def test_json_ends_with_every_systems_plan():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ep_plan.py"), "--json"], capture_output=True, text=True, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last["hardware"]) == {"b200", "gb200-nvl72", "ascend950pr", "ascend950dt"}
    for v in last["hardware"].values():
        assert v["plan"]["decode"]["degrees"] and v["plan"]["prefill"]["degrees"]
    assert last["hardware"]["b200"]["plan"]["prefill"]["degrees"][0] >= 2
