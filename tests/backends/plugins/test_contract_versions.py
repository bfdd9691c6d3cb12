"""Plugins written for an older minor version of the contract keep working: the engine and the conformance suite
hand their code only what that version had, and route newer features to the reference.

The plugin (``contract_1_0.py``) is pinned to 1.0, the oldest version the policy honours, and overrides
``cache_write``, ``sparse_attention``, ``indexer_scores`` and ``rms_norm`` with plain-tensor code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer_conformance.invariance import SUFFIX as INVARIANCE
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import INTERFACE_VERSION, Backend, Kernels, PackedPool
from deepinfer_interfaces.features import BASE, BY_NAME, FEATURES, oldest_supported
from deepinfer_interfaces.kv_format import KVFormat
from deepinfer_interfaces.version import declared_version, major_minor
from deepinfer_interfaces.versioned import versioned_device, versioned_kernels
from tests.backends.plugins import contract_1_0
from tests.helpers.plugins import make_plugin_dist, run_cli

ROOT = Path(__file__).resolve().parents[3]
#: every value of EngineConfig.kv_cache_dtype
KV_CACHE_DTYPES = typing.get_args(EngineConfig.model_fields["kv_cache_dtype"].annotation)


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    return make_plugin_dist(
        tmp_path_factory.mktemp("contract-1-0"),
        "deepinfer-test-contract-1-0",
        {
            "deepinfer.backends": {"contract-1-0": "deepinfer_test_contract_1_0:Contract10Backend"},
            "deepinfer.kernels": {"contract-1-0": "deepinfer_test_contract_1_0:Contract10Kernels"},
        },
        {"deepinfer_test_contract_1_0": Path(contract_1_0.__file__).read_text()},
    )


def test_every_op_is_tagged_with_the_version_that_introduced_it():
    tagged = [op for f in (BASE, *FEATURES) for op in f.ops]
    assert sorted(tagged) == sorted(Kernels.ops()), "a new op needs its Feature in deepinfer_interfaces/features.py"
    versions = [major_minor(f.since) for f in FEATURES]
    assert versions == sorted(versions) and versions[-1] == major_minor(INTERFACE_VERSION)
    assert BY_NAME["packed-pools"].since == "1.5" and BY_NAME["vit-attention"].since == "1.6"
    assert oldest_supported(INTERFACE_VERSION) == "1.0"


def test_a_declared_version_is_never_inherited_from_the_contract():
    class Unstated(Kernels):
        pass

    class Stated(Kernels):
        interface_version = "1.2"

    class Child(Stated):
        pass

    class Bundle(Backend):
        name = device = kernels = "x"

    assert declared_version(Unstated, Kernels) is None and declared_version(Bundle, Backend) is None
    assert declared_version(Child, Kernels) == "1.2" and declared_version(Kernels, Kernels) == INTERFACE_VERSION


def _packed_pool(rows: int = 8) -> PackedPool:
    return PackedPool.allocate([(rows, KVFormat("test.fp8", 64, "e4m3", 64, "ue8m0"))], 64, torch.float32, "cpu")


def test_the_engine_never_hands_an_old_kernel_set_a_newer_argument_or_op():
    own = contract_1_0.Contract10Kernels()
    values, slots = torch.randn(3, 64), torch.tensor([5, -1, 2])
    with pytest.raises(AttributeError, match="'PackedPool' object has no attribute 'index_copy_'"):
        own.cache_write(_packed_pool(), slots, values)  # what the vendor saw before versions were honoured

    adapted = versioned_kernels(contract_1_0.Contract10Kernels)
    assert issubclass(adapted, contract_1_0.Contract10Kernels) and adapted is not contract_1_0.Contract10Kernels
    assert contract_1_0.Contract10Kernels.cache_write is own.cache_write.__func__  # the plugin's class is untouched
    packed, reference = _packed_pool(), _packed_pool()
    contract_1_0.CALLS.clear()
    adapted().cache_write(packed, slots, values)
    Kernels().cache_write(reference, slots, values)
    assert torch.equal(packed.regions[0].data, reference.regions[0].data) and not contract_1_0.CALLS
    plain = torch.zeros(8, 64)
    adapted().cache_write(plain, slots, values)
    assert contract_1_0.CALLS == {("cache_write", "Tensor"): 1} and torch.equal(plain[[5, 2]], values[[0, 2]])
    assert {f.name for f in adapted.routed_features} >= {"packed-pools", "vit-attention", "kv-quant"}
    assert "map-host" not in {f.name for f in adapted.routed_features}  # a device feature: the bundle's device

    class OldWithNewerOp(contract_1_0.Contract10Kernels):
        def vit_attention(self, q, k, v, cu_seqlens, scale):
            raise AssertionError("a 1.0 kernel set is never called for a 1.6 op")

    class DeclaresTheNewerOp(OldWithNewerOp):
        extra_features = ("vit-attention",)

    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4])
    want = Kernels().vit_attention(q, q, q, cu, 0.5)
    assert torch.equal(versioned_kernels(OldWithNewerOp)().vit_attention(q, q, q, cu, 0.5), want)
    with pytest.raises(AssertionError, match="never called"):
        versioned_kernels(DeclaresTheNewerOp)().vit_attention(q, q, q, cu, 0.5)


def test_a_device_in_an_old_bundle_keeps_the_default_for_newer_methods():
    assert versioned_device(CPUDevice, "1.0")().map_host(torch.ones(3)) is None
    assert versioned_device(CPUDevice, "1.6") is CPUDevice
    assert versioned_device(CPUDevice, "1.0", ("map-host",)) is CPUDevice


def test_a_1_0_plugin_passes_conformance_with_newer_features_not_applicable(plugin_dir, tmp_path):
    report = tmp_path / "report.json"
    proc = run_cli(["conformance", "--backend", "contract-1-0", "--suite", "ops,invariance,e2e", "--e2e-cases", "greedy,single",
                    "--report", str(report)], extra_path=plugin_dir, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["kernels_interface_version"] == "1.0" and data["summary"]["fail"] == data["summary"]["error"] == 0
    rows = [r for r in data["results"] if r["suite"] == "ops" and not r["case"].endswith(INVARIANCE)]
    na = [r for r in rows if r["status"] == "not_applicable"]
    invariance = [r for r in data["results"] if r["case"].endswith(INVARIANCE)]
    assert invariance and all(r["status"] == "not_applicable" and "batch-invariance arrived in contract 1.7" in r["message"]
                              for r in invariance)
    assert data["summary"]["not_applicable"] == len(na) + len(invariance)
    newer_ops = {op for f in FEATURES for op in f.ops}
    assert {r["op"] for r in na} == newer_ops | (set(BY_NAME["packed-pools"].argument_ops) & set(BASE.ops))
    assert all(r["status"] == "not_applicable" for r in rows if r["op"] in newer_ops)
    # the plain-pool cases of the 1.0 ops it overrides are checked, the packed-pool ones are not applicable
    for op in ("cache_write", "sparse_attention", "indexer_scores"):
        checked = {r["case"] for r in rows if r["op"] == op and r["status"] == "pass"}
        skipped = {r["case"] for r in rows if r["op"] == op and r["status"] == "not_applicable"}
        assert checked and skipped and all("packed" in c for c in skipped) and not any("packed" in c for c in checked)
    note = next(r["message"] for r in na if r["op"] == "cache_write")
    assert "packed-pools arrived in contract 1.5; this kernel set declares 1.0" in note
    assert next(r["message"] for r in na if r["op"] == "vit_attention").startswith("vit-attention arrived in contract 1.6")
    assert {r["status"] for r in data["results"] if r["suite"] == "e2e"} == {"pass"}
    assert " n/a " in proc.stdout and f"not_applicable {len(na) + len(invariance)}" in proc.stdout


GENERATE = """
    import io, json, logging, sys
    from deepinfer import LLM, SamplingParams
    import deepinfer_test_contract_1_0 as plugin

    lines = io.StringIO()
    logging.getLogger("deepinfer").addHandler(logging.StreamHandler(lines))
    logging.getLogger("deepinfer").setLevel(logging.INFO)
    prompts = ["The capital of France is", "def fib(n):", list(range(1, 13)) * 6]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = {}
    runs = [(kv, {"kv_cache_dtype": kv}) for kv in sys.argv[1:]] + [("deterministic", {"deterministic": True})]
    for label, settings in runs:
        row = {}
        for backend in ("cpu", "contract-1-0"):
            plugin.CALLS.clear()
            llm = LLM(backend=backend, max_model_len=256, **settings)
            row[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            row[backend + "-calls"] = {f"{op}:{kind}": n for (op, kind), n in plugin.CALLS.items()}
            del llm
        out[label] = row
    out["log"] = [line for line in lines.getvalue().splitlines() if "contract-1-0" in line]
    print(json.dumps(out))
"""


def test_a_1_0_plugin_generates_what_the_reference_does_under_every_kv_cache_dtype(plugin_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE), *KV_CACHE_DTYPES], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "fp8" in KV_CACHE_DTYPES and "model" in KV_CACHE_DTYPES
    for kv in KV_CACHE_DTYPES:
        row = out[kv]
        assert row["contract-1-0"] == row["cpu"], kv
        calls = row["contract-1-0-calls"]
        assert calls.get("cache_write:Tensor", 0) > 0 and calls.get("sparse_attention:Tensor", 0) > 0, (kv, calls)
        assert not any("PackedPool" in key for key in calls), (kv, calls)
        assert not row["cpu-calls"]
    # batch-invariant (deterministic) mode arrived in 1.7: while it is on, none of the plugin's 1.0 code runs
    assert out["deterministic"]["contract-1-0"] == out["deterministic"]["cpu"]
    assert out["deterministic"]["contract-1-0-calls"] == {}
    # one start-up line per engine, naming what runs on the reference and since when
    assert len(out["log"]) == len(KV_CACHE_DTYPES) + 1
    assert "contract 1.0" in out["log"][0] and "packed-pools (1.5)" in out["log"][0] and "map-host (1.6)" in out["log"][0]
    assert "batch-invariance (1.7)" in out["log"][0]
