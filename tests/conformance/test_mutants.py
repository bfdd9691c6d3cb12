"""Every mutant kernel set (``tests/conformance/mutants.py``) fails op parity on exactly the ops it breaks, and e2e parity
in the case that exercises its bug; the correct alternative sets pass everything.

Each mutant is installed as a real plugin (a dist-info next to a copy of the
module) and checked by ``deepinfer conformance --kernels NAME --suite ops,e2e``,
every op spec included so that "only the ops it breaks" is checked against the
whole suite (the full op suite takes about a second). The commands run in two
processes side by side (``run_cli_batch``), which share the reference's e2e
decodes of each checkpoint.

E2E needs a checkpoint where the bug changes the model's output:

- ``mixed`` (every layer type, hash and learned routing) for most, the
  clamp mutants included: ``mixed`` keeps transformers' default limit of
  10, which its activations never reach, but the e2e ``clamp`` case runs a
  copy with a limit they do reach;
- ``compressed_yarn`` for the missing clamp too: its ``swiglu_limit`` of 0.3
  is active in every case;
- ``mixed`` with ``rms_norm_eps`` raised to 1e-2 for the missing eps: at the
  default 1e-6 the eps is far below the mean square of every normed vector, so
  dropping it changes the logits by ~1e-6, under any fair fp32 threshold.

The packed KV cache mutants (``tests/conformance/mutants_kv.py``) run op parity only, over the packed-cache
ops (and the attention ops for the one whose bug is there), in the same batch: each must fail exactly the
ops it breaks.

The batch-invariance mutant (``mutants.INVARIANCE_MUTANTS``: a linear within tolerance whose reduction split
depends on the batch size) runs the default suites (op parity and batch invariance) over two ops: it passes
op parity and fails only its op's batch-invariance cases.

The communicator mutant (a dispatch that drops the last token) is covered by
``tests/conformance/test_conformance_comm.py::test_dispatch_that_drops_a_token_fails``.
"""

import json
import shutil
from pathlib import Path

import pytest

from tests.conformance import mutants, mutants_kv
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.published import make_published_checkpoint
from tests.helpers.plugins import make_plugin_dist, run_cli_batch

#: mutant -> (ops whose parity it must fail, checkpoint for e2e, e2e cases that must fail)
EXPECTED = {
    "mutant-no-eps": ({"rms_norm"}, "large_eps", {"greedy"}),
    "mutant-rope-halves": ({"rope"}, "mixed", {"greedy"}),
    "mutant-no-sink": ({"sparse_attention"}, "mixed", {"greedy"}),
    "mutant-window-short": ({"sparse_attention"}, "mixed", {"greedy"}),
    "mutant-no-route-bias": ({"moe_route"}, "mixed", {"greedy"}),
    "mutant-no-renorm": ({"moe_route", "hash_route"}, "mixed", {"greedy"}),
    "mutant-no-clamp": ({"swiglu", "moe_experts"}, "compressed_yarn", {"greedy", "clamp"}),
    "mutant-short-sinkhorn": ({"mhc_pre"}, "mixed", {"greedy"}),
    "mutant-fp8-last-block-scale": ({"fp8_linear"}, "published", {"greedy"}),
    "mutant-fp4-swapped-nibbles": ({"moe_experts_quantized"}, "published", {"greedy"}),
    "mutant-sample-times-noise": ({"sample"}, "mixed", {"sample"}),
    "mutant-sample-squeeze": ({"sample"}, "mixed", {"sample"}),
    "mutant-bitmask-msb-first": ({"apply_token_bitmask"}, "mixed", {"constrained"}),
    "mutant-one-token-no-sink": ({"sparse_attention"}, "mixed", {"single"}),
    "mutant-clamp-up-above-only": ({"swiglu", "moe_experts"}, "mixed", {"clamp"}),
    "mutant-bf16-rope-inverse": ({"rope"}, "mixed", {"greedy-bf16"}),
}
#: packed-cache mutant -> ops whose parity it must fail (packing bugs fail cache_write too: it packs through kv_pack)
PACKED_EXPECTED = {
    "mutant-kv-half-block-scale": {"kv_pack", "cache_write"},
    "mutant-kv-rope-rounded": {"kv_pack", "cache_write"},
    "mutant-kv-fp8-truncates": {"kv_pack", "cache_write"},
    "mutant-kv-fp4-truncates": {"kv_pack", "cache_write"},
    "mutant-kv-nibbles-swapped": {"kv_pack", "kv_unpack", "cache_write"},
    "mutant-kv-ue8m0-floor": {"kv_pack", "cache_write"},
    "mutant-kv-no-amax-floor": {"kv_pack", "cache_write"},
    "mutant-hadamard-bf16-sums": {"hadamard"},
    "mutant-kv-unpack-bf16-multiply": {"kv_unpack"},
    "mutant-packed-attention-wrong-format": {"sparse_attention", "entry_attention"},
}
#: the packed-cache ops every packed-cache kernel set runs (besides the ops it must fail)
PACKED_OPS = {"kv_pack", "kv_unpack", "hadamard", "cache_write"}
#: the mutants the greedy, batched, fp32 case alone misses (the reason for the other cases)
HIDDEN_FROM_GREEDY = {
    "mutant-sample-times-noise", "mutant-sample-squeeze", "mutant-bitmask-msb-first", "mutant-one-token-no-sink",
    "mutant-clamp-up-above-only", "mutant-bf16-rope-inverse",
}


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(mutants.MUTANTS)
    assert HIDDEN_FROM_GREEDY <= set(EXPECTED) and not set(mutants.ALTERNATIVES) & set(EXPECTED)
    assert set(PACKED_EXPECTED) == set(mutants_kv.MUTANTS) and not set(mutants_kv.CORRECT) & set(PACKED_EXPECTED)


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mutants")
    kernels = {name: f"deepinfer_test_mutants:{cls}"
               for name, cls in {**mutants.MUTANTS, **mutants.ALTERNATIVES, **mutants.INVARIANCE_MUTANTS}.items()}
    kernels.update({name: f"deepinfer_test_mutants_kv:{cls}" for name, cls in {**mutants_kv.MUTANTS, **mutants_kv.CORRECT}.items()})
    return make_plugin_dist(
        root,
        "deepinfer-test-mutants",
        {"deepinfer.kernels": kernels},
        {"deepinfer_test_mutants": Path(mutants.__file__).read_text(), "deepinfer_test_mutants_kv": Path(mutants_kv.__file__).read_text()},
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ckpt")
    mixed = make_tiny_checkpoint(tmp, "mixed")
    large_eps = tmp / "tiny-mixed-eps1e-2"
    shutil.copytree(mixed, large_eps)
    config = json.loads((large_eps / "config.json").read_text())
    config["rms_norm_eps"] = 1e-2
    (large_eps / "config.json").write_text(json.dumps(config))
    return {
        "mixed": mixed, "large_eps": large_eps, "compressed_yarn": make_tiny_checkpoint(tmp, "compressed_yarn"),
        "published": make_published_checkpoint(tmp),
    }


@pytest.fixture(scope="module")
def reports(plugin_root, checkpoints, tmp_path_factory) -> dict[str, tuple[object, dict | None]]:
    out = tmp_path_factory.mktemp("reports")
    names = [*EXPECTED, *mutants.ALTERNATIVES]
    commands = [
        ["conformance", "--backend", "cpu", "--kernels", name, "--suite", "ops,e2e",
         "--model", str(checkpoints[EXPECTED[name][1] if name in EXPECTED else "mixed"]), "--report", str(out / f"{name}.json")]
        for name in names
    ]
    packed = [*PACKED_EXPECTED, *mutants_kv.CORRECT]
    names += packed
    for name in packed:
        ops = [arg for op in sorted(PACKED_OPS | PACKED_EXPECTED.get(name, set())) for arg in ("--ops", op)]
        commands.append(["conformance", "--backend", "cpu", "--kernels", name, "--suite", "ops", *ops, "--report", str(out / f"{name}.json")])
    for name in mutants.INVARIANCE_MUTANTS:
        names.append(name)
        commands.append(["conformance", "--backend", "cpu", "--kernels", name, "--ops", "linear", "--ops", "rms_norm",
                         "--report", str(out / f"{name}.json")])
    procs = run_cli_batch(commands, extra_path=plugin_root, env={"OMP_NUM_THREADS": "1"})
    return {name: (proc, json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else None)
            for name, proc in zip(names, procs)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mutant_fails_its_ops_and_e2e(name, reports):
    proc, report = reports[name]
    assert report is not None, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert report["kernels"] == name
    rows = report["results"]
    ops_failing = {r["op"] for r in rows if r["suite"] == "ops" and r["status"] == "fail"}
    assert ops_failing == EXPECTED[name][0], [r for r in rows if r["status"] == "fail"][:3]
    assert all(r["status"] == "pass" for r in rows if r["suite"] == "ops" and r["op"] not in EXPECTED[name][0])
    e2e = [r for r in rows if r["suite"] == "e2e"]
    e2e_failing = {r["op"] for r in e2e if r["status"] in ("fail", "error")}
    assert EXPECTED[name][2] <= e2e_failing, [(r["op"], r["case"], r["status"]) for r in e2e]
    if name in HIDDEN_FROM_GREEDY:
        assert all(r["status"] == "pass" for r in e2e if r["op"] == "greedy"), [r for r in e2e if r["op"] == "greedy"]
    assert "e2e    " in proc.stdout


@pytest.mark.parametrize("name", sorted(mutants.ALTERNATIVES))
def test_correct_alternative_passes_every_suite(name, reports):
    proc, report = reports[name]
    assert report is not None, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = [r for r in report["results"] if r["status"] not in ("pass", "not_supported")]
    assert not bad, bad[:3]
    assert {r["op"] for r in report["results"] if r["suite"] == "e2e"} >= {"greedy", "single", "sample", "constrained", "clamp"}


@pytest.mark.parametrize("name", sorted(PACKED_EXPECTED))
def test_packed_cache_mutant_fails_its_ops(name, reports):
    proc, report = reports[name]
    assert report is not None, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = report["results"]
    assert {r["op"] for r in rows} == PACKED_OPS | PACKED_EXPECTED[name]
    failing = {r["op"] for r in rows if r["status"] == "fail"}
    assert failing == PACKED_EXPECTED[name], [r for r in rows if r["status"] != "pass"][:3]
    assert all(r["status"] == "pass" for r in rows if r["op"] not in failing)


@pytest.mark.parametrize("name", sorted(mutants_kv.CORRECT))
def test_correct_packed_alternative_passes(name, reports):
    proc, report = reports[name]
    assert report is not None, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {r["op"] for r in report["results"]} == PACKED_OPS
    assert all(r["status"] == "pass" for r in report["results"]), [r for r in report["results"] if r["status"] != "pass"][:3]


@pytest.mark.parametrize("name", sorted(mutants.INVARIANCE_MUTANTS))
def test_batch_dependent_kernel_fails_only_batch_invariance(name, reports):
    proc, report = reports[name]
    assert report is not None, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = report["results"]
    failing = [r for r in rows if r["status"] == "fail"]
    assert {r["op"] for r in failing} == {"linear"}, failing[:3]
    assert all(r["case"].endswith("_batch_invariance") and "not batch-invariant" in r["message"] for r in failing)
    assert any(r["case"].endswith("_batch_invariance") and r["op"] == "rms_norm" and r["status"] == "pass" for r in rows)
    assert all(r["status"] == "pass" for r in rows if not r["case"].endswith("_batch_invariance"))
